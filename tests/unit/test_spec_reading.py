"""A spec runs as written or is refused in one line: the variant corpus (tests/fixtures/specs),
a mutation test over every prose number of the saved spec, and the rehearsal rewrite."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from dppo_harness.plans import PlanError, load_plan, parse_plan
from dppo_harness.plans.prose import KEYS, read_number
from dppo_harness.plans.rehearsal import RehearsalSize, make_rehearsal

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "plans" / "exp_e6b0965af3.json"
SPEC = load_plan(SAVED)
CORPUS = json.loads((ROOT / "tests" / "fixtures" / "specs" / "variants.json").read_text())["cases"]
_REGEX_TRACES = ("\\b", "\\s", "(?", "\\d")


def _at(obj, path: str):
    parts = path.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    return obj, (int(parts[-1]) if isinstance(obj, list) else parts[-1])


def _variant(case: dict) -> dict:
    raw = copy.deepcopy(SPEC.raw)
    for path, edits in case.get("replace", {}).items():
        obj, key = _at(raw, path)
        for old, new in edits:
            assert old in obj[key], (case["id"], old)
            obj[key] = obj[key].replace(old, new, 1)
    for path, value in case.get("set", {}).items():
        obj, key = _at(raw, path)
        obj[key] = value
    if "move_paragraph_first" in case:
        paras = raw["method"].split("\n\n")
        first = [p for p in paras if p.startswith(case["move_paragraph_first"])]
        assert len(first) == 1
        raw["method"] = "\n\n".join(first + [p for p in paras if p not in first])
    return raw


def _load(raw: dict):
    return parse_plan(json.dumps(raw, ensure_ascii=False).encode())


def _effective(plan) -> dict:
    out = plan.run.as_json()
    out.pop("stated_in_prose")  # the sentences differ by construction; the values are compared
    return out


def _assert_refused_in_one_line(exc: PlanError) -> str:
    line = str(exc)
    assert "\n" not in line and "Traceback" not in line, line
    assert not any(t in line for t in _REGEX_TRACES), f"a refusal shows a regular expression: {line}"
    return line


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_every_variant_is_refused_in_one_line_or_loads_with_what_it_states(case):
    raw = _variant(case)
    if "refused" in case:
        with pytest.raises(PlanError) as e:
            _load(raw)
        line = _assert_refused_in_one_line(e.value)
        assert line.startswith(case["refused"]), line
        return
    got = _effective(_load(raw))
    want = _effective(SPEC)
    want.update(case["loads"])
    if "max_seq_len" in case.get("set", {}):
        want["max_seq_len"] = case["set"]["max_seq_len"]
    assert got == want


def test_the_corpus_covers_both_outcomes_and_every_reader_rule():
    refused = [c for c in CORPUS if "refused" in c]
    loads = [c for c in CORPUS if "loads" in c]
    assert len(refused) >= 20 and len(loads) >= 10
    for rule in (
        "method: states",
        "method: cannot read",
        "method: does not state",
        "baseline: names several",
        "decision_rule.seeds:",
        "decision_rule.alpha:",
        "decision_rule.criteria[0].bounds:",
        "decision_rule.estimand:",
        "arms: updates_per_batch",
        "activation_gate.checks[3]:",
        "activation_gate.reason: states",
        "hypothesis: states",
        "baseline: states",
        "decision_rule.criteria[1].weights:",
        "decision_rule.criteria: criterion ids",
    ):
        assert any(c["refused"].startswith(rule) for c in refused), rule
    # three arms and two criteria, each way
    for outcome in (loads, refused):
        assert any(len(c.get("set", {}).get("arms", [])) == 3 for c in outcome)
        assert any(len(c.get("set", {}).get("decision_rule.criteria", [])) == 2 for c in outcome)


# (key, the text of its statement in the saved spec, the number in it)
SAVED_NUMBERS = [
    ("groups_per_batch", "groups_per_batch=32", "32"),
    ("group_size", "group_size=8", "8"),
    ("temperature", "temperature 1.0", "1.0"),
    ("max_tokens", "max_tokens=512", "512"),
    ("minibatches", "split into 2 minibatches", "2"),
    ("updates_per_batch", "2 optim_steps per batch", "2"),
    ("rollout_steps", "50 rollout steps", "50"),
    ("optim_steps", "(100 optim steps)", "100"),
    ("lora_rank", "LoRA rank 32", "32"),
    ("lr", "lr 2e-5", "2e-5"),
    ("seed", "seed 0", "0"),
    ("eval_items", "all 1319 GSM8K", "1319"),
]
_WORDS = {0: "zero", 2: "two", 8: "eight", 32: "thirty-two", 50: "fifty"}


def _same_value_forms(number: str) -> list[str]:
    value = float(number)
    mantissa, exponent = f"{value:.2e}".split("e")
    forms = [f"{value:.3e}", f"{float(mantissa):g} x 10^{int(exponent)}"]
    if value.is_integer():
        n = int(value)
        forms += [f"{n}.0"] + ([f"{n:,}"] if n >= 1000 else []) + ([_WORDS[n]] if n in _WORDS else [])
    return forms


def _garbage_forms(number: str) -> list[str]:
    return [f"{number}k", f"{number}/2", f"{number},5", f"{number}.5.1", f"{number}x", f"{number}^2", f"{number} to 9"]


@pytest.mark.parametrize("key, statement, number", SAVED_NUMBERS, ids=[k for k, _, _ in SAVED_NUMBERS])
def test_mutations_of_every_prose_number_are_read_right_or_refused(key, statement, number):
    assert statement in SPEC.raw["method"], statement
    want = _effective(SPEC)
    checked = 0
    for form, same in [(f, True) for f in _same_value_forms(number)] + [(f, False) for f in _garbage_forms(number)]:
        raw = copy.deepcopy(SPEC.raw)
        raw["method"] = raw["method"].replace(statement, statement.replace(number, form, 1), 1)
        try:
            got = _effective(_load(raw))
        except PlanError as exc:
            _assert_refused_in_one_line(exc)
            assert not same or KEYS[key].is_int, (key, form, str(exc))  # a whole number in float form may be refused
            continue
        assert same, f"{key}: {form!r} loaded; it must be refused"
        assert got == want, f"{key}: {form!r} loaded with other values"
        checked += 1
    assert checked >= 2  # at least two other spellings of each number are read, not refused


@pytest.mark.parametrize(
    "raw, is_int, value",
    [
        ("1,024", True, 1024),
        ("2e-5", False, 2e-5),
        ("2 x 10^-5", False, 2e-5),
        ("2\u00d710^-5", False, 2e-5),
        ("ten", True, 10),
        ("Twenty-five", True, 25),
        ("512.0", True, 512),
        ("1.0", False, 1.0),
    ],
)
def test_numbers_are_read_whole(raw, is_int, value):
    assert read_number(raw, is_int) == value


def test_a_fraction_where_a_count_is_needed_is_refused():
    raw = copy.deepcopy(SPEC.raw)
    raw["method"] = raw["method"].replace("group_size=8", "group_size=8.5")
    with pytest.raises(PlanError, match=r"^method: cannot read the group_size in .*'8\.5' is not a whole number"):
        _load(raw)


def test_rehearse_rewrites_every_statement_of_a_value(tmp_path):
    raw = copy.deepcopy(SPEC.raw)
    raw["method"] = raw["method"].replace(
        "Advantages are", "Every batch holds groups_per_batch=32 prompts. Advantages are"
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(raw, indent=1))
    data = make_rehearsal(spec, tmp_path / "plan.json", RehearsalSize(steps=2, groups=4, eval_items=8))
    method = json.loads(data)["spec"]["method"]
    assert re.findall(r"groups_per_batch=(\d+)", method) == ["4", "4"]
    (tmp_path / "plan.json").write_bytes(data)
    assert load_plan(tmp_path / "plan.json").run.groups_per_batch.value == 4


def test_rehearse_leaves_no_file_when_its_output_does_not_validate(tmp_path, monkeypatch):
    from dppo_harness.plans import __main__ as cli

    monkeypatch.setattr(cli, "plan_errors", lambda path: [f"{path}: planted refusal"])
    out = tmp_path / "plan.json"
    assert cli.main(["rehearse", str(SAVED), "--out", str(out)]) == 1
    assert list(tmp_path.iterdir()) == []
