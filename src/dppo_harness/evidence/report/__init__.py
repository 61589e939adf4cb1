"""`report.md` and its plots: the bounded diagnostic's report (`diagnostic`), the comparison's
(`comparison`), the matplotlib plots both draw (`plots`)."""

from dppo_harness.evidence.report.comparison import truncation_warnings, write_comparison_report
from dppo_harness.evidence.report.diagnostic import render_markdown, write_report
from dppo_harness.evidence.report.plots import make_plots

__all__ = ["make_plots", "render_markdown", "truncation_warnings", "write_comparison_report", "write_report"]
