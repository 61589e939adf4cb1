"""The resolution file beside a plan states what the spec has no field for: the schedule values its
method prose states, each with the sentence it quotes, and the baseline arm. The load-time check
refuses, in one line naming the field and the sentence, a sentence that is not verbatim in the spec
or that does not contain the number; a missing or malformed file is refused in one line too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle, session, verify_bundle
from dppo_harness.evidence.backend import Backend
from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.plans import PlanError, launch_refusal, load_plan, parse_plan, plan_config

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "plans" / "exp_e6b0965af3.json"
RESOLUTION = json.loads((ROOT / "plans" / "exp_e6b0965af3.json.resolution.json").read_text())
TRAINING = (
    "Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at temperature 1.0 "
    "and max_tokens=512."
)
FILE = "my_spec.json.resolution.json"


def _plan(tmp_path: Path, method_edits=(), resolution_edit=None, resolution: object = RESOLUTION) -> Path:
    """The saved spec (its method edited) and its resolution file (edited), as my_spec.json."""
    raw = json.loads(SAVED.read_text())
    for old, new in method_edits:
        assert old in raw["method"], old
        raw["method"] = raw["method"].replace(old, new, 1)
    path = tmp_path / "my_spec.json"
    path.write_text(json.dumps(raw, indent=1))
    if resolution is not None:
        res = json.loads(json.dumps(resolution)) if not isinstance(resolution, str) else resolution
        if resolution_edit:
            resolution_edit(res)
        (tmp_path / FILE).write_text(res if isinstance(res, str) else json.dumps(res))
    return path


def _refusal(path: Path) -> str:
    with pytest.raises(PlanError) as e:
        load_plan(path)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line, line
    return line


def test_the_saved_spec_values_come_from_its_resolution_file_with_the_sentences_they_quote():
    plan = load_plan(SAVED)
    run = plan_config(plan)["config"]["run"]
    assert (run["groups_per_batch"], run["group_size"], run["temperature"], run["max_tokens"]) == (32, 8, 1.0, 512)
    assert run["stated_in_prose"]["temperature"] == {
        "value": 1.0,
        "field": "exp_e6b0965af3.json.resolution.json",
        "source": TRAINING,
    }
    assert not any(v.get("default") for v in run["stated_in_prose"].values())
    assert run["baseline_source"] == "baseline_arm in exp_e6b0965af3.json.resolution.json"
    block = plan_config(plan)["plan"]["resolution"]
    assert block["file"] == "exp_e6b0965af3.json.resolution.json" and len(block["sha256"]) == 64
    assert block["settles"] == [
        "groups_per_batch",
        "group_size",
        "temperature",
        "max_tokens",
        "minibatches_per_batch",
        "gate_pilot_steps",
    ]


def test_a_number_changed_in_the_spec_is_refused(tmp_path):
    path = _plan(tmp_path, [("groups_per_batch=32", "groups_per_batch=16")])
    assert _refusal(path) == (
        f"{tmp_path / 'my_spec.json'}: {FILE}: values.groups_per_batch: the sentence {TRAINING!r} is not "
        "verbatim in the spec's method"
    )


def test_a_number_changed_in_the_resolution_file_is_refused(tmp_path):
    path = _plan(tmp_path, resolution_edit=lambda r: r["values"]["max_tokens"].update(value=1024))
    assert _refusal(path).endswith(
        f"{FILE}: values.max_tokens: the sentence {TRAINING!r} does not contain the number 1024"
    )
    path = _plan(tmp_path, resolution_edit=lambda r: r["values"]["temperature"].update(value=0.7))
    assert "values.temperature: the sentence" in _refusal(path) and "does not contain the number 0.7" in _refusal(path)


def test_a_sentence_absent_from_the_spec_is_refused(tmp_path):
    absent = "Sampling uses temperature 1.0."
    path = _plan(tmp_path, resolution_edit=lambda r: r["values"]["temperature"].update(sentence=absent))
    assert _refusal(path).endswith(
        f"{FILE}: values.temperature: the sentence {absent!r} is not verbatim in the spec's method"
    )
    # the gate's pilot length quotes the gate's reason, not the method
    path = _plan(tmp_path, resolution_edit=lambda r: r["values"]["gate_pilot_steps"].update(sentence=TRAINING))
    assert "values.gate_pilot_steps: the sentence" in _refusal(path)
    assert "is not verbatim in the spec's activation_gate.reason" in _refusal(path)


def test_the_number_is_a_whole_token_of_the_sentence(tmp_path):
    # "8" is in "Qwen3.5-0.8B" and "3.5", but no number of the sentence is 8
    sentence = "The requested Qwen3.5-0.8B is not served, so we use the closest served small model, Qwen/Qwen3.5-2B."
    path = _plan(tmp_path, resolution_edit=lambda r: r["values"]["group_size"].update(sentence=sentence))
    assert "values.group_size: the sentence" in _refusal(path) and "does not contain the number 8" in _refusal(path)


def test_a_missing_file_value_or_baseline_is_refused(tmp_path):
    line = _refusal(_plan(tmp_path, resolution=None))
    assert line.endswith(
        f"{FILE}: no such file beside the plan; the spec format has no field for groups_per_batch, group_size, "
        "temperature, max_tokens or the baseline arm, so this file states them, each value with the spec sentence "
        "it quotes"
    ), line
    assert f"{FILE}: values.group_size (rollouts per prompt): the spec format has no field for it" in _refusal(
        _plan(tmp_path, resolution_edit=lambda r: r["values"].pop("group_size"))
    )
    assert f"{FILE}: baseline_arm (the arm the decision compares against)" in _refusal(
        _plan(tmp_path, resolution_edit=lambda r: r.pop("baseline_arm"))
    )
    assert _refusal(_plan(tmp_path, resolution_edit=lambda r: r.update(baseline_arm="GRPO"))).endswith(
        f"{FILE}: baseline_arm: 'GRPO' is not an arm of the spec (arms: ['grpo_seed0', 'dppo_seed0'])"
    )
    # in-memory bytes have no file beside them
    with pytest.raises(PlanError, match=r"^<plan file>.resolution.json: no such file beside the plan"):
        parse_plan(SAVED.read_bytes())


def test_the_baseline_arm_comes_from_the_resolution_file(tmp_path):
    path = _plan(tmp_path, resolution_edit=lambda r: r.update(baseline_arm="dppo_seed0"))
    run = load_plan(path).run
    assert [(a.name, a.role) for a in run.arms] == [("dppo_seed0", "baseline"), ("grpo_seed0", "treatment")]
    assert [(c.treatment, c.baseline) for c in run.criteria] == [("grpo_seed0", "dppo_seed0")]


def test_optional_values_default_and_are_declared(tmp_path):
    def drop(r):
        del r["values"]["minibatches_per_batch"], r["values"]["gate_pilot_steps"]

    stated = plan_config(load_plan(_plan(tmp_path, resolution_edit=drop)))["config"]["run"]["stated_in_prose"]
    assert stated["minibatches_per_batch"]["default"] is True and stated["minibatches_per_batch"]["value"] == 2
    assert stated["gate_pilot_steps"] == {
        "value": 5,
        "field": "harness default",
        "source": "the resolution file states no gate_pilot_steps",
        "default": True,
    }


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", f"{FILE}: <root>: invalid JSON at line 1"),
        (
            json.dumps({**RESOLUTION, "values": {"temperature": {"value": "1.0", "sentence": TRAINING}}}),
            "values.temperature.value: expected number, got str",
        ),
        (
            json.dumps({**RESOLUTION, "values": {"temp": {"value": 1.0, "sentence": TRAINING}}}),
            "values: 'temp' is no value the harness reads",
        ),
        (
            json.dumps({**RESOLUTION, "values": {"temperature": {"value": 1.0}}}),
            "values.temperature.sentence: missing required key",
        ),
        (
            json.dumps(
                {**RESOLUTION, "values": {**RESOLUTION["values"], "max_tokens": {"value": 511.5, "sentence": TRAINING}}}
            ),
            "values.max_tokens: value 511.5 is not a whole number",
        ),
        (json.dumps({**RESOLUTION, "launch": {"source": "x"}}), "launch.launch_mode: missing required key"),
        (json.dumps({**RESOLUTION, "interpretations": []}), "interpretations: unknown key"),
    ],
    ids=["invalid JSON", "value a string", "unknown key", "no sentence", "count not whole", "launch", "old format"],
)
def test_a_malformed_resolution_is_refused_in_one_line(tmp_path, text, says):
    path = _plan(tmp_path, resolution=text)
    proc = subprocess.run(
        [sys.executable, "-m", "dppo_harness.plans", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_the_saved_spec_states_its_launch_in_its_resolution():
    plan = load_plan(SAVED)
    assert plan.launch is not None and plan.launch.authorized_stages == [] and plan.launch.launch_mode == "redo"
    assert "Only this single diagnostic is authorized in this launch" in plan.launch.source
    assert plan.launch_stated_in == "exp_e6b0965af3.json.resolution.json"
    assert plan_config(plan)["plan"]["launch"] == RESOLUTION["launch"]
    line = launch_refusal(
        plan.name,
        plan.launch,
        ("gate", "comparison"),
        embedded=False,
        service="https://svc",
        stated_in=plan.launch_stated_in,
    )
    assert (
        line is not None
        and "launch (stated in exp_e6b0965af3.json.resolution.json) authorizes no training stage" in line
    ), line


def test_a_launch_stated_twice_is_refused(tmp_path):
    raw = json.loads(SAVED.read_text())
    raw["launch"] = RESOLUTION["launch"]
    (tmp_path / "s.json").write_text(json.dumps(raw))
    (tmp_path / "s.json.resolution.json").write_text(json.dumps(RESOLUTION))
    with pytest.raises(PlanError, match="s.json.resolution.json: launch: the plan states its own launch block"):
        load_plan(tmp_path / "s.json")


def test_a_diagnostic_plan_takes_no_values_from_a_resolution_file(tmp_path):
    diag = ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json"
    for name in (diag.name, SAVED.name, SAVED.name + ".resolution.json"):
        (tmp_path / name).write_bytes((diag.parent / name).read_bytes())
    (tmp_path / (diag.name + ".resolution.json")).write_text(json.dumps({"values": RESOLUTION["values"]}))
    with pytest.raises(PlanError, match="values: a bounded_diagnostic plan states its schedule and arm in its own"):
        load_plan(tmp_path / diag.name)


def test_the_resolution_file_read_is_registered_in_the_evidence_by_its_bytes(tmp_path):
    spec = load_plan(SAVED)
    assert spec.resolution is not None
    bundle = EvidenceBundle.create(tmp_path, "run", env={})
    session.record_plan(
        bundle, spec, Backend(kind="tinker", requested_model=spec.base_model, served_model=spec.base_model)
    )
    entry = bundle.entry(spec.resolution.file)
    on_disk = (SAVED.parent / spec.resolution.file).read_bytes()
    assert entry["kind"] == "plan" and entry["sha256"] == sha256_bytes(on_disk) == spec.resolution.sha256
    assert verify_bundle(bundle.dir) == []
