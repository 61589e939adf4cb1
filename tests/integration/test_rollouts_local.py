"""Rollouts on the embedded server through the stock SDK: datum alignment, frozen batch, concurrency."""

import time

import numpy as np
import pytest
import tinker
from sdk_session import end_session
from server_in_process import InProcessServer
from tinker_cookbook.rl import data_processing

from dppo_harness import constants
from dppo_harness.data import gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.local_server.cli import build_parser, fault_config
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import FrozenBatch

# Small random-init model: these tests check plumbing and timing, not learning signal.
MODEL = "tiny-qwen3-random"
LATENCY_MS = 200


@pytest.fixture(scope="module")
def renderer():
    return make_renderer().renderer


@pytest.fixture(scope="module")
def train_items():
    return gsm8k.load_split("train", 0).batch(0, 32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module, in this process (the added latency is an asyncio sleep, which
    holds no core), adding LATENCY_MS to every sample request."""
    faults = fault_config(build_parser(None).parse_args(["--fault-latency-ms", f"asample:{LATENCY_MS}"]))
    with InProcessServer(Engine(tmp_path_factory.mktemp("srv"), model_name=MODEL), faults=faults) as srv:
        yield srv
        for sc in _OPENED:  # before the server stops: no SDK heartbeat outlives it
            end_session(sc)
        _OPENED.clear()


def _injected_latencies(srv: InProcessServer) -> int:
    assert srv.state is not None
    return srv.state.faults.snapshot()["injected"].get("asample:latency", 0)


_OPENED: list[tinker.ServiceClient] = []


def _clients(srv):
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    _OPENED.append(sc)
    tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=8, seed=0)
    path = tc.save_weights_for_sampler("s0").result().path
    return sc, tc, path, sc.create_sampling_client(model_path=path)


def test_rollout_batch_datums_align_with_trainer_logprobs(server, renderer, train_items):
    _, tc, path, sampler = _clients(server)
    cfg = rollouts.RolloutConfig(groups_per_batch=8, group_size=4, temperature=1.0, max_tokens=16, seed=5)
    rb = rollouts.sample_batch(sampler, train_items[:8], renderer, cfg, sampler_checkpoint=path)
    assert rb.sampler_checkpoint == path and path.startswith("tinker://") and rb.base_model == constants.BASE_MODEL
    assert len(rb.groups) == 8 and all(len(g.responses) == 4 for g in rb.groups)
    assert all(0 < len(r) <= 16 for g in rb.groups for r in g.responses)
    advantages = data_processing.compute_advantages(rollouts.to_trajectory_groups(rb))
    for grp in rb.groups:
        adv = advantages[grp.group_id]
        np.testing.assert_allclose(adv, np.array(grp.rewards_G) - np.mean(grp.rewards_G), atol=1e-6)

    fb = rollouts.freeze(rb, sampler_version="step-0")
    fb.assert_intact()
    datums = fb.to_datums()
    # The trainer (same weights as the sampler, both float32) must reproduce the sampler's
    # logprob at every loss position: an off-by-one datum would not.
    fwd = [
        tinker.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": np.zeros(d.model_input.length, np.float32),
            },
        )
        for d in datums
    ]
    out = tc.forward(fwd, "cross_entropy").result()
    worst = 0.0
    for i, d in enumerate(datums):
        mask = d.loss_fn_inputs["mask"].to_numpy() > 0
        assert mask.sum() == len(rb.groups[i // 4].responses[i % 4])
        trainer_lp = out.loss_fn_outputs[i]["logprobs"].to_numpy()[mask]
        worst = max(worst, float(np.abs(trainer_lp - d.loss_fn_inputs["logprobs"].to_numpy()[mask]).max()))
    assert worst < 1e-4, worst
    # shifting the targets by one breaks the agreement: the check above can fail
    shifted = datums[0].loss_fn_inputs["logprobs"].to_numpy()
    m0 = datums[0].loss_fn_inputs["mask"].to_numpy() > 0
    lp0 = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(np.roll(lp0, 1)[m0] - shifted[m0]).max() > 1e-3
    # the frozen batch round-trips through its bytes and splits into complete groups
    npz, manifest = fb.to_bytes()
    again = FrozenBatch.from_bytes(npz, manifest)
    assert again.sha256 == fb.sha256 and again.metadata["sampler_checkpoint"] == path
    assert [mb.group_ids for mb in again.split_minibatches(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def _sequential(sampler, renderer, items, cfg):
    """Control: the same requests, each awaited before the next is sent."""
    t0 = time.perf_counter()
    for g, item in enumerate(items):
        ob, stop = gsm8k.build_prompt(item, renderer)
        sampler.sample(ob, cfg.group_size, rollouts.sampling_params(cfg, stop, g)).result()
    return time.perf_counter() - t0


def test_batch_requests_are_in_flight_together(server, renderer, train_items, capsys):
    """With 200 ms added to every sample request, a 32-group batch pays the latency about once."""
    L = LATENCY_MS / 1000
    before = _injected_latencies(server)
    _, _, path, sampler = _clients(server)
    one = rollouts.RolloutConfig(groups_per_batch=1, group_size=8, temperature=1.0, max_tokens=4, seed=1)
    full = rollouts.RolloutConfig(groups_per_batch=32, group_size=8, temperature=1.0, max_tokens=4, seed=1)
    rollouts.sample_batch(sampler, train_items[:1], renderer, one, sampler_checkpoint=path)  # warm the sampler
    t_one = min(
        rollouts.sample_batch(sampler, train_items[:1], renderer, one, sampler_checkpoint=path).sampling_seconds
        for _ in range(2)
    )
    t_batch = min(
        rollouts.sample_batch(sampler, train_items, renderer, full, sampler_checkpoint=path).sampling_seconds
        for _ in range(2)
    )
    t_seq = _sequential(sampler, renderer, train_items, full)
    injected = _injected_latencies(server) - before
    with capsys.disabled():
        print(
            f"\n[concurrency] one request {t_one:.3f}s, 32-group batch {t_batch:.3f}s "
            f"(ratio {t_batch / t_one:.2f}), sequential control {t_seq:.3f}s, latency {L:.3f}s/request"
        )
    assert injected == 1 + 2 + 64 + 32  # every sample request really carried the latency
    assert t_one >= L
    assert t_seq >= 32 * L  # the control pays the latency 32 times
    # Concurrent submission must save most of the 31 extra latencies the control pays.
    # (Compute is the same work in both; on a loaded 2-core box it dominates wall time.)
    assert t_seq - t_batch >= 16 * L, (t_one, t_batch, t_seq)
