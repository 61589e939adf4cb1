"""`run_comparison` on fake arms (no service, no model): each arm-step is a function the test
gives, the clients count updates and saves, the bundle is real; the loop, its guard, retries,
saves and evidence run as written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.plans import load_plan
from dppo_harness.service.wait.policy import CAPACITY_SCALE_VAR, WaitPolicy
from dppo_harness.stages.comparison import run as comparison_run
from dppo_harness.stages.write import write_comparison

PLAN = load_plan(Path(__file__).parents[2] / "plans" / "rehearsal" / "comparison-local.json")


class FakeClient:
    """A training client that counts applied updates; `refuse_at` makes the n-th update raise
    before anything is applied. Saves return their name as a tinker:// path."""

    def __init__(self, name: str, applied: int = 0, refuse_at: int | None = None):
        self.model_id, self.applied, self.calls, self.refuse_at = f"model-{name}", applied, 0, refuse_at
        self.saved: dict[str, int] = {}

    def update(self) -> None:
        self.calls += 1
        if self.calls == self.refuse_at:
            raise RuntimeError("trainer capacity exhausted: no trainer available")
        self.applied += 1

    def save_state(self, name: str) -> Any:
        path = f"tinker://{self.model_id}/weights/{name}"
        self.saved[path] = self.applied
        return SimpleNamespace(result=lambda: SimpleNamespace(path=path))

    def save_weights_for_sampler(self, name: str) -> Any:
        return SimpleNamespace(result=lambda: SimpleNamespace(path=f"tinker://{self.model_id}/sampler_weights/{name}"))


def row(arm: str, step: int, **extra: Any) -> dict[str, Any]:
    """A step row with the fields the loop's summaries and lines read."""
    return {
        "arm": arm,
        "step": step,
        "reward_mean": 0.0,
        "format_rate": 0.0,
        "truncated_frac": 0.0,
        "no_answer_frac": 0.0,
        "mean_response_tokens": 0.0,
        "dppo_masked_frac": 0.0,
        "ppo_clip_frac": 0.0,
        "drift_abs_p90": 0.0,
        "loss_tokens": 0,
        "seconds": 0.0,
        **extra,
    }


def updating_step(client, arm, run, step, items, renderer, loss, tag, *, attempt=0, progress=None):
    """An arm-step that sends `updates_per_batch` updates, then returns its row."""
    for _ in range(arm.updates_per_batch):
        progress.updates_submitted += 1
        client.update()
    return row(arm.name, step, applied=client.applied, attempt=attempt)


def run_fake(tmp_path: Path, monkeypatch: Any, steps: int, arm_step: Any = updating_step, clients=None, **kwargs):
    """`run_comparison` over `steps` rollout steps of the rehearsal plan, with `arm_step` for each
    arm-step and `clients` (default: one FakeClient per arm); (result, bundle, clients)."""
    plan = dataclasses.replace(PLAN, run=dataclasses.replace(PLAN.run, rollout_steps=steps))
    clients = clients or {a.name: FakeClient(a.name) for a in plan.run.arms}
    monkeypatch.setattr(comparison_run, "run_arm_step", arm_step)
    monkeypatch.setattr(
        comparison_run, "frozen_evaluator", lambda *a, **k: SimpleNamespace(evaluator_id="e", deviation=None)
    )
    monkeypatch.setattr(
        comparison_run.dataset,
        "get",
        lambda _name: SimpleNamespace(load_split=lambda *a, **k: SimpleNamespace(batch=lambda step, n: [])),
    )
    monkeypatch.setattr(comparison_run.tokenizer, "make_renderer", lambda: SimpleNamespace(renderer=None))
    decision = {"criteria": [], "verdict": "inconclusive", "outcome_reason": "fake evaluation"}
    monkeypatch.setattr(comparison_run, "evaluate_and_decide", lambda *a, **k: (decision, {}))
    restoration = SimpleNamespace(
        initial_checkpoint="tinker://init/weights/initial",
        clients=clients,
        provenance={"arms": {a.name: {"restore_count": 1, "optimizer_checks": []} for a in plan.run.arms}},
    )
    bundle = kwargs.pop("bundle", None) or EvidenceBundle.create(tmp_path / "runs", "fake")
    kwargs.setdefault("capacity_policy", WaitPolicy.from_options(env={CAPACITY_SCALE_VAR: "1e-4"}))  # backoff in ms
    result = comparison_run.run_comparison(
        object(), plan, bundle, restoration, backend="local", state_root=tmp_path / "state", **kwargs
    )
    write_comparison(bundle, dataclasses.replace(result, evaluator=None))  # the fake evaluation writes nothing
    return result, bundle, clients
