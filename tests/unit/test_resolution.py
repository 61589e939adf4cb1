"""The resolution file beside a spec settles what its prose leaves open, without editing it: the
refusal says what to write, a settled value is declared, and a resolution that does not fit the
spec (a sentence not in it, a contradiction of what it states, a malformed file) is refused in one
line. The saved spec's resolution states its launch and changes nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.evidence.budget import plan_needs
from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.plans import PlanError, launch_refusal, load_plan, parse_plan, plan_config

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "plans" / "exp_e6b0965af3.json"
RAW = json.loads(SAVED.read_text())
TRAINING = (
    "Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at temperature 1.0 "
    "and max_tokens=512."
)


def _spec(tmp_path: Path, method_edits: list[tuple[str, str]], resolution: object | None = None) -> Path:
    raw = json.loads(json.dumps(RAW))
    for old, new in method_edits:
        assert old in raw["method"], old
        raw["method"] = raw["method"].replace(old, new, 1)
    path = tmp_path / "my_spec.json"
    path.write_text(json.dumps(raw, indent=1))
    if resolution is not None:
        text = resolution if isinstance(resolution, str) else json.dumps(resolution)
        (tmp_path / "my_spec.json.resolution.json").write_text(text)
    return path


def _entry(key: str, value: object, sentence: str, why: str = "the author's reading") -> dict:
    return {"interpretations": [{"key": key, "value": value, "sentence": sentence, "why": why}]}


NO_TEMPERATURE = [
    ("rollouts at temperature 1.0 and", "rollouts and"),
    ("scored with greedy decoding on", "scored with greedy decoding (temperature 0) on"),
]
TWO_TEMPERATURES = [("max_tokens=512. Advantages", "max_tokens=512. The sampling temperature is 0.7. Advantages")]


def _refusal(path: Path) -> str:
    with pytest.raises(PlanError) as e:
        load_plan(path)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line, line
    return line


def test_a_refusal_says_exactly_what_to_write_and_that_entry_settles_it(tmp_path):
    path = _spec(tmp_path, NO_TEMPERATURE)
    line = _refusal(path)
    assert "states temperature (sampling temperature) only in a sentence about evaluation" in line, line
    m = re.search(r"settle it beside the spec in (\S+): (\{.*\})$", line)
    assert m and m.group(1) == "my_spec.json.resolution.json", line
    entry = json.loads(m.group(2))["interpretations"][0]
    assert entry["key"] == "temperature" and entry["sentence"].startswith("Evaluation: the final checkpoint"), entry
    # the user writes what the line asks for, with the value meant and a training sentence it settles
    training = TRAINING.replace("rollouts at temperature 1.0 and", "rollouts and")
    (tmp_path / m.group(1)).write_text(json.dumps(_entry("temperature", 1.0, training, "the sampler's 1.0")))
    plan = load_plan(path)
    assert plan.run.temperature.value == 1.0
    run = plan_config(plan)["config"]["run"]
    assert run["temperature"] == 1.0
    assert run["stated_in_prose"]["temperature"] == {
        "value": 1.0,
        "field": "my_spec.json.resolution.json",
        "source": training,
        "why": "the sampler's 1.0",
    }
    assert run["declared_interpretations"] == [
        {
            "key": "temperature",
            "value": 1.0,
            "sentence": training,
            "why": "the sampler's 1.0",
            "file": "my_spec.json.resolution.json",
        }
    ]
    block = plan_config(plan)["plan"]["resolution"]
    assert block["file"] == "my_spec.json.resolution.json" and block["settles"] == ["temperature"]
    assert len(block["sha256"]) == 64


def test_two_values_settle_only_to_one_of_them_quoting_one_of_their_sentences(tmp_path):
    line = _refusal(_spec(tmp_path, TWO_TEMPERATURES))
    assert "states temperature twice with different values" in line and "my_spec.json.resolution.json" in line, line
    second = "The sampling temperature is 0.7."
    path = _spec(tmp_path, TWO_TEMPERATURES, _entry("temperature", 0.5, second))
    assert "value 0.5 contradicts the spec, which states temperature as 1.0 or 0.7" in _refusal(path)
    other = "Advantages are group-mean-centered (GRPO)."
    path = _spec(tmp_path, TWO_TEMPERATURES, _entry("temperature", 0.7, other))
    assert "is not one of the sentences that contradict each other" in _refusal(path)
    path = _spec(tmp_path, TWO_TEMPERATURES, _entry("temperature", 0.7, second))
    assert load_plan(path).run.temperature.value == 0.7


def test_a_resolution_must_quote_a_sentence_of_the_spec(tmp_path):
    path = _spec(tmp_path, NO_TEMPERATURE, _entry("temperature", 1.0, "Sampling uses temperature 1.0."))
    line = _refusal(path)
    assert (
        "my_spec.json.resolution.json: interpretations[temperature]: the sentence 'Sampling uses temperature "
        "1.0.' is not in the spec's method" in line
    ), line


def test_a_resolution_cannot_change_what_the_spec_states_unambiguously(tmp_path):
    for value in (0.7, 1.0):  # another value, or the same: either way there was nothing to settle
        path = _spec(tmp_path, [], _entry("temperature", value, TRAINING))
        line = _refusal(path)
        assert (
            f"interpretations[temperature]: settles temperature as {value}, but the spec's method states it "
            "unambiguously as 1.0"
        ) in line, line


def test_a_key_left_to_a_default_can_be_settled_and_a_default_is_declared(tmp_path):
    split = "The rollout batch is split into 2 minibatches. "
    path = _spec(tmp_path, [(split, "")])
    stated = plan_config(load_plan(path))["config"]["run"]["stated_in_prose"]["minibatches_per_batch"]
    assert stated["default"] is True and stated["value"] == 2, stated
    sentence = (
        "That gives 2 optim_steps per batch, so the policy drifts from the sampling policy and the trust "
        "region can act."
    )
    path = _spec(tmp_path, [(split, "")], _entry("minibatches", 2, sentence, "two optim steps, one per minibatch"))
    stated = plan_config(load_plan(path))["config"]["run"]["stated_in_prose"]["minibatches_per_batch"]
    assert "default" not in stated and stated["field"] == "my_spec.json.resolution.json", stated
    # the saved spec states it, so nothing is declared a default
    saved = plan_config(load_plan(SAVED))["config"]["run"]["stated_in_prose"]
    assert not any(v.get("default") for v in saved.values()), saved


def test_the_pilot_length_in_the_gate_reason_can_be_settled(tmp_path):
    raw = json.loads(json.dumps(RAW))
    raw["activation_gate"]["reason"] = raw["activation_gate"]["reason"].replace("A 5-step pilot", "A five-ish pilot")
    (tmp_path / "p.json").write_text(json.dumps(raw))
    sentence = next(s for s in raw["activation_gate"]["reason"].split(". ") if "pilot" in s) + "."
    (tmp_path / "p.json.resolution.json").write_text(json.dumps(_entry("pilot_steps", 5, sentence)))
    plan = load_plan(tmp_path / "p.json")
    assert plan.run.gate_pilot_steps.value == 5 and plan.run.gate_pilot_steps.why == "the author's reading"


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "my_spec.json.resolution.json: <root>: invalid JSON at line 1"),
        (
            json.dumps({"interpretations": [{"key": "temperature", "value": "1.0", "sentence": "x", "why": "y"}]}),
            "interpretations[0].value: expected number, got str",
        ),
        (
            json.dumps({"interpretations": [{"key": "temp", "value": 1.0, "sentence": "x", "why": "y"}]}),
            "key 'temp' is no value the prose reader reads",
        ),
        (json.dumps({"interpretations": []}), "settles nothing: it needs interpretations or a launch block"),
        (
            json.dumps({"interpretations": [{"key": "temperature", "value": 1.0, "sentence": "x"}]}),
            "interpretations[0].why: missing required key",
        ),
        (
            json.dumps({**_entry("max_tokens", 511.5, TRAINING.replace("=512", "=0.5k"))}),
            "value 511.5 is not a whole number",
        ),
        (json.dumps({"launch": {"source": "x"}}), "launch.launch_mode: missing required key"),
    ],
    ids=["invalid JSON", "value a string", "unknown key", "empty", "no why", "count not whole", "launch incomplete"],
)
def test_a_malformed_resolution_is_refused_in_one_line(tmp_path, text, says):
    path = _spec(
        tmp_path, NO_TEMPERATURE if "max_tokens" not in text else [("max_tokens=512", "max_tokens=0.5k")], text
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dppo_harness.plans", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_the_saved_spec_states_its_launch_in_its_resolution_and_loads_as_before():
    plan = load_plan(SAVED)
    assert plan.launch is not None and plan.launch.authorized_stages == [] and plan.launch.launch_mode == "redo"
    assert "Only this single diagnostic is authorized in this launch" in plan.launch.source
    assert plan.launch_stated_in == "exp_e6b0965af3.json.resolution.json"
    bare = parse_plan(SAVED.read_bytes(), None)  # the same bytes without the file beside them
    with_file, without = plan_config(plan), plan_config(bare)
    assert (
        with_file["plan"].pop("launch")
        == json.loads((ROOT / "plans" / "exp_e6b0965af3.json.resolution.json").read_text())["launch"]
    )
    assert with_file["plan"].pop("resolution")["settles"] == []
    without["plan"]["name"] = with_file["plan"]["name"]
    assert with_file == without  # only the launch and the resolution's record are added
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
    raw = json.loads(json.dumps(RAW))
    launch = json.loads((ROOT / "plans" / "exp_e6b0965af3.json.resolution.json").read_text())["launch"]
    raw["launch"] = launch
    (tmp_path / "s.json").write_text(json.dumps(raw))
    (tmp_path / "s.json.resolution.json").write_text(json.dumps({"launch": launch}))
    with pytest.raises(PlanError, match="s.json.resolution.json: launch: the plan states its own launch block"):
        load_plan(tmp_path / "s.json")


def test_rehearse_refuses_a_spec_whose_resolution_settles_values(tmp_path):
    from dppo_harness.plans import RehearsalSize, make_rehearsal

    training = TRAINING.replace("rollouts at temperature 1.0 and", "rollouts and")
    path = _spec(tmp_path, NO_TEMPERATURE, _entry("temperature", 1.0, training))
    with pytest.raises(
        PlanError, match="my_spec.json.resolution.json settles temperature, which a rehearsal plan cannot carry yet"
    ):
        make_rehearsal(path, tmp_path / "r.json", RehearsalSize())


def test_the_resolution_file_read_is_registered_in_the_evidence_by_its_bytes_and_counted_in_the_budget(tmp_path):
    spec = load_plan(SAVED)
    assert spec.resolution is not None
    bundle = EvidenceBundle.create(tmp_path, "run", env={})
    entry = bundle.register_resolution(spec)
    on_disk = (SAVED.parent / spec.resolution.file).read_bytes()
    assert entry["name"] == spec.resolution.file and entry["sha256"] == sha256_bytes(on_disk) == spec.resolution.sha256
    assert verify_bundle(bundle.dir) == []
    diagnostic = load_plan(ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json")
    assert diagnostic.resolution is None and bundle.register_resolution(diagnostic) is None
    stages = ["preflight", "gate", "comparison"]
    assert plan_needs(spec, stages).stages[0].files == plan_needs(diagnostic, []).stages[0].files + 1
