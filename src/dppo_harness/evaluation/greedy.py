"""Greedy GSM8K test evaluation with a frozen evaluator, predictions and scored observations.

The evaluator is frozen before any arm is scored: its provenance (code sha256 of the grader and
evaluation code plus dependency versions, prompt template, decoding, parser, item ids) is hashed
into ``evaluator_id`` (sha256 of its canonical JSON), and every ``evaluate`` call recomputes that
provenance from the code on disk and refuses to score if anything changed.

Greedy decoding is ``tinker.SamplingParams(temperature=0.0, ...)``: the SDK has no separate greedy
flag; temperature 0 is the convention the cookbook's evals use (e.g. ``recipes/sdft/eval.py``) and
the embedded server maps it to argmax. Grading is the cookbook's ``MathEnv`` check (last
``\\boxed{}`` through ``grade_answer``); an output without a parseable answer stays a row scoring 0.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import tinker
from tinker_cookbook.recipes.math_rl import math_env, math_grading
from tinker_cookbook.renderers import base as renderer_base
from tinker_cookbook.renderers import qwen3, qwen3_5
from tinker_cookbook.rl import problem_env

from dppo_harness.data import dataset, gsm8k
from dppo_harness.data import tokenizer as tokenizer_mod
from dppo_harness.data.gsm8k import Gsm8kItem
from dppo_harness.data.tokenizer import TokenizerBundle, stop_list
from dppo_harness.evaluation import answer_yield
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.rollout.frozen_batch import canonical_json

METRIC = "accuracy"
DEFAULT_MAX_TOKENS = 512
DEPENDENCIES = ("tinker", "tinker-cookbook", "tml-renderers", "sympy", "pylatexenc", "math-verify", "numpy", "datasets")
PARSER_DESCRIPTION = (
    "renderer.parse_response(tokens) -> assistant text content; "
    "tinker_cookbook.recipes.math_rl.math_grading.extract_boxed (last \\boxed{...}); "
    "math_env.safe_grade(answer, reference, grader='sympy', timeout=1.0) -> math_grading.grade_answer; "
    "reference = math_env.extract_gsm8k_final_answer(solution) (text after the last '####', commas removed); "
    "value = 1 if graded correct else 0 (no boxed answer, unparseable or wrong -> 0)"
)


class EvaluatorChangedError(RuntimeError):
    """The code, prompt, decoding, parser or items differ from the frozen evaluator."""


class PredictionRow(TypedDict):
    """One scored item of one arm: a line of the arm's predictions file."""

    item_id: str
    arm: str
    seed: int
    checkpoint: str
    metric: str
    prediction: str | None  # the last \boxed{} answer, None when there is none
    response: str
    reference: str
    value: int  # 1 correct, 0 otherwise
    format_ok: bool
    stop_reason: str
    n_tokens: int
    evaluator_id: str


def evaluator_id(provenance: JsonObject) -> str:
    """``sha256(json.dumps(provenance, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    allow_nan=False))``: the identity of everything that decides a score."""
    return hashlib.sha256(canonical_json(provenance).encode()).hexdigest()


def dataset_of(items: Sequence[object]) -> str:
    """The registered dataset the evaluation items belong to (the dataset seam serves them:
    `dataset.get(name)`), from the module that defines their type; ValueError if not exactly one."""
    modules = {type(it).__module__ for it in items}
    names = [e.name for e in dataset.DATASETS.values() if e.module in modules]
    if len(modules) != 1 or len(names) != 1:
        raise ValueError(
            f"evaluation items of {sorted(modules)}: no registered dataset serves exactly these "
            f"(registered: {', '.join(dataset.names())})"
        )
    return names[0]


def code_files(dataset_name: str) -> dict[str, Path]:
    """The executed grader/evaluation code whose bytes the evaluator identity covers, the dataset
    module the seam serves `dataset_name` from included."""
    data_file = str(dataset.get(dataset_name).__file__)
    mods = {
        "dppo_harness/evaluation/greedy.py": __file__,
        f"dppo_harness/data/{Path(data_file).name}": data_file,
        "dppo_harness/data/tokenizer.py": tokenizer_mod.__file__,
        "tinker_cookbook/recipes/math_rl/math_env.py": math_env.__file__,
        "tinker_cookbook/recipes/math_rl/math_grading.py": math_grading.__file__,
        "tinker_cookbook/rl/problem_env.py": problem_env.__file__,
        "tinker_cookbook/renderers/base.py": renderer_base.__file__,
        "tinker_cookbook/renderers/qwen3.py": qwen3.__file__,
        "tinker_cookbook/renderers/qwen3_5.py": qwen3_5.__file__,
    }
    return {k: Path(v) for k, v in mods.items()}


def code_manifest(dataset_name: str) -> JsonObject:
    files: JsonObject = {
        name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in sorted(code_files(dataset_name).items())
    }
    versions: JsonObject = {name: tokenizer_mod.package_version(name) for name in DEPENDENCIES}
    return {"files": files, "versions": versions, "python": platform.python_version()}


