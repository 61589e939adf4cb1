"""A comparison arm whose model the service loses (Spindle: a trainer that dies answers every
submit on its models 410 `model_lost`) is replaced once from its last save: a new client, the
load observed and counted as a restore, the arm's steps since that save trained again and kept
once. A second loss of the same arm stops the run in one line naming the model.

The spindle-profile server loses the model a given forward_backward goes to (`--fault-model-lost
forward_backward:N`, counted over the server). The comparison here trains 2 rollout steps x 2
arms, 2 updates a step, arm after arm: forward_backwards 1-2 are the first arm's step 1, 3-4 the
second's, 5-6 the first arm's step 2. With `save_every` 5 no step is saved, so the first arm,
lost at its step 2, is replaced from the initial checkpoint and trains both steps again.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_in_process import ServerInProcess

from dppo_harness import constants
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.plans import load_plan
from dppo_harness.service.observed import create_from_state_with_response, make_service_client
from dppo_harness.stages.comparison.run import run_comparison
from dppo_harness.stages.write import write_comparison

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("TINKER_TELEMETRY", "0")
PLAN = load_plan(Path(__file__).parents[2] / "tests" / "fixtures" / "plans" / "comparison-ci-small.json")
ARM_NAMES = [a.name for a in PLAN.run.arms]
# Planted, made fresh per run: the spindle profile checks them.
PLANTED = {
    "TINKER_API_KEY": "tml-planted-" + secrets.token_hex(8),
    "MODAL_PROXY_TOKEN_ID": "wk-planted-" + secrets.token_hex(8),
    "MODAL_PROXY_TOKEN_SECRET": "ws-planted-" + secrets.token_hex(8),
}


def _run(tmp_path: Path, *lost_at: int):
    env = {**os.environ, **PLANTED}
    fault_args = [a for n in lost_at for a in ("--fault-model-lost", f"forward_backward:{n}")]
    # In this process: the test reads what the comparison did with the lost models, not the server's process.
    srv = ServerInProcess(
        tmp_path / "srv", "--profile", "spindle", "--model", "tiny-qwen3-random", *fault_args, credentials=PLANTED
    ).start()
    try:
        sc = make_service_client("tinker", srv.base_url, env)
        try:
            init = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32)
            path = init.save_state("lost-arm-initial").result().path
            clients = {a: create_from_state_with_response(sc, path, a)[0] for a in ARM_NAMES}
            restoration = SimpleNamespace(
                clients=clients,
                initial_checkpoint=path,
                provenance={"arms": {a: {"restore_count": 1, "optimizer_checks": []} for a in clients}},
            )
            bundle = EvidenceBundle.create(tmp_path / "bundle")
            lines: list[str] = []
            run = run_comparison(
                sc,
                PLAN,
                bundle,
                restoration,
                backend="tinker",
                state_root=tmp_path / "state",
                schedule="interleaved",
                save_every=5,
                progress=lines.append,
                tag="lost",
                base_model=constants.BASE_MODEL,  # the name the spindle profile serves
            )
            write_comparison(bundle, run)
            return run, bundle, path, lines, srv.stats()
        finally:
            sc.release(30.0)
    finally:
        srv.stop()


def _end_state(bundle: EvidenceBundle) -> dict:
    return json.loads(bundle.file_path("comparison-state-r0-end.json").read_text())


def test_a_lost_arm_is_replaced_from_its_last_save_and_trains_those_steps_again(tmp_path):
    run, bundle, init, lines, stats = _run(tmp_path, 5)
    assert stats["faults"]["injected"] == {"forward_backward:model_lost": 1}
    assert run.stopped is None and run.steps_completed == 2, run.stopped
    # every (arm, step) once, in order: the lost arm's rows from before its save point were dropped
    assert sorted((r["arm"], r["step"]) for r in run.rows) == sorted((a, s) for a in ARM_NAMES for s in (0, 1))
    lost_arm = ARM_NAMES[0]
    arms = _end_state(bundle)["arms"]
    (lost,) = arms[lost_arm]["lost_models"]
    assert lost["replaced_from"] == init and lost["replaced_from_step"] == 0 and lost["at_steps_done"] == 1
    assert "410 model_lost" in lost["error"] and lost["model_id"]
    assert not arms[ARM_NAMES[1]]["lost_models"]
    # the replacement is a restore like any other: observed load of the initial checkpoint, counted
    check = arms[lost_arm]["optimizer_checks"][-1]
    assert check["loaded_checkpoint_uri"] == init and check["at_step"] == 0
    prov = bundle.result["initialization_provenance"]["arms"][lost_arm]
    assert prov["restore_count"] == 2 and prov["loaded_checkpoint_uri"] == init
    assert any(f"replacing {lost_arm} from {init} (step 0)" in ln for ln in lines), lines
    bundle.update_result(**run.final)
    assert verify_bundle(bundle.dir) == []


def test_an_arm_lost_twice_stops_the_run_naming_the_model(tmp_path):
    # 5: the first arm's step 2 (replaced from the initial checkpoint); 7: its replacement's second update
    run, bundle, _init, _lines, stats = _run(tmp_path, 5, 7)
    assert stats["faults"]["injected"] == {"forward_backward:model_lost": 2}
    assert run.stopped is not None and run.stopped.startswith("model_lost: "), run.stopped
    (lost,) = _end_state(bundle)["arms"][ARM_NAMES[0]]["lost_models"]
    assert "the service lost the model" in run.stopped and lost["model_id"] not in run.stopped  # a new model
    assert "(model " in run.stopped
    assert run.final["status"] == "failed" and run.final["outcome_reason"] == "incomplete_execution"
    assert verify_bundle(bundle.dir) == []
