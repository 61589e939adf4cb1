"""Stages against an embedded server that leaves optional response fields out
(`--fault-omit-field`): nothing crashes, nothing is filled from what was requested, what is
missing is recorded as unavailable with the reason, and a proof that needs it fails with one
line naming the field.

| omitted | stage driven | outcome |
|---|---|---|
| `load_weights.path` | restoration preflight | fails: "no loaded checkpoint URI in the server's load response" |
| `get_info.optimizer_config`, `optim_step.metrics` | restoration preflight | passes; every optimizer check declared/unverified |
| `forward.logprobs` | restoration preflight | RestorationError naming 'logprobs' |
| `save_weights` 2nd response fails (capacity) | restoration preflight | fails: checkpoint_immutable unverified |
| `asample.logprobs` | bounded diagnostic, paired comparison | stop with evidence naming SampledSequence.logprobs |
| `get_info.model_data.model_name` | activation-gate pilot (tinker semantics) | fails: executed_base_model unavailable |
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import tinker
from sdk_session import end_session
from server_in_process import InProcessServer

from dppo_harness import constants
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.local_server.cli import build_parser, fault_config
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.plans import load_plan
from dppo_harness.service.observed import create_from_state_with_response
from dppo_harness.stages import gate
from dppo_harness.stages import restoration as restoration_module
from dppo_harness.stages.comparison.run import run_comparison
from dppo_harness.stages.diagnostic.loop import run_bounded_diagnostic
from dppo_harness.stages.restoration import build_fixed_batch
from dppo_harness.stages.write import write_comparison, write_restoration
from dppo_harness.train.clients import RestorationError

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("TINKER_TELEMETRY", "0")
ROOT = Path(__file__).parents[2]
DIAG = load_plan(ROOT / "tests" / "fixtures" / "plans" / "diagnostic-ci-tiny.json")
CMP_PLAN = load_plan(ROOT / "tests" / "fixtures" / "plans" / "comparison-ci-small.json")
ARM_NAMES = [a.name for a in CMP_PLAN.run.arms]


@pytest.fixture(scope="module")
def fixed_batch():
    return build_fixed_batch()


class _Served:
    """The embedded server in this process (untrained preset: fast start, and no server process to
    start: each test reads only the responses and the fault counters) with the given fault flags,
    parsed as the server's command line parses them, and a client."""

    def __init__(self, run_dir, *faults):
        self.engine = Engine(run_dir, model_name="tiny-qwen3-random")
        self.srv = InProcessServer(self.engine, faults=fault_config(build_parser(None).parse_args(list(faults))))
        self.srv.start()
        self.sc = tinker.ServiceClient(base_url=self.srv.base_url, api_key=constants.LOCAL_API_KEY)

    def injected(self) -> dict[str, int]:
        assert self.srv.state is not None
        return self.srv.state.faults.snapshot()["injected"]

    def close(self):
        try:
            end_session(self.sc)
        finally:
            self.srv.stop()


@pytest.fixture
def served(tmp_path):
    made = []

    def start(*faults):
        made.append(_Served(tmp_path / f"srv{len(made)}", *faults))
        return made[-1]

    yield start
    for s in made:
        s.close()


def _preflight(s, bundle, fixed_batch, **kw):
    batch, desc = fixed_batch
    result = restoration_module.run_restoration_preflight(
        s.sc,
        DIAG,  # trains its treatment arm only
        bundle,
        fixed_batch=batch,
        fixed_batch_description=desc,
        local_run_dir=s.engine.run_dir,
        lr_multipliers=(1.0, 2.0),
        **kw,
    )
    write_restoration(bundle, result)
    return result


def test_load_responses_without_path_fail_the_proof_naming_it(served, fixed_batch, tmp_path):
    s = served("--fault-omit-field", "load_weights.path")
    bundle = EvidenceBundle.create(tmp_path / "ev")
    result = _preflight(s, bundle, fixed_batch)
    assert not result.passed
    assert "dppo_seed0: no loaded checkpoint URI in the server's load response" in result.failures
    assert any(f.startswith("probe restore: server load response path None") for f in result.failures)
    init = bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]["initialization"]
    assert init["loaded_checkpoint_uri"] is None  # never the path that was asked for
    assert init["checkpoint_uri"] == result.initial_checkpoint and all(
        r.loaded_path is None for r in result.loaded.values()
    )
    assert s.injected()["load_weights:omit:path"] >= 2
    assert verify_bundle(bundle.dir) == []


