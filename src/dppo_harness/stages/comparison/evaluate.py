"""Evaluation of the paired comparison, then its decision: one frozen evaluator (frozen before
training) scores the base model and each arm's final checkpoint; the decision (`decision`) is
computed on the arms' scored observations."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from dppo_harness.data import dataset, tokenizer
from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.evidence.progress import Ticker
from dppo_harness.json_types import JsonObject
from dppo_harness.stages.comparison import decision as comparison_decision
from dppo_harness.stages.comparison.state import RunState

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan, RunConfig

BASE_ARM = "base"


def eval_subset_reason(plan: Plan, *, embedded: bool, n: int) -> str:
    """Why the evaluator scores a subset, in words that fit the run: a rehearsal plan's declared
    size (the CPU named only when the embedded server computes), else the spec's own n_examples."""
    assert plan.run is not None
    first = f"first {n} {plan.run.dataset} test items"
    if plan.kind != "rehearsal":  # a spec that itself asks for fewer items: its own words, no rehearsal claimed
        return f"the plan states eval.n_examples = {n}: its {first} are evaluated"
    cpu = ", a size the embedded server's stand-in evaluates on this host's CPU" if embedded else ""
    return f"declared rehearsal size: the plan evaluates its {first} (see the plan's differences){cpu}"


def frozen_evaluator(plan: Plan, bundle: EvidenceBundle, *, embedded: bool) -> evaluation.FrozenEvaluator:
    """The comparison's evaluator, frozen before training: the first `run.eval_items` test items
    (all 1319 for the spec), greedy, max_tokens as sampled in training. A subset is a deviation,
    with the reason the plan gives (`eval_subset_reason`)."""
    run = plan.spec_run
    test = dataset.get(run.dataset).load_split("test")
    n = None if run.eval_items == len(test) else run.eval_items
    reason = eval_subset_reason(plan, embedded=embedded, n=run.eval_items) if n else None
    items, deviation = evaluation.select_items(test, n, reason)
    evaluator = evaluation.freeze_evaluator(
        items, tokenizer.make_renderer(), max_tokens=run.max_tokens, deviation=deviation
    )
    if evaluator.deviation:
        d = evaluator.deviation
        bundle.add_deviation(d["field"], d["original"], d["effective"], d["reason"])
    return evaluator


def eval_line(res: evaluation.EvalResult, max_tokens: int, elapsed_s: float) -> str:
    """The terminal line after one scored model."""
    ry = res.response_yield(max_tokens)
    return (
        f"[comparison] {res.arm} accuracy {res.accuracy:.3f} on {len(res.rows)} items, {res.invalid_outputs} "
        f"without an answer, {ry.truncated} truncated at max_tokens {max_tokens}, mean "
        f"{ry.mean_response_tokens:.0f} tokens ({elapsed_s:.0f}s)"
    )


def evaluate_and_decide(
    service_client: tinker.ServiceClient,
    run: RunConfig,
    state: RunState,
    evaluator: evaluation.FrozenEvaluator,
    bundle: EvidenceBundle,
    rehearsal: bool,
    progress: Callable[[str], None],
    base_model: str | None,
    results: list[evaluation.EvalResult],
) -> tuple[JsonObject, dict[str, float]]:
    """The served model the arms were created on (the "base" arm), then each arm's final sampler
    checkpoint, greedy, one frozen evaluator, each appended to `results` as scored. After each: its
    own metrics under its arm's key, its predictions in the journal, its terminal line. Returns the decision on the arms' scored
    observations and its result.json metrics."""
    max_tokens, n, base = run.max_tokens, len(evaluator.items), base_model or run.base_model
    t0 = time.perf_counter()
    for arm in [BASE_ARM, *(a.name for a in run.arms)]:
        if arm == BASE_ARM:
            client = service_client.create_sampling_client(base_model=base)
            checkpoint, what = f"base:{base}", "the base model"
            progress(f"[comparison] evaluating the base model on {n} test items (greedy)")
        else:
            path = state.arms[arm].final_sampler
            assert path is not None  # evaluation runs once every arm saved its final sampler
            client, checkpoint, what = service_client.create_sampling_client(model_path=path), path, arm
            progress(f"[comparison] evaluating {arm} (final checkpoint) on {n} test items")
        ticker = Ticker(progress, f"[comparison] evaluating {what}", total=n, every_s=15.0)  # a line as answers come
        on_item = partial(ticker.tick, detail="items answered")
        res = evaluation.evaluate(client, evaluator, arm=arm, seed=run.seed, checkpoint=checkpoint, on_item=on_item)
        results.append(res)
        bundle.post_arm_metrics(arm, res.arm_metrics(max_tokens))
        bundle.journal.append("comparison", "record", f"evaluated {arm}", checkpoint, blob=res.predictions_jsonl())
        progress(eval_line(res, max_tokens, time.perf_counter() - t0))
    obs = evaluation.observations_jsonl(results[1:])  # the arms'
    return comparison_decision.decide(obs, run, rehearsal=rehearsal, eval_seconds=time.perf_counter() - t0)
