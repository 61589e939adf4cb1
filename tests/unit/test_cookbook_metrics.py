"""Cookbook-compatible per-arm metrics: KL(sample||train) and entropy as the cookbook computes them,
its metric names, `metrics.jsonl` through its `ml_log` and read back by its own readers, and W&B
only when asked (never imported, never reached, otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from diagnostic_rehearsal import simulate_records
from tinker_cookbook.stores.storage import LocalStorage
from tinker_cookbook.stores.training_store import TrainingRunStore
from tinker_cookbook.utils.file_utils import read_jsonl

from dppo_harness.data.gsm8k import Graded, Gsm8kItem
from dppo_harness.instrument import cookbook_metrics as CM
from dppo_harness.instrument import wandb_opt_in
from dppo_harness.loss import loss_registry
from dppo_harness.rollout import rollouts
from dppo_harness.stages.comparison.step_rows import step_metrics

SRC = Path(__file__).resolve().parents[2] / "src"


def test_kl_sample_train_and_entropy_match_the_cookbook_definition_by_hand():
    records = simulate_records(n_updates=2, minibatches_per_epoch=2, sequences=4, drift_per_update=0.05)
    kl = CM.kl_sample_train(records)
    q = np.concatenate([r.tensors["sampler_logprobs_N"][r.tensors["mask_N"] > 0] for r in records]).astype(np.float64)
    p = np.concatenate([r.tensors["logprobs_N"][r.tensors["mask_N"] > 0] for r in records]).astype(np.float64)
    d = q - p  # sampler minus trainer over action tokens
    assert kl["optim/kl_sample_train_v1"] == pytest.approx(d.mean(), rel=1e-5, abs=1e-7)
    assert kl["optim/kl_sample_train_v2"] == pytest.approx(0.5 * (d**2).mean(), rel=1e-5)
    assert kl["optim/entropy"] == pytest.approx(-q.mean(), rel=1e-5)
    assert kl["optim/kl_sample_train_v2"] > 0  # the simulated policy drifted


def test_kl_is_not_invented_without_loss_tokens():
    records = simulate_records(n_updates=1, minibatches_per_epoch=1, sequences=2)
    for r in records:
        r.tensors["mask_N"] = np.zeros_like(r.tensors["mask_N"])
    assert CM.kl_sample_train(records) == {}


def _tiny_batch():
    item = Gsm8kItem("gsm8k-train-0000", "train", 0, "q", "s #### 1", "1")
    groups = []
    for g, rewards in enumerate(([1.0, 0.0], [-0.1, -0.1])):
        graded = tuple(Graded(r, r > -0.1, r > 0.5, "", True, r > -0.1) for r in rewards)
        groups.append(
            rollouts.SampledGroup(
                g, item, (1, 2, 3), ((4, 5), (6, 7, 8)), ((0.0, 0.0), (0.0, 0.0, 0.0)), ("stop", "length"), graded, None
            )
        )
    cfg = rollouts.RolloutConfig(groups_per_batch=2, group_size=2, temperature=1.0, max_tokens=3)
    return rollouts.RolloutBatch(tuple(groups), cfg, "tinker://m/sampler_weights/s0", "m", (9,), 0.1, 0.0)


def test_step_record_uses_the_cookbooks_names():
    batch = _tiny_batch()
    env = CM.trajectory_metrics(batch)
    assert env["env/all/reward/total"] == pytest.approx(np.mean([1.0, 0.0, -0.1, -0.1]))
    assert env["env/all/total_ac_tokens"] == 10 and env["env/all/by_group/frac_mixed"] == 0.5
    records = simulate_records(n_updates=2, minibatches_per_epoch=2, sequences=2)
    row = step_metrics(
        "grpo_seed0",
        1,
        batch.summary(),
        records,
        loss=loss_registry.GRPO_LOSS,
        seconds=3.0,
        sample_seconds=1.0,
        sampler_checkpoint="tinker://x",
        kl=CM.kl_sample_train(records),
        cookbook_env=env,
        rollout_seconds=0.5,
    ).as_row()
    rec = CM.step_record(row, steps=4, learning_rate=2e-5)
    for key in (
        "env/all/reward/total",
        "env/all/format",
        "env/all/correct",
        "env/all/total_ac_tokens",
        "optim/kl_sample_train_v1",
        "optim/kl_sample_train_v2",
        "optim/entropy",
        "optim/lr",
        "progress/batch",
        "progress/done_frac",
        "time/total",
        "time/sampling",
    ):
        assert key in rec, key
    assert rec["progress/done_frac"] == 0.5 and rec["time/total"] == 3.0 and rec["time/sampling"] == 0.5
    assert rec["harness/counterfactual_dppo_masked_frac"] == row["counterfactual_dppo_masked_frac"]
    assert rec["harness/truncated_frac"] == 0.5 and "harness/dppo_masked_frac" not in rec
    assert all(isinstance(v, float) for v in rec.values())


def test_metrics_jsonl_per_arm_loads_with_the_cookbooks_readers(tmp_path):
    log = CM.ArmMetricsLog(tmp_path / "logs", ["grpo_seed0", "dppo_seed0"], run_name="run1")
    for step in range(3):
        for arm in ("grpo_seed0", "dppo_seed0"):
            log.log(arm, {"env/all/reward/total": 0.1 * step, "optim/entropy": 1.0}, step)
    log.close()
    assert log.status["wandb"]["requested"] is False and log.status["wandb"]["active_arms"] == []
    for arm in ("grpo_seed0", "dppo_seed0"):
        path = log.path(arm)
        assert path.name == "metrics.jsonl" and path.parent.name == arm
        by_store = TrainingRunStore(LocalStorage(path.parent)).read_metrics()
        by_reader = read_jsonl(str(path))
        assert by_store == by_reader and [r["step"] for r in by_store] == [0, 1, 2]
        assert by_store[2]["env/all/reward/total"] == pytest.approx(0.2)


def test_wandb_request_option_then_env():
    assert wandb_opt_in.wandb_request("p", env={"WANDB_PROJECT": "q"}) == wandb_opt_in.WandbRequest(
        "p", "--wandb-project"
    )
    assert wandb_opt_in.wandb_request(None, env={"WANDB_PROJECT": "q"}) == wandb_opt_in.WandbRequest(
        "q", "WANDB_PROJECT"
    )
    assert wandb_opt_in.wandb_request(None, env={}).project is None


STUB = textwrap.dedent('''
    """A stand-in `wandb` that records what the harness asks of it (never the network)."""
    import json, os, types

    def _note(**event):
        with open(os.environ["WANDB_STUB_LOG"], "a") as f:
            f.write(json.dumps(event) + "\\n")

    _note(event="import")
    config = types.SimpleNamespace(update=lambda d: _note(event="config"))

    class _Run:
        url = "https://wandb.invalid/run"

    def init(project=None, config=None, dir=None, name=None, **kw):
        _note(event="init", project=project, name=name)
        return _Run()

    def log(metrics, step=None):
        _note(event="log", step=step, keys=sorted(metrics))

    def finish():
        _note(event="finish")
''')

SCRIPT = textwrap.dedent("""
    import json, socket, sys
    from pathlib import Path

    def no_network(*a, **k):
        raise AssertionError("network reached")

    socket.socket.connect = no_network
    socket.create_connection = no_network
    from dppo_harness.instrument import cookbook_metrics as cm
    from dppo_harness.instrument.wandb_opt_in import wandb_request

    log = cm.ArmMetricsLog(Path(sys.argv[1]), ["a"], run_name="r", wandb=wandb_request(sys.argv[2] or None))
    log.log("a", {"env/all/reward/total": 0.5}, 0)
    log.close()
    print(json.dumps({"wandb_loaded": "wandb" in sys.modules and sys.modules["wandb"] is not None,
                      "status": log.status}))
