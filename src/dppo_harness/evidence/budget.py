"""The evidence budget: how many files (and bytes) each stage of a plan will register, computed
from the plan before anything runs, with the session's closing records reserved first.

Everything here is pure. A stage's need has two parts:
- `files`: what it must register (its measurements, reports, manifests); a plan whose required
  files, plus the closing records, do not fit the bundle's limits is refused at load;
- `optional_files`: what it registers while there is room (result snapshots, saved run states);
  each is skipped, and the ledger says so, when only reserved slots are left.

The closing records (client releases, unit-parity summary, budget ledger, the last stage-end
snapshot) are reserved from the start, so no stage can starve the close.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from dppo_harness.evidence.files import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES
from dppo_harness.json_types import JsonObject

if TYPE_CHECKING:
    from dppo_harness.plans import Plan

MIB = 1024 * 1024

# Written when the session closes, reserved in the bundle from the session's start; the last
# service stage's end snapshot is counted with them.
CLOSING_RECORDS = ("client-identities.json", "client-releases.json", "unit-parity-summary.json", "budget-ledger.json")
CLOSING_FILES = len(CLOSING_RECORDS) + 1
CLOSING_BYTES = 2 * MIB

# At session start: code-revision.json, code.patch (counted always: a dirty tree writes it),
# code-archive.zip, test-files.json, the plan's bytes and effective-config.json.
SESSION_FILES = 6
SESSION_BYTES = 4 * MIB  # the code archive is about 2.5 MiB
# The correctness and restoration preflights (golden report and fixture, validator output, LR
# probe, fixed batch, initial output, probe, responses, provenance, the first client identity and
# the connectivity record).
PREFLIGHT_FILES = 12
PREFLIGHT_BYTES = 2 * MIB
PREFLIGHT_SNAPSHOTS = 1  # the preflight stage's end (optional)
# Result snapshots while a call waits on the service (optional; service.wait.evidence).
WAIT_SNAPSHOTS = 2

# The diagnostic's files besides its update records: the revised spec, frozen batch and its
# manifest, self-test, sentinels, prior references, original gate report, service-work ledger,
# analysis, next action, replay output, report.md and its 4 plots.
DIAGNOSTIC_FIXED_FILES = 16
DIAGNOSTIC_FIXED_BYTES = 2 * MIB  # besides the frozen batch: small JSON, text and plots
# The diagnostic posts a result snapshot every 4 updates, but for its last planned one: its
# stage-end snapshot follows at once.
SNAPSHOT_EVERY_UPDATES = 4
UPDATES_PER_ARCHIVE = 8  # update records per archive file, unless the bytes bound says fewer
# A record's bytes per token position, at most: 5 eight-byte columns (logprobs, anchor, advantage,
# mask, target) and 3 one-byte decisions, before compression (what decides the records per file).
RECORD_BYTES_PER_TOKEN = 43
# ... and as stored, compressed: an estimate with margin for the run's total (the embedded
# stand-in's records measure about 10 bytes per loss token); every write still checks the limits.
STORED_BYTES_PER_TOKEN = 20
RECORD_OVERHEAD_BYTES = 64 * 1024  # the JSON meta (context, stats, histograms) and zip headers
# Prompt tokens per sequence, at most: the longest GSM8K train question is 212 tokens; the chat
# template adds tens.
PROMPT_TOKENS_BOUND = 384

# The comparison's files after its last step: steps JSONL, end state, evaluator, observations,
# decision, report.md and its 4 plots; per arm its predictions (plus the base model's
# predictions); the run manifest comes first.
COMPARISON_END_FIXED = 10
COMPARISON_END_PER_ARM = 1
COMPARISON_END_BYTES = 6 * MIB
MID_STEP_RESTORES_PER_ARM = 1  # slots kept for a state registered by a restore inside a step
# A resume's own files: the reused-setup manifest and the state at the arms' restore.
RESUME_FILES = 2
# The gate's pilot: one record file per pilot step and the gate report; feasibility: its pilot file
# (a spec's preflight).
GATE_FIXED_FILES = 1
FEASIBILITY_FILES = 1


@dataclass(frozen=True)
class StageNeed:
    """What one stage will register: `files` it must, `optional_files` while there is room."""

    stage: str
    files: int
    bytes: int
    optional_files: int = 0
    detail: str = ""


@dataclass(frozen=True)
class BudgetNeeds:
    """A session's needs, stage by stage, and the closing records reserved before any of them."""

    stages: tuple[StageNeed, ...]
    closing_files: int = CLOSING_FILES
    closing_bytes: int = CLOSING_BYTES

    @property
    def required_files(self) -> int:
        return self.closing_files + sum(s.files for s in self.stages)

    @property
    def optional_files(self) -> int:
        return sum(s.optional_files for s in self.stages)

    @property
    def required_bytes(self) -> int:
        return self.closing_bytes + sum(s.bytes for s in self.stages)

    def as_record(self) -> JsonObject:
        """What ledger.json keeps of the session's budget (files counted, bytes estimated)."""
        return {
            "limit_files": MAX_FILES,
            "limit_bytes": MAX_TOTAL_BYTES,
            "required_files": self.required_files,
            "optional_files": self.optional_files,
            "estimated_bytes": self.required_bytes,
            "closing_records": [*CLOSING_RECORDS, "the last stage-end snapshot"],
            "stages": [asdict(s) for s in self.stages],
        }

    def largest(self) -> StageNeed:
        return max(self.stages, key=lambda s: s.files, default=StageNeed("none", 0, 0))


