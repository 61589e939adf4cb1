"""The comparison stage's run: named steps over `comparison` (training) and `comparison_eval`.

prepare (config, frozen evaluator, resume state) -> open arms (the preflight's loaded clients, or
each arm's saved state on resume) -> train both arms step by step (JSONL + metrics.arms as they
go, state saved every `save_every` steps, capacity retry) -> finalize each arm (checkpoint,
completed_arms, metrics) -> evaluate base and both final checkpoints -> decision -> report.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_harness.data import dataset, tokenizer
from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.evidence.files import MAX_FILES
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.instrument import cookbook_metrics
from dppo_harness.service import clients as service
from dppo_harness.stages import comparison, comparison_eval
from dppo_harness.stages.comparison_resume import latest_snapshot, reuse_setup
from dppo_harness.train.clients import create_from_state_observed, dump_response
from dppo_harness.train.optimizer_checks import optimizer_check

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan
    from dppo_harness.stages.restoration import RestorationResult

# File slots kept after the last step: steps, 2 cookbook metrics logs, end state, evaluator, 3
# predictions, observations, decision, report + 4 plots, and the session's closing records and snapshot.
STATE_RESERVE = 19
EVAL_SUBSET_REASON = ("declared rehearsal size: the plan evaluates its first {n} GSM8K test items (see the plan's "
                      "differences), so that the offline rehearsal fits 10 minutes on 2 CPU cores")


@dataclass(frozen=True)
class ComparisonResult:
    config: comparison.ComparisonConfig
    run_id: str  # the run whose state this continues (== this bundle's run id unless resumed)
    rows: tuple[dict[str, Any], ...]
    steps_completed: int
    training_seconds: float
    schedule: str
    stopped: str | None
    capacity_block: dict[str, Any] | None
    scores: tuple[dict[str, Any], ...] = ()
    decision: dict[str, Any] | None = None
    final: dict[str, Any] = field(default_factory=dict)  # status, verdict, outcome_reason
    files: tuple[str, ...] = ()


def _prepare_state(plan: Plan, bundle: EvidenceBundle, cfg: comparison.ComparisonConfig, evaluator_id: str,
                   restoration: RestorationResult | None, state_root: Path, resume_run_id: str | None) -> comparison.RunState:
    code_rev = comparison.code_revision()
    session = {"run_id": bundle.run_id, "dir": str(bundle.dir.resolve())}
    if resume_run_id is None:
        if restoration is None:
            raise comparison.ComparisonError("a new comparison starts from the restoration preflight's result (none given)")
        return comparison.RunState(run_id=bundle.run_id, plan_sha256=plan.sha256, evaluator_id=evaluator_id,
                          code_revision=code_rev, initial_checkpoint=restoration.initial_checkpoint,
                          arms={a.name: comparison.ArmState(a.name) for a in cfg.arms}, sessions=[session],
                          setup_snapshot=latest_snapshot(bundle), setup_provenance=_setup_provenance(restoration, cfg))
    path = comparison.state_path(state_root, resume_run_id)
    if not path.is_file():
        raise comparison.ComparisonError(f"--resume {resume_run_id}: no saved comparison state at {path}")
    state = comparison.RunState.load(path)
    problems = comparison.resume_problems(state, plan_sha256=plan.sha256, evaluator_id=evaluator_id, code_rev=code_rev)
    if problems:
        raise comparison.ComparisonError(f"--resume {resume_run_id} refused: " + "; ".join(problems))
    if not state.setup_provenance and restoration is not None:  # a state saved before it was kept
        state.setup_provenance = _setup_provenance(restoration, cfg)
    continued = state.sessions[-1]["run_id"] if state.sessions else state.run_id
    from_step = comparison.rewind_to_common_save(state, cfg.steps)
    state.resumed += 1
    state.resumes.append({"session": bundle.run_id, "continues_session": continued, "from_step": from_step})
    state.sessions.append(session)
    return state


def _setup_provenance(restoration: RestorationResult, cfg: comparison.ComparisonConfig) -> dict[str, Any]:
    """Per arm, what the preflight's load counted (later restores count on from it)."""
    return {a.name: {k: restoration.provenance["arms"][a.name][k] for k in ("restore_count", "optimizer_checks")}
            for a in cfg.arms}


