"""The correctness preflight as one step: golden parity of the custom loss path, the result's
``correctness_preflight`` block with the restoration preflight's LR-scaling probe attached, the
validator's verdict on that block, and the registry parity of every loss the plan's arms train.
Nothing here writes files: `stages.write.write_correctness` records what the result carries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dppo_harness.json_types import JsonObject
from dppo_harness.loss.correctness import build_preflight_block, spec_tolerances, validate_preflight
from dppo_harness.loss.correctness_golden import (
    REGISTRY_TOLERANCE,
    GoldenReport,
    LossParity,
    check_golden,
    registered_loss_parity,
)
from dppo_harness.loss.golden import MODES
from dppo_harness.loss.loss_registry import DPPO_LOSS, get_loss
from dppo_harness.stages.restoration import LrScalingBlock, attach_lr_scaling

# The golden file the preflight checks, relative to the project root: the registered losses' own.
GOLDEN_FIXTURE = Path(get_loss(DPPO_LOSS).golden.file)


@dataclass(frozen=True)
class CorrectnessPreflight:
    """What the correctness preflight found; `block` is what result.json records."""

    golden: Path  # the golden file checked
    report: GoldenReport  # every golden case x mode through the packed path
    parity: tuple[LossParity, ...]  # one per trained loss, sorted by name
    block: JsonObject  # the correctness_preflight block, lr_scaling attached
    status: str  # the validator's verdict on `block`: passed / failed / not_applicable
    messages: tuple[str, ...]  # the validator's lines

    @property
    def passed(self) -> bool:
        """Every golden case passes, every trained loss matches its reference and golden cases,
        and the validator passes the block (``not_applicable`` is not a pass here)."""
        return self.report.n_failed == 0 and all(p.passed for p in self.parity) and self.status == "passed"

    def failures(self) -> list[str]:
        """One line per problem (empty when `passed`)."""
        out = [r.line() for r in self.report.results if not r.passed]
        for p in self.parity:
            out += list(p.failures) or ([] if p.passed else [f"{p.loss}: no golden cases checked"])
        if self.status != "passed":
            out += [f"validator: {self.status}", *self.messages]
        return out

    def golden_report_json(self) -> JsonObject:
        """``correctness-golden-report.json``: the golden report and the registry parity."""
        return {
            **self.report.to_json(),
            "loss_registry_parity": {
                "tolerance": {**REGISTRY_TOLERANCE},
                "losses": [
                    {"loss": p.loss, "cases": p.cases, "passed": p.passed, "failures": list(p.failures)}
                    for p in self.parity
                ],
            },
        }

    def preflight_json(self) -> JsonObject:
        """``correctness-preflight.json``: the validator's verdict with the block it judged."""
        return {"status": self.status, "messages": list(self.messages), "correctness_preflight": self.block}


def run_correctness_preflight(
    spec: JsonObject,
    lr_scaling: LrScalingBlock,
    losses: Iterable[str],
    root: Path,
    golden: Path | None = None,
    modes: Sequence[str] = MODES,
    progress: Callable[[str], None] | None = None,
) -> CorrectnessPreflight:
    """The correctness preflight's findings. The tolerances come from `spec`'s path
    ``grpo_dppo_custom_loss`` (ValueError naming it when absent); `lr_scaling` is attached to every
    path of the block; each of `losses` gets ``registered_loss_parity`` against its golden cases
    under `root`; `golden` defaults to `root` / ``GOLDEN_FIXTURE``."""
    root = Path(root)
    golden = Path(golden) if golden is not None else root / GOLDEN_FIXTURE
    report = check_golden(golden, modes, tolerances=spec_tolerances(spec), progress=progress)
    block = attach_lr_scaling(build_preflight_block(report, spec), lr_scaling)
    status, messages = validate_preflight(spec, block)
    parity = tuple(registered_loss_parity(name, root) for name in sorted(set(losses)))
    return CorrectnessPreflight(golden, report, parity, block, status, tuple(messages))
