"""A bundle written before the harness typed its records, rebuilt through today's records and
writers: the step rows, the decision and the result's backend block come out byte for byte."""

import json
from pathlib import Path

import pytest

from dppo_harness.evaluation import stats
from dppo_harness.evidence.backend import Backend
from dppo_harness.evidence.files import json_file_bytes
from dppo_harness.evidence.result import ResultModel
from dppo_harness.loss.terms import row_fraction
from dppo_harness.plans.run_config import CriterionConfig
from dppo_harness.stages.comparison import decision
from dppo_harness.stages.comparison.step_rows import fraction_names, jsonl
from dppo_harness.stages.write import DECISION_FILE

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "comparison-rehearsal"
FRACTIONS = ("dppo_masked_frac", "ppo_clip_frac", "last_update_masked_frac", "last_update_clip_frac")


def rebuilt_rows(lines: list[bytes]) -> bytes:
    """The rows read back and written again, each fraction under the label its arm's loss gives it."""
    out = []
    for line in lines:
        row = json.loads(line)
        names = fraction_names(row["loss"])
        again = {k: v for k, v in row.items() if not k.endswith(FRACTIONS)}
        again.update({names[base]: row_fraction(row, base).value for base in FRACTIONS})
        out.append(again)
    return jsonl(out)


def test_step_rows_rebuild_byte_for_byte():
    lines = (PINNED / "comparison-steps.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 6
    assert rebuilt_rows(lines) == b"".join(lines)


def test_a_row_with_the_wrong_label_is_not_what_the_writer_writes():
    line = (PINNED / "comparison-steps.jsonl").read_bytes().splitlines(keepends=True)[0]
    row = json.loads(line)
    key = next(k for k in row if k.startswith("counterfactual_"))
    row[key.removeprefix("counterfactual_")] = row.pop(key)  # a counterfactual fraction relabelled as trained
    relabelled = json.dumps(row, sort_keys=True).encode() + b"\n"
    assert rebuilt_rows([relabelled]) == line != relabelled


def test_the_decision_rebuilds_from_the_pinned_observations():
    pinned = (PINNED / "comparison-decision.json").read_bytes()
    want = json.loads(pinned)
    observations = (PINNED / "scored-observations.jsonl").read_bytes()
    rows = stats.read_observations(PINNED / "scored-observations.jsonl")
    criteria = [
        CriterionConfig(
            id=c["id"],
            metric=c["metric"],
            treatment=c["treatment"],
            baseline=c["baseline"],
            margin=c["margin"],
            bounds=(0.0, 1.0),
        )
        for c in want["criteria"]
    ]
    alpha = want["criteria"][0]["alpha"]
    decided = decision.decide_criteria(rows, criteria, alpha=alpha)
    block = decision.decision_block(
        observations,
        decided,
        decision.verdict(decided, rehearsal=True),
        rehearsal=True,
        informational=stats.paired_binary_informational(
            rows, criteria[0].treatment, criteria[0].baseline, alpha=alpha, metric=criteria[0].metric
        ),
    )
    assert json_file_bytes(DECISION_FILE, block) == pinned
    changed = decision.decision_block(
        observations + b"\n", decided, decision.verdict(decided, rehearsal=True), rehearsal=True
    )
    assert json_file_bytes(DECISION_FILE, changed) != pinned


def test_the_result_and_its_backend_block_validate_and_rebuild():
    raw = json.loads((PINNED / "result.json").read_bytes())
    ResultModel.model_validate(raw)
    backend = Backend.model_validate(raw["backend"])
    assert json.dumps(backend.to_json()) == json.dumps(raw["backend"])  # keys, order and values
    with pytest.raises(ValueError):
        Backend.model_validate({**raw["backend"], "served_modle": "x"})  # a misspelt key is refused