""")


# tinker-cookbook 0.5.7's `ml_log.WandbLogger` refuses to start without WANDB_API_KEY in the
# environment (0.5.8 left authentication to wandb itself): the stub never checks the value.
STUB_API_KEY = "stub-key-never-sent"


def _run(
    tmp_path: Path, project: str, env_project: str | None = None, api_key: str | None = STUB_API_KEY
) -> tuple[dict, list[dict]]:
    stub = tmp_path / "stub"
    (stub / "wandb").mkdir(parents=True, exist_ok=True)
    (stub / "wandb" / "__init__.py").write_text(STUB)
    events = tmp_path / f"events-{project or 'none'}-{env_project or 'none'}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_PROJECT", "WANDB_API_KEY")}
    env.update(PYTHONPATH=os.pathsep.join([str(stub), str(SRC)]), WANDB_STUB_LOG=str(events), TINKER_TELEMETRY="0")
    if api_key is not None:
        env["WANDB_API_KEY"] = api_key
    if env_project:
        env["WANDB_PROJECT"] = env_project
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs"), project],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = events.read_text().splitlines() if events.exists() else []
    return json.loads(out.stdout.strip().splitlines()[-1]), [json.loads(x) for x in lines]


def test_without_the_option_wandb_is_never_imported_nor_reached(tmp_path):
    """wandb is installed (a stub on the path) and every socket connect raises: without
    --wandb-project or WANDB_PROJECT the metrics are written and wandb is not even imported."""
    result, events = _run(tmp_path, "")
    assert events == [] and result["wandb_loaded"] is False
    assert result["status"]["wandb"] == {
        "requested": False,
        "source": "not requested",
        "project": None,
        "active_arms": [],
        "problems": [],
    }
    assert (tmp_path / "logs" / "a" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("option, env_project", [("proj", None), ("", "proj")])
def test_w_and_b_is_used_when_asked(tmp_path, option, env_project):
    result, events = _run(tmp_path, option, env_project)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "import" and "init" in kinds and "log" in kinds and kinds[-1] == "finish"
    init = next(e for e in events if e["event"] == "init")
    assert init["project"] == "proj" and init["name"] == "r-a"
    assert result["status"]["wandb"]["active_arms"] == ["a"]
    assert next(e for e in events if e["event"] == "log")["step"] == 0


def test_w_and_b_asked_for_without_an_api_key_is_a_recorded_problem_not_a_failure(tmp_path):
    """With cookbook 0.5.7 an asked-for W&B run needs WANDB_API_KEY: without it no run starts, the
    status says why for each arm, and the JSON metrics are written all the same."""
    result, events = _run(tmp_path, "proj", api_key=None)
    assert "init" not in [e["event"] for e in events]
    wandb = result["status"]["wandb"]
    assert wandb["requested"] is True and wandb["active_arms"] == []
    assert wandb["problems"] == ["a: ConfigurationError: WANDB_API_KEY environment variable not set"]
    assert (tmp_path / "logs" / "a" / "metrics.jsonl").is_file()


def test_a_rewind_drops_the_logged_steps_it_trains_again(tmp_path):
    from dppo_harness.instrument.cookbook_metrics import drop_logged_steps

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (0, 1, 2)))
    assert drop_logged_steps(log, 1) == 2
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [0]
    assert drop_logged_steps(log, 1) == 0 and drop_logged_steps(tmp_path / "absent.jsonl", 0) == 0
    log.write_text('{"step": 0}\n{"reward": 1}\n')
    with pytest.raises(ValueError, match="line 2 is not an ml_log record with a step"):
        drop_logged_steps(log, 0)
    assert log.read_text() == '{"step": 0}\n{"reward": 1}\n'  # refused: nothing rewritten
