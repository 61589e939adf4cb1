"""What `plans validate` tells a reader beside the effective config: every value read from the
spec's prose with the sentence it came from (or the default or resolution that set it), and
whether the decision can settle each criterion's margin at the planned item count."""

from __future__ import annotations

from dppo_harness.evaluation.stats import hoeffding_half_width
from dppo_harness.plans.plan import Plan
from dppo_harness.plans.prose import KEYS, Stated
from dppo_harness.plans.run_config import RunConfig

# The run config's names of values the prose reader reads under another key.
_RUN_NAME = {"minibatches": "minibatches_per_batch", "pilot_steps": "gate_pilot_steps"}


def _origin(s: Stated) -> str:
    if s.default:
        return f"default ({s.field}): {s.source}"
    if s.why:
        return f"settled by {s.field}: {s.source!r} (why: {s.why})"
    return f"from {s.field}: {s.source!r}"


def prose_lines(run: RunConfig) -> list[str]:
    """One line per value read from the prose (schedule values first), with where it came from."""
    values: dict[str, Stated] = dict(run.schedule_values())
    for key, stated in run.prose.items():
        values.setdefault(_RUN_NAME.get(key, key), stated)
    out = []
    for name, s in values.items():
        key = next((k for k, v in _RUN_NAME.items() if v == name), name)
        what = KEYS[key].what if key in KEYS else name
        out.append(f"  {name} = {s.value} ({what}) {_origin(s)}")
    return out


def decision_lines(run: RunConfig) -> list[str]:
    """Per criterion: the paired Hoeffding half-width at the planned test items next to its margin."""
    out = []
    for c in run.criteria:
        lo, hi = c.bounds
        span = hi - lo  # the difference lies in [-span, span]
        hw = hoeffding_half_width(run.eval_items, run.alpha, 2 * span)
        up, down = c.margin + hw, c.margin - hw
        out.append(
            f"  {c.id}: {c.metric} {c.treatment} - {c.baseline}: half-width {hw:.4g} at {run.eval_items} "
            f"paired items (alpha {run.alpha:g}, difference range {2 * span:g}) next to margin {c.margin:g}: "
            f"supported needs an observed mean difference above {up:.4g}{' (unreachable)' if up >= span else ''}"
            f", refuted one below {down:.4g}{' (unreachable)' if down <= -span else ''}"
        )
    return out


def reading_lines(plan: Plan) -> list[str]:
    """The information lines `plans validate` prints on stderr (none for a plan without prose)."""
    if plan.run is None:
        return []
    return [
        f"{plan.name}: values read from the spec's prose (config.run.stated_in_prose), each with its source:",
        *prose_lines(plan.run),
        f"{plan.name}: decision at the planned size (information, not a check):",
        *decision_lines(plan.run),
    ]