def test_no_optimizer_config_or_echo_leaves_every_check_declared(served, fixed_batch, tmp_path):
    s = served("--fault-omit-field", "optim_step.metrics")  # 0.25's get_info has no optimizer field at all
    result = _preflight(s, EvidenceBundle.create(tmp_path / "ev"), fixed_batch)
    assert result.passed, result.failure_message()  # nothing mismatches: unverified is not a failure
    for entry in result.provenance["arms"].values():
        for c in entry["optimizer_checks"]:
            assert c["actual_optimizer"] is None and c["actual_config"] is None  # not the SDK's AdamW default
            assert c["source"] == "declared" and not c["verified"]
            assert any("optimizer family not exposed" in r for r in c["unverified_reasons"])
    assert result.probe.echoed_config == {} and result.probe.optim_metrics["update1"] == {}


def test_forward_outputs_without_logprobs_stop_the_preflight_naming_the_key(served, fixed_batch, tmp_path):
    s = served("--fault-omit-field", "forward.logprobs")
    with pytest.raises(RestorationError, match="has no 'logprobs'"):
        _preflight(s, EvidenceBundle.create(tmp_path / "ev"), fixed_batch)


def test_a_duplicate_save_that_fails_otherwise_leaves_immutability_unverified(served, fixed_batch, tmp_path):
    s = served("--fault-capacity-fail", "save_weights:2")  # the second save_weights: the duplicate-name save
    bundle = EvidenceBundle.create(tmp_path / "ev")
    result = _preflight(s, bundle, fixed_batch)
    assert not result.passed
    (line,) = [f for f in result.failures if "checkpoint_immutable" in f]
    assert line.startswith(
        "dppo_seed0: checkpoint_immutable unverified: the duplicate save_state ended in "
        "RequestFailedError: trainer capacity exhausted"
    )
    init = bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]["initialization"]
    assert init["checkpoint_immutable"] is None and "not an explicit refusal" in init["checkpoint_immutable_reason"]


def test_the_diagnostic_without_sampler_logprobs_stops_with_evidence(served, tmp_path):
    s = served("--fault-omit-field", "asample.logprobs")
    tc = s.sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32, seed=0)
    init = tc.save_state("omit-initial").result().path
    bundle = EvidenceBundle.create(tmp_path / "ev")
    res = run_bounded_diagnostic(s.sc, DIAG, bundle, init, backend="local")
    assert res.state.updates_done == 0 and res.state.frozen is None
    (err,) = res.state.errors
    assert "RolloutError" in err and "SampledSequence.logprobs" in err
    assert res.result_fields["final"]["status"] == "failed"
    assert verify_bundle(bundle.dir) == []


def test_the_comparison_without_sampler_logprobs_stops_with_evidence(served, tmp_path):
    s = served("--fault-omit-field", "asample.logprobs")
    tc = s.sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32, seed=0)
    init = tc.save_state("omit-cmp-initial").result().path
    clients = {a: create_from_state_with_response(s.sc, init)[0] for a in ARM_NAMES}
    restoration = SimpleNamespace(
        clients=clients,
        initial_checkpoint=init,
        provenance={"arms": {a: {"restore_count": 1, "optimizer_checks": []} for a in clients}},
    )
    bundle = EvidenceBundle.create(tmp_path / "ev")
    run = run_comparison(
        s.sc,
        CMP_PLAN,
        bundle,
        restoration,
        backend="local",
        state_root=tmp_path / "state",
        schedule="interleaved",
        tag="omit",
    )
    write_comparison(bundle, run)  # as the stage fixture does: its files and the stopped run's final
    assert run.steps_completed == 0 and run.evaluated == ()
    assert run.stopped.startswith("RolloutError") and "SampledSequence.logprobs" in run.stopped
    assert run.final["status"] == "failed" and run.final["outcome_reason"] == "incomplete_execution"
    assert "stopped after 0 of 2 rollout steps" in run.final["summary"]
    assert bundle.result["status"] == "failed" and verify_bundle(bundle.dir) == []


def test_the_gate_without_a_model_name_never_reports_the_requested_one(served, tmp_path):
    s = served("--fault-omit-field", "get_info.model_data.model_name", "--fault-omit-field", "get_info.model_name")
    tc = s.sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32, seed=0)
    init = tc.save_state("omit-gate-initial").result().path
    bundle = EvidenceBundle.create(tmp_path / "ev")
    report = gate.run_activation_gate(s.sc, CMP_PLAN, bundle, init, backend="tinker")
    assert not report.passed
    assert report.values["executed_base_model"] is None
    assert any(
        e.startswith("executed_base_model unavailable: the service's get_info response names no model")
        for e in report.errors
    ), report.errors
    assert constants.BASE_MODEL not in str(report.values["executed_base_model"])
