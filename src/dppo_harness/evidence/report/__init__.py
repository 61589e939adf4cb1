"""`report.md` and its plots: the bounded diagnostic's report (`diagnostic`), the comparison's
(`comparison`), the matplotlib plots both draw (`plots`)."""

from dppo_harness.evidence.report.comparison import (
    render_comparison_markdown,
    truncation_warnings,
    write_comparison_report,
)
from dppo_harness.evidence.report.diagnostic import render_markdown, write_report
from dppo_harness.evidence.report.plots import COMPARISON_PLOTS, PLOTS, make_plots
from dppo_harness.evidence.report.text import REPORT_FILE

__all__ = [
    "COMPARISON_PLOTS",
    "PLOTS",
    "REPORT_FILE",
    "make_plots",
    "render_comparison_markdown",
    "render_markdown",
    "truncation_warnings",
    "write_comparison_report",
    "write_report",
]