def _state_file(state: comparison.RunState, label: str) -> str:
    """The evidence name of the run state registered at `label` in this session."""
    return f"{comparison.STATE_FILE.removesuffix('.json')}-r{state.resumed}-{label}.json"


def restore_arm(service_client: tinker.ServiceClient, state: comparison.RunState, cfg: comparison.ComparisonConfig, name: str, path: str,
                state_file: str) -> tuple[Any, dict[str, Any]]:
    """A new training client for arm `name` from its saved state `path`, weights + optimizer, the
    load observed; one more restore_count and optimizer check, whose get_info is kept in the run
    state registered as `state_file`. Returns (client, provenance entry). A check that finds the
    server's optimizer differs from the request stops the run (OptimizerMismatch, after the check
    is recorded in the state)."""
    arm = state.arms[name]
    client, resp = create_from_state_observed(service_client, path, name)
    if resp is None or resp.path is None:
        raise comparison.ComparisonError(f"{name}: restore of {path} not observed: the load response has no path "
                                "(optional in the SDK's LoadWeightsResponse)")
    if resp.path != path:
        raise comparison.ComparisonError(f"{name}: restore of {path} loaded {resp.path!r}")
    arm.restore_count += 1
    prior = state.setup_provenance.get(name)
    if prior is None:
        raise comparison.ComparisonError(f"{name}: the run state holds no preflight provenance to count restores on")
    check = optimizer_check(after_restore=prior["restore_count"] + arm.restore_count,
                            requested_optimizer="adam", requested_config=cfg.arm(name).adam_requested,
                            info=client.get_info(), info_ref=f"{state_file}#{name}.restore{arm.restore_count}",
                            echoed=None, echo_ref=None, echo_observed_on=None)
    arm.optimizer_checks.append({**check, "loaded_checkpoint_uri": resp.path, "at_step": arm.steps_done,
                                 "load_response": dump_response(resp)})
    prov = {"restore_count": prior["restore_count"] + arm.restore_count,
            # The checkpoint this session's arm actually loaded (the server's own load response).
            "loaded_checkpoint_uri": resp.path, "loaded_at_step": arm.steps_done,
            "optimizer_checks": list(prior["optimizer_checks"]) + [
                {k: v for k, v in c.items() if k != "load_response"} for c in arm.optimizer_checks]}
    if check["mismatches"]:  # the brief: stop on mismatch
        raise comparison.OptimizerMismatch(f"{name}: optimizer mismatch after restore {check['after_restore']} "
                                  f"({path}): " + "; ".join(check["mismatches"]), name, prov, state_file)
    return client, prov


def _open_arms(service_client: tinker.ServiceClient, state: comparison.RunState, cfg: comparison.ComparisonConfig,
               restoration: RestorationResult | None, bundle: EvidenceBundle, call: Callable) -> dict[str, Any]:
    """New run: the arms' clients the preflight loaded from the shared initial checkpoint (its
    observed load). Resume: each arm from the state every arm saved last (step 0: the shared
    initial checkpoint), with optimizer; each restore is one more restore_count and optimizer
    check, and the run state holding their get_info is registered before the result names it."""
    if not state.resumed:
        assert restoration is not None
        return {a.name: restoration.clients[a.name] for a in cfg.arms}
    clients, prov_arms = {}, {}
    ref = _state_file(state, "open")
    for a in cfg.arms:
        path = state.arms[a.name].state_path or state.initial_checkpoint
        clients[a.name], prov_arms[a.name] = call(
            lambda n=a.name, p=path: restore_arm(service_client, state, cfg, n, p, ref))
    bundle.register_json(ref, "manifest", state.to_json())
    bundle.update_result(initialization_provenance={"arms": prov_arms})
    return clients