def prompt_template(bundle: TokenizerBundle, item_type: type, dataset_name: str) -> str:
    """The exact rendered prompt with ``{question}`` in place of the item text, plus settings."""
    probe = item_type("template", "test", -1, "{question}", "", "")
    ob, _ = dataset.get(dataset_name).build_prompt(probe, bundle.renderer)
    rendered = bundle.tokenizer.decode(ob.to_ints())
    tok = bundle.provenance["tokenizer"]
    assert isinstance(tok, Mapping), "make_renderer records the tokenizer's provenance as an object"
    return (
        f"{rendered}\n"
        f"--\nmessages: MathEnv.standard_fewshot_prefix() + [user: question + MathEnv.question_suffix()]; "
        f"renderer={bundle.renderer_name} ({bundle.provenance['renderer_class']}); "
        f"tokenizer={tok['choice']} ({tok['class']} {tok.get('package_version')}, probe fingerprint "
        f"{tok['vocab_fingerprint']}); build_generation_prompt"
    )


def build_provenance(items: Sequence[Gsm8kItem], bundle: TokenizerBundle, max_tokens: int) -> JsonObject:
    name = dataset_of(items)
    manifest = code_manifest(name)
    return {
        "code_sha256": hashlib.sha256(canonical_json(manifest).encode()).hexdigest(),
        "prompt_template": prompt_template(bundle, type(items[0]), name),
        "decoding": {
            "temperature": 0.0,
            "max_tokens": int(max_tokens),
            "stop": list(stop_list(bundle.renderer.get_stop_sequences())),  # as sent in SamplingParams
            "top_k": -1,
            "top_p": 1.0,
            "num_samples": 1,
        },
        "parser": PARSER_DESCRIPTION,
        "items": {"ids": [it.item_id for it in items]},
    }


@dataclass(frozen=True)
class FrozenEvaluator:
    evaluator_id: str
    provenance: JsonObject
    code_manifest: JsonObject
    items: tuple[Gsm8kItem, ...]
    bundle: TokenizerBundle
    max_tokens: int
    deviation: dict[str, str] | None = None  # set when the items are not all 1319 test items

    def check_unchanged(self) -> None:
        """Recompute provenance from disk; raise if anything differs from the frozen record."""
        now = build_provenance(self.items, self.bundle, self.max_tokens)
        if evaluator_id(now) != self.evaluator_id:
            changed = sorted(k for k in now if now[k] != self.provenance.get(k))
            raise EvaluatorChangedError(
                f"evaluator {self.evaluator_id[:12]} changed after freezing ({', '.join(changed)}); "
                "re-freeze and re-evaluate every compared arm and the base model"
            )


def select_items(
    test: gsm8k.Gsm8kSplit, n_items: int | None = None, reason: str | None = None
) -> tuple[tuple[Gsm8kItem, ...], dict[str, str] | None]:
    """All test items by default. A subset (the first ``n_items`` in order) needs a reason and
    comes back with the deviation record to register before scoring."""
    if n_items is None or n_items == len(test):
        return test.items, None
    if not 0 < n_items < len(test):
        raise ValueError(f"n_items must be in [1, {len(test)}], got {n_items}")
    if not reason:
        raise ValueError("evaluating fewer than all test items is a deviation: give a reason")
    deviation = {
        "field": "evaluator",
        "original": f"greedy exact match on all {len(test)} GSM8K test items",
        "effective": f"first {n_items} GSM8K test items ({test.items[0].item_id}..{test.items[n_items - 1].item_id})",
        "reason": reason,
    }
    return test.items[:n_items], deviation


def freeze_evaluator(
    items: Sequence[Gsm8kItem],
    bundle: TokenizerBundle,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    deviation: dict[str, str] | None = None,
) -> FrozenEvaluator:
    """Freeze before scoring. Anything but the full 1319-item test set needs the deviation
    record from ``select_items`` (the caller registers it with the evidence bundle)."""
    if not items:
        raise ValueError("an evaluator needs at least one item")
    ids = [it.item_id for it in items]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate item ids in the evaluation set")
    if any(it.split != "test" for it in items):
        raise ValueError("evaluation items must come from the GSM8K test split")
    name = dataset_of(items)
    n_test = dataset.entry(name).split_sizes["test"]
    full = ids == [dataset.get(name).item_id("test", i) for i in range(n_test)]
    if not full and not (deviation and deviation.get("reason")):
        raise ValueError(f"{len(ids)} items instead of all {n_test} test items: pass the recorded deviation")
    prov = build_provenance(items, bundle, max_tokens)
    return FrozenEvaluator(
        evaluator_id(prov),
        prov,
        code_manifest(name),
        tuple(items),
        bundle,
        max_tokens,
        None if full else dict(deviation or {}),
    )