@dataclass(frozen=True)
class DiagnosticSize:
    """The figures of a bounded-diagnostic plan the budget depends on."""

    max_updates: int
    groups_per_minibatch: int
    group_size: int
    max_tokens: int
    groups_per_batch: int = 0  # the frozen batch's groups (0: one minibatch's)


@dataclass(frozen=True)
class ComparisonSize:
    """The figures of a comparison the budget depends on."""

    arms: int
    steps: int
    save_every: int
    gate_pilot_steps: int = 0
    resumed: bool = False


def _tokens_per_update(size: DiagnosticSize) -> int:
    return size.groups_per_minibatch * size.group_size * (size.max_tokens + PROMPT_TOKENS_BOUND)


def record_bytes_bound(size: DiagnosticSize) -> int:
    """The most bytes one update's record can take before compression."""
    return _tokens_per_update(size) * RECORD_BYTES_PER_TOKEN + RECORD_OVERHEAD_BYTES


def updates_per_archive(size: DiagnosticSize) -> int:
    """Update records per archive file: UPDATES_PER_ARCHIVE, fewer when their bound would pass the
    per-file limit; 0 when even one record cannot fit a file."""
    return min(UPDATES_PER_ARCHIVE, MAX_FILE_BYTES // record_bytes_bound(size))


def diagnostic_need(size: DiagnosticSize, groups_per_batch: int | None = None) -> StageNeed:
    """The diagnostic's files (its update records in archives) and an estimate of its bytes."""
    per = updates_per_archive(size)
    archives = math.ceil(size.max_updates / per) if per else size.max_updates
    stored = _tokens_per_update(size) * STORED_BYTES_PER_TOKEN + RECORD_OVERHEAD_BYTES
    frozen = (
        (groups_per_batch or size.groups_per_minibatch)
        * size.group_size
        * (size.max_tokens + PROMPT_TOKENS_BOUND)
        * STORED_BYTES_PER_TOKEN
    )
    return StageNeed(
        "diagnostic",
        DIAGNOSTIC_FIXED_FILES + archives,
        DIAGNOSTIC_FIXED_BYTES + frozen + size.max_updates * stored,
        optional_files=(size.max_updates - 1) // SNAPSHOT_EVERY_UPDATES + 1,
        detail=f"{size.max_updates} updates in {archives} archive file(s) of {per or 1}",
    )


def comparison_end_files(arms: int) -> int:
    """Files the comparison registers after its last step (steps, end state, evaluation, report)."""
    return COMPARISON_END_FIXED + COMPARISON_END_PER_ARM * arms + 1  # + the base model's predictions


def comparison_reserve(arms: int, mid_step_restores_left: int) -> int:
    """File slots a running comparison keeps free beyond the bundle's closing reserve: its end
    files, the mid-step restores it may still register, and its stage-end snapshot."""
    return comparison_end_files(arms) + mid_step_restores_left + 1


def comparison_need(size: ComparisonSize) -> StageNeed:
    saves = size.steps // size.save_every
    files = 1 + comparison_end_files(size.arms) + MID_STEP_RESTORES_PER_ARM * size.arms
    files += RESUME_FILES if size.resumed else 0
    return StageNeed(
        "comparison",
        files,
        COMPARISON_END_BYTES + saves * MIB // 4,
        optional_files=2 * saves,
        detail=f"{size.arms} arms, {size.steps} steps, a save every {size.save_every}",
    )


def gate_need(pilot_steps: int) -> StageNeed:
    return StageNeed(
        "gate",
        GATE_FIXED_FILES + pilot_steps,
        MIB + pilot_steps * MIB,
        optional_files=1,
        detail=f"{pilot_steps} pilot steps",
    )


def session_needs(
    stages: Sequence[str],
    *,
    diagnostic: DiagnosticSize | None = None,
    comparison: ComparisonSize | None = None,
    resolution: bool = False,
) -> BudgetNeeds:
    """The session's needs for the stages it will run (the unit stage registers no file); a plan
    read with a resolution file beside it registers that file too."""
    run = set(stages)
    needs = [StageNeed("session", SESSION_FILES + int(resolution), SESSION_BYTES, optional_files=WAIT_SNAPSHOTS)]
    if "preflight" in run:  # a spec's preflight also runs the feasibility pilot
        extra = FEASIBILITY_FILES if comparison is not None else 0
        needs.append(
            StageNeed("preflight", PREFLIGHT_FILES + extra, PREFLIGHT_BYTES, optional_files=PREFLIGHT_SNAPSHOTS)
        )
    if "gate" in run and comparison is not None:
        needs.append(gate_need(comparison.gate_pilot_steps))
    if "diagnostic" in run and diagnostic is not None:
        needs.append(diagnostic_need(diagnostic, diagnostic.groups_per_batch or None))
    if "comparison" in run and comparison is not None:
        needs.append(comparison_need(comparison))
    return BudgetNeeds(tuple(needs))


def plan_needs(plan: Plan, stages: Sequence[str], *, save_every: int = 1, resumed: bool = False) -> BudgetNeeds:
    """`session_needs` from a loaded plan: a bounded diagnostic's schedule, or a spec's arms,
    rollout steps and gate pilot (with the session's --save-every and --resume)."""
    if resumed:  # a resume registers the reused preflight and gate files again
        stages = [*stages, "preflight", "gate"]
    resolution = plan.resolution is not None
    if plan.kind == "bounded_diagnostic":
        d = plan.diagnostic
        return session_needs(
            stages,
            diagnostic=DiagnosticSize(
                d.schedule.max_optimizer_updates,
                d.schedule.groups_per_minibatch,
                d.schedule.group_size,
                d.fixed_settings.sampling.max_tokens,
                d.schedule.groups_per_batch,
            ),
            resolution=resolution,
        )
    if plan.run is None:
        return session_needs(stages, resolution=resolution)
    run = plan.run
    return session_needs(
        stages,
        comparison=ComparisonSize(
            len(run.arms), run.rollout_steps, save_every, int(run.gate_pilot_steps.value), resumed
        ),
        resolution=resolution,
    )


def refusal(needs: BudgetNeeds, plan_name: str) -> str | None:
    """One line when the plan cannot fit the bundle (needed vs limit, and what to change); else None."""
    big = needs.largest()
    if needs.required_files > MAX_FILES:
        return (
            f"evidence budget: plan {plan_name} needs {needs.required_files} evidence files "
            f"({', '.join(f'{s.stage} {s.files}' for s in needs.stages)}, closing records {needs.closing_files}); "
            f"the bundle holds {MAX_FILES}: reduce the {big.stage} stage ({big.detail})"
        )
    if needs.required_bytes > MAX_TOTAL_BYTES:
        return (
            f"evidence budget: plan {plan_name} needs up to {needs.required_bytes / MIB:.1f} MiB of evidence; "
            f"the bundle holds {MAX_TOTAL_BYTES // MIB} MiB: reduce the {big.stage} stage ({big.detail})"
        )
    return None