def run_comparison(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    restoration: RestorationResult | None,
    *,
    backend: str,
    state_root: Path,
    resume_run_id: str | None = None,
    schedule: comparison.Schedule = "interleaved",
    save_every: int = 1,
    capacity_policy: service.CapacityPolicy | None = None,
    registry: service.ClientRegistry | None = None,
    stop_after: Callable[[int], None] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    tag: str = "cmp",
    base_model: str | None = None,
    schedule_source: str = "given",
    guard: comparison.WallGuard | None = None,
    wandb: cookbook_metrics.WandbRequest | None = None,
) -> ComparisonResult:
    """Run (or continue) the paired comparison and write its evidence; see the module docstring.

    Any stop before every arm finished (wall-clock guard, optimizer mismatch on a restore, a
    response the run cannot use, capacity) leaves the evidence written so far and returns a final
    failed / inconclusive / incomplete_execution with the reason. Each arm's steps are also written
    through the cookbook's `ml_log` (`metrics-<arm>.jsonl` in the bundle, live under
    `<state_root>/<run_id>/cookbook-metrics/<arm>/metrics.jsonl`), and to W&B only when `wandb`
    asks for a project."""
    if plan.run is None:
        raise comparison.ComparisonError(f"plan {plan.name}: a {plan.kind} plan has no paired comparison")
    cfg = comparison.comparison_config(plan.run, save_every=save_every)
    rehearsal = plan.kind == "rehearsal" or backend == "local"
    evaluator = comparison_eval.freeze_for(cfg, EVAL_SUBSET_REASON.format(n=cfg.eval_items))
    if evaluator.deviation:
        d = evaluator.deviation
        bundle.add_deviation(d["field"], d["original"], d["effective"], d["reason"])
    state = _prepare_state(plan, bundle, cfg, evaluator.evaluator_id, restoration, Path(state_root), resume_run_id)
    spath = comparison.state_path(Path(state_root), state.run_id)
    reused = reuse_setup(bundle, state) if state.resumed else None
    if reused is not None:  # the preflight and gate of the run, hash-verified, and where this session starts
        bundle.update_result(**reused.blocks)
        bundle.update_result(initialization_provenance={"resume": {
            "comparison_run": state.run_id, "resumed_times": state.resumed,
            "from_step": state.resumes[-1]["from_step"], "continues_session": reused.continued,
            "evidence_ref": reused.manifest}})
    # The session waiter's tracker when there is one: its capacity window widens after the first step too.
    waiter = getattr(service_client, "waiter", None)
    tracker = waiter.tracker if waiter is not None else service.CapacityTracker()
    tracker.comparison_steps_completed = min(s.steps_done for s in state.arms.values())

    def call(fn: Callable[[], Any]) -> Any:
        return service.call_with_capacity_retry(fn, policy=capacity_policy or service.CapacityPolicy(), steps_completed=tracker,
                                                registry=registry, on_retry=tracker.events.append)

    mlog = cookbook_metrics.ArmMetricsLog(
        Path(state_root) / state.run_id / "cookbook-metrics", [a.name for a in cfg.arms], run_name=state.run_id,
        wandb=wandb or cookbook_metrics.WandbRequest(None, "not requested"),
        config={"plan": plan.name, "plan_sha256": plan.sha256, "run_id": state.run_id, **asdict(cfg)})
    for problem in mlog.status["wandb"]["problems"]:
        progress(f"[comparison] W&B not used: {problem} (the metrics.jsonl logs go on)")
    bundle.register_json(f"comparison-run-{state.resumed}.json", "manifest", {
        "run_id": state.run_id, "resumed_sessions": state.resumed, "sessions": state.sessions,
        "resumes": state.resumes, "save_every": cfg.save_every, "schedule": schedule,
        "schedule_source": schedule_source, "rehearsal": rehearsal,
        "state_file": str(spath), "evaluator_id": evaluator.evaluator_id, "code_revision": state.code_revision,
        "plan": {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256}, "config": asdict(cfg),
        "cookbook_metrics": {**mlog.status, "live_files": {a.name: str(mlog.path(a.name)) for a in cfg.arms},
                             "evidence_files": {a.name: _metrics_name(a.name, state) for a in cfg.arms}}})
    if rehearsal:  # the pipeline is rehearsed on a stand-in; the hypothesis is not tested
        bundle.update_result(original_hypothesis_tested=False, tested_instead=(
            f"offline rehearsal of the paired-comparison pipeline under {plan.name} on the embedded server's stand-in "
            f"model ({cfg.base_model}); declared differences from the spec are recorded as deviations"))
    clients: dict[str, Any] = {}
    progress(f"[comparison] schedule {schedule} ({schedule_source})")
    train = dataset.get(cfg.dataset).load_split("train", seed=cfg.arms[0].seed)
    renderer = tokenizer.make_renderer().renderer
    by_arm = {a.name: [r for r in state.rows if r["arm"] == a.name] for a in cfg.arms}

    def restore_mid_step(runner: comparison.ArmRunner, path: str, failure: dict[str, Any]) -> comparison.ArmRunner:
        """A refused attempt sent updates: back to the step's start before the retry (inside `call`)."""
        name = runner.spec.name
        progress(f"[comparison] {name} step {failure['step'] + 1}: refused after {failure['updates_sent_before_failure']} "
                 f"update(s) ({failure['error'][:120]}); restoring {path} (weights + optimizer) before the retry")
        ref = _state_file(state, f"{name}-s{failure['step']}-a{failure['attempt']}")
        client, prov = restore_arm(service_client, state, cfg, name, path, ref)
        clients[name] = client
        bundle.register_json(ref, "manifest", state.to_json())
        bundle.update_result(initialization_provenance={"arms": {name: prov}})
        return dataclasses.replace(runner, client=client)

    def save_arm_state(runner: comparison.ArmRunner, steps_done: int) -> str:
        return runner.client.save_state(f"{tag}-{state.run_id}-{runner.spec.name}-step{steps_done}-r{state.resumed}").result().path

    def on_row(row: dict[str, Any]) -> None:
        by_arm[row["arm"]].append(row)
        state.save(spath)
        mlog.log(row["arm"], cookbook_metrics.step_record(row, steps=cfg.steps, learning_rate=cfg.arm(row["arm"]).adam["learning_rate"]),
                 row["step"])
        done = row["step"] + 1
        if all(str(done) in s.saves and s.steps_done == done for s in state.arms.values()):
            # Every arm saved this step: the resume point, registered as it is saved, and a snapshot.
            _register_saved_state(bundle, state, done)
            post_snapshot(bundle, f"comparison step {done} saved", reserve=STATE_RESERVE + 1)
        bundle.post_arm_metrics(row["arm"], comparison.arm_summary(by_arm[row["arm"]]))
        if all(s.steps_done > row["step"] for s in state.arms.values()):
            tracker.step_done()
        arm = state.arms[row["arm"]]
        if arm.steps_done == cfg.steps:
            _finalize_arm(clients[row["arm"]], row["arm"], state, bundle, by_arm, tag)
            state.save(spath)

    capacity_block = None
    try:
        clients.update(_open_arms(service_client, state, cfg, restoration, bundle, call))
        state.save(spath)
        runners = comparison.make_runners(clients, cfg)
        outcome = comparison.train_arms(runners, cfg, state, items_for_step=lambda s: train.batch(s, cfg.groups_per_batch),
                               renderer=renderer, tag=f"{tag}-{state.run_id}-r{state.resumed}", schedule=schedule,
                               on_row=on_row, save_state=save_arm_state, restore=restore_mid_step, call=call,
                               stop_after=stop_after, progress=progress, guard=guard)
    except service.CapacityExhausted as exc:
        capacity_block = exc.block.as_dict()
        outcome = comparison.TrainingOutcome(tuple(state.rows), min(s.steps_done for s in state.arms.values()), 0.0, schedule,
                                    f"capacity: {exc}")
    except Exception as exc:  # never a crash mid-run: stop with the evidence so far and the reason
        if isinstance(exc, comparison.OptimizerMismatch) and exc.provenance:  # the check that stopped it, posted
            if exc.state_file and bundle.entry(exc.state_file) is None:  # the state its check references
                bundle.register_json(exc.state_file, "manifest", state.to_json())
            bundle.update_result(initialization_provenance={"arms": {exc.arm: exc.provenance}})
        reason = f"{type(exc).__name__}: {service.error_text(exc)}"[:500]
        progress(f"[comparison] stopped: {reason}")
        outcome = comparison.TrainingOutcome(tuple(state.rows), min(s.steps_done for s in state.arms.values()), 0.0, schedule,
                                    reason)
    finally:
        mlog.close()
    state.save(spath)
    files = [_register_steps(bundle, state)]
    files += _register_cookbook_metrics(bundle, state, mlog)
    bundle.register_json(_state_file(state, "end"), "manifest", {
        **state.to_json(), "training": {"schedule": schedule, "schedule_source": schedule_source,
                                        "stopped": outcome.stopped, "steps_completed": outcome.steps_completed,
                                        "wall_guard": guard.as_dict() if guard is not None else None}})
    files.append(_state_file(state, "end"))
    base = dict(config=cfg, run_id=state.run_id, rows=tuple(state.rows), steps_completed=outcome.steps_completed,
                training_seconds=outcome.wall_seconds, schedule=schedule, stopped=outcome.stopped)
    if outcome.stopped is not None:
        final = {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution",
                 "summary": (f"The paired comparison under {plan.name} stopped after {outcome.steps_completed} of "
                             f"{cfg.steps} rollout steps per arm, before evaluation, so nothing was compared: "
                             + outcome.stopped.replace(". ", "; ").rstrip(".") + ".")}
        if bundle.result.get("original_hypothesis_tested") is None:
            final.update(original_hypothesis_tested=False,
                         tested_instead="nothing: the paired comparison stopped before any evaluation")
        if capacity_block is not None:
            final["capacity_block"] = capacity_block
        return ComparisonResult(**base, capacity_block=capacity_block, final=final, files=tuple(files))
    scores, decision, eval_files = _evaluate_and_decide(service_client, cfg, state, evaluator, bundle, rehearsal,
                                                        progress, base_model or cfg.base_model)
    files += eval_files
    from dppo_harness.evidence import report

    resume = (bundle.result.get("initialization_provenance") or {}).get("resume") if state.resumed else None
    files += list(report.write_comparison_report(bundle, state.rows, scores, decision, backend,
                                                 max_tokens=cfg.max_tokens, resume=resume).values())
    acc = ", ".join(f"{sc['arm']} {sc['value']:.3f}" for sc in scores)
    diffs = "; ".join(f"{c['treatment']} minus {c['baseline']} {c['mean_difference']:.4g} with "
                      f"{100 * (1 - c['alpha']):g}% paired Hoeffding CI [{c['lower']:.4g}, {c['upper']:.4g}]"
                      for c in decision["criteria"])
    served = (bundle.result.get("backend") or {}).get("served_model") or cfg.base_model
    # At most two plain sentences (the brief's output shape); the details are in report.md.
    final = {"status": "succeeded", "verdict": decision["verdict"], "outcome_reason": decision["outcome_reason"],
             "summary": (f"Paired comparison under {plan.name} ({outcome.steps_completed}/{cfg.steps} rollout steps per "
                         f"arm): greedy accuracy on {cfg.eval_items} test items {acc}, {diffs}, verdict {decision['verdict']} "
                         f"({decision['outcome_reason']})."
                         + (f" It is a rehearsal on the stand-in model {served}, not a test of the hypothesis on "
                            f"{plan.planned_model}." if rehearsal else ""))}
    return ComparisonResult(**base, capacity_block=None, scores=tuple(scores), decision=decision, final=final,
                            files=tuple(files))