@dataclass(frozen=True)
class EvalResult:
    arm: str
    seed: int
    checkpoint: str
    evaluator_id: str
    rows: tuple[PredictionRow, ...]

    @property
    def accuracy(self) -> float:
        """Unrounded mean of the per-item values (failures count as 0)."""
        return sum(r["value"] for r in self.rows) / len(self.rows)

    @property
    def invalid_outputs(self) -> int:
        """Outputs with no parseable answer (no \\boxed{}): rows that stay, scoring 0."""
        return sum(r["prediction"] is None for r in self.rows)

    def response_yield(self, max_tokens: int | None = None) -> answer_yield.ResponseYield:
        return answer_yield.response_yield(
            [r["stop_reason"] for r in self.rows],
            [r["prediction"] is not None for r in self.rows],
            [r["n_tokens"] for r in self.rows],
            max_tokens=max_tokens,
        )

    def arm_metrics(self, max_tokens: int | None = None) -> dict[str, float]:
        """What `metrics.arms[arm]` and `evidence.per_arm_metrics[arm]` hold for this scored model."""
        ry = self.response_yield(max_tokens)
        return {
            "accuracy": self.accuracy,
            "eval_n": float(len(self.rows)),
            "eval_invalid_outputs": float(self.invalid_outputs),
            "eval_truncated_frac": ry.truncated_frac,
            "eval_no_answer_frac": ry.no_answer_frac,
            "eval_mean_response_tokens": ry.mean_response_tokens,
        }

    def predictions_jsonl(self) -> bytes:
        return "".join(canonical_json(as_object(r)) + "\n" for r in self.rows).encode("utf-8")

    def score(self, predictions_ref: str) -> JsonObject:
        return {
            "arm": self.arm,
            "metric": METRIC,
            "value": self.accuracy,
            "evaluator_id": self.evaluator_id,
            "seed": self.seed,
            "predictions_ref": predictions_ref,
        }


def evaluate(
    sampling_client: tinker.SamplingClient,
    evaluator: FrozenEvaluator,
    *,
    arm: str,
    seed: int,
    checkpoint: str,
    max_in_flight: int = 256,
    on_item: Callable[[int], None] | None = None,
) -> EvalResult:
    """Greedy-decode every item, grade, and return one row per item (invalid outputs score 0).
    `on_item(done)` after each answer received, so a caller can say how far it is."""
    evaluator.check_unchanged()
    renderer = evaluator.bundle.renderer
    stop = renderer.get_stop_sequences()
    params = tinker.SamplingParams(
        temperature=0.0, max_tokens=evaluator.max_tokens, stop=stop_list(stop), top_k=-1, top_p=1.0
    )
    data = dataset.get(dataset_of(evaluator.items))  # the seam: the items' own dataset prompts and grades
    prompts = [data.build_prompt(it, renderer)[0] for it in evaluator.items]
    responses: list[tinker.SampleResponse | None] = [None] * len(prompts)
    # Sliding window: many requests in flight, bounded so a real service is not flooded.
    pending: list[tuple[int, concurrent.futures.Future[tinker.SampleResponse]]] = []
    done = 0

    def received(j: int, fut: concurrent.futures.Future[tinker.SampleResponse]) -> None:
        nonlocal done
        responses[j] = fut.result()
        done += 1
        if on_item is not None:
            on_item(done)

    for i, ob in enumerate(prompts):
        pending.append((i, sampling_client.sample(ob, 1, params)))
        if len(pending) >= max_in_flight:
            received(*pending.pop(0))
    for j, fut in pending:
        received(j, fut)
    rows: list[PredictionRow] = []
    for item, res in zip(evaluator.items, responses, strict=True):
        assert res is not None  # every request was received above
        if len(res.sequences) != 1:
            raise RuntimeError(f"{item.item_id}: expected 1 sequence, got {len(res.sequences)}")
        seq = res.sequences[0]
        tokens = [int(t) for t in seq.tokens]
        graded = data.grade_response(item, renderer, tokens)
        prediction = gsm8k.boxed_answer(graded.content)
        rows.append(
            {
                "item_id": item.item_id,
                "arm": arm,
                "seed": seed,
                "checkpoint": checkpoint,
                "metric": METRIC,
                "prediction": prediction,
                "response": graded.content,
                "reference": item.reference,
                "value": 1 if graded.correct else 0,
                "format_ok": graded.format_ok,
                "stop_reason": str(seq.stop_reason),
                "n_tokens": len(tokens),
                "evaluator_id": evaluator.evaluator_id,
            }
        )
    return EvalResult(arm, seed, checkpoint, evaluator.evaluator_id, tuple(rows))


def observations_jsonl(results: Sequence[EvalResult]) -> bytes:
    """Scored observations of several arms (the decision's ``observations_file``; the pairing
    refuses rows of two evaluators)."""
    keys = ("item_id", "arm", "seed", "metric", "value", "evaluator_id")
    return "".join(
        canonical_json({k: as_object(r)[k] for k in keys}) + "\n" for res in results for r in res.rows
    ).encode()


def evaluation_object(
    evaluator: FrozenEvaluator, scores: Sequence[JsonObject], comparisons: Sequence[JsonObject] = ()
) -> JsonObject:
    """The ``evaluation`` object of result.json: the evaluator's record by id, scores and comparisons."""
    return {
        "version": 1,
        "evaluators": {evaluator.evaluator_id: dict(evaluator.provenance)},  # the provenance its id hashes
        "scores": list(scores),
        "comparisons": list(comparisons),
    }