def _register_saved_state(bundle: EvidenceBundle, state: comparison.RunState, step: int) -> str | None:
    """The run state at a save every arm made, as an evidence file, unless only the slots kept for
    the evaluation and report are left (then the ledger says so; the state file itself is kept)."""
    name = _state_file(state, f"s{step}")
    if len(bundle.files()) + 1 > MAX_FILES - STATE_RESERVE:
        skipped = list(bundle.ledger().get("comparison_states_not_registered", []))
        bundle.note_ledger(comparison_states_not_registered=[*skipped, {
            "name": name, "reason": f"file limit: {len(bundle.files())} of {MAX_FILES} files used, "
                                    f"{STATE_RESERVE} kept for the evaluation and report"}])
        return None
    bundle.register_json(name, "manifest", state.to_json())
    return name


def _register_steps(bundle: EvidenceBundle, state: comparison.RunState) -> str:
    name = f"{comparison.STEPS_FILE.removesuffix('.jsonl')}-{state.resumed}.jsonl" if state.resumed else comparison.STEPS_FILE
    bundle.register_bytes(name, "metrics", comparison.jsonl(state.rows))
    return name


def _metrics_name(arm: str, state: comparison.RunState) -> str:
    """The bundle name of an arm's cookbook `metrics.jsonl` (a resumed session's own copy gets -rN)."""
    return f"metrics-{arm}-r{state.resumed}.jsonl" if state.resumed else f"metrics-{arm}.jsonl"


def _register_cookbook_metrics(bundle: EvidenceBundle, state: comparison.RunState, mlog: cookbook_metrics.ArmMetricsLog) -> list[str]:
    """Each arm's ml_log `metrics.jsonl`, as written (every step of the run so far, resumed sessions
    included), registered as kind metrics."""
    names = []
    for arm in state.arms:
        path = mlog.path(arm)
        if path.is_file():
            name = _metrics_name(arm, state)
            bundle.register_file(name, "metrics", path)
            names.append(name)
    return names


def _finalize_arm(client: Any, arm: str, state: comparison.RunState, bundle: EvidenceBundle,
                  by_arm: Mapping[str, list[dict[str, Any]]], tag: str) -> None:
    """After an arm's last step: final sampler weights + state, checkpoint URI, completed_arms, metrics."""
    s = state.arms[arm]
    s.final_sampler = client.save_weights_for_sampler(f"{tag}-{state.run_id}-{arm}-final").result().path
    s.final_state = s.state_path
    if s.final_state:
        bundle.add_checkpoint(arm, s.steps_done, s.final_state)
    bundle.add_checkpoint(arm, s.steps_done, s.final_sampler)
    bundle.post_arm_metrics(arm, comparison.arm_summary(by_arm[arm]), completed=True)


def _evaluate_and_decide(service_client: tinker.ServiceClient, cfg: comparison.ComparisonConfig, state: comparison.RunState, evaluator: evaluation.FrozenEvaluator, bundle: EvidenceBundle,
                         rehearsal: bool, progress: Callable[[str], None],
                         base_model: str) -> tuple[list[dict], dict, list[str]]:
    """Base model first (posted at once), then each arm's final checkpoint, one frozen evaluator."""
    files: list[str] = []
    bundle.register_json(f"evaluator-{evaluator.evaluator_id[:16]}.json", "manifest",
                         {"evaluator_id": evaluator.evaluator_id, "provenance": evaluator.provenance,
                          "code_manifest": evaluator.code_manifest, "deviation": evaluator.deviation})
    files.append(f"evaluator-{evaluator.evaluator_id[:16]}.json")
    seed = cfg.arms[0].seed
    scores: list[dict[str, Any]] = []
    comparisons = [{"metric": c.metric, "arms": [c.baseline, c.treatment]} for c in cfg.criteria]

    def post() -> None:
        bundle.update_result(evaluation=evaluation.evaluation_object([evaluator], scores, comparisons),
                             metrics={f"eval/accuracy/{s['arm']}": float(s["value"]) for s in scores})

    t0 = time.perf_counter()
    # The served model the arms were created on (the connectivity preflight's choice).
    base_client = service_client.create_sampling_client(base_model=base_model).result()
    progress(f"[comparison] evaluating the base model on {len(evaluator.items)} test items (greedy)")
    base = evaluation.evaluate(base_client, evaluator, arm=comparison_eval.BASE_ARM, seed=seed, checkpoint=f"base:{base_model}")
    scores.append(comparison_eval.register_predictions(bundle, base))
    files.append(scores[-1]["predictions_ref"])
    post()
    # Accuracy, n and invalid outputs under the scored model's own key (the base model's is "base").
    bundle.post_arm_metrics(comparison_eval.BASE_ARM, base.arm_metrics(cfg.max_tokens))
    progress(comparison_eval.eval_line(base, cfg.max_tokens, time.perf_counter() - t0))
    results = {}
    for a in cfg.arms:
        path = state.arms[a.name].final_sampler
        sampler = service_client.create_sampling_client(model_path=path).result()
        progress(f"[comparison] evaluating {a.name} (final checkpoint) on {len(evaluator.items)} test items")
        res = evaluation.evaluate(sampler, evaluator, arm=a.name, seed=seed, checkpoint=path)
        results[a.name] = res
        scores.append(comparison_eval.register_predictions(bundle, res))
        files.append(scores[-1]["predictions_ref"])
        post()
        bundle.post_arm_metrics(a.name, res.arm_metrics(cfg.max_tokens))
        progress(comparison_eval.eval_line(res, cfg.max_tokens, time.perf_counter() - t0))
    obs = evaluation.observations_jsonl([results[a.name] for a in cfg.arms])
    bundle.register_bytes(comparison_eval.OBSERVATIONS_FILE, "metrics", obs)
    files.append(comparison_eval.OBSERVATIONS_FILE)
    rows = [json.loads(line) for line in obs.decode().splitlines()]
    criteria = comparison_eval.decide_criteria(rows, cfg.criteria, alpha=cfg.alpha)
    # Beside the decision, never deciding: the first criterion's pair (the metrics keys are unqualified).
    informational = comparison_eval.informational_interval(rows, cfg.criteria[0], alpha=cfg.alpha)
    decision = comparison_eval.decision_block(obs, criteria, comparison_eval.verdict(criteria, rehearsal=rehearsal), rehearsal=rehearsal,
                                informational=informational)
    bundle.register_json(comparison_eval.DECISION_FILE, "metrics", decision)
    files.append(comparison_eval.DECISION_FILE)
    metrics = {"comparison/accuracy_difference": float(criteria[0].interval["mean_difference"]),
               "comparison/ci_lower": criteria[0].lower, "comparison/ci_upper": criteria[0].upper,
               "comparison/eval_seconds": time.perf_counter() - t0, **comparison_eval.informational_metrics(informational)}
    if len(criteria) > 1:  # every criterion is decided on its own
        for c in criteria:
            metrics.update({f"comparison/{c.id}/difference": float(c.interval["mean_difference"]),
                            f"comparison/{c.id}/ci_lower": c.lower, f"comparison/{c.id}/ci_upper": c.upper})
    bundle.update_result(decision=decision, metrics=metrics)
    return scores, decision, files
