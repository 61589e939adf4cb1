"""Restoration preflight against its own embedded server: a clean run passes, and initial states
that must not pass do not (a different seed for one arm; a restore that drops Adam state)."""

from __future__ import annotations

import pytest
import tinker

from dppo_harness import constants, project
from dppo_harness import restoration as R
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.plans import load_plan

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(shared_random_server):
    # The untrained preset: restoration checks do not need a warm-started model.
    return shared_random_server


@pytest.fixture(scope="module")
def spec():
    return load_plan(project.plan_file(project.SPEC_PLAN))


@pytest.fixture(scope="module")
def fixed_batch():
    return R.build_fixed_batch()


def _client(server):
    return tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)


def _run(server, spec, fixed_batch, tmp_path, sc=None, **kw):
    own = sc is None
    sc = sc or _client(server)
    bundle = EvidenceBundle.create(tmp_path / "evidence")
    batch, desc = fixed_batch
    try:
        result = R.run_restoration_preflight(
            sc, spec, bundle, fixed_batch=batch, fixed_batch_description=desc,
            checkpoint_reader=R.LocalCheckpointReader(server.run_dir), **kw)
    finally:
        if own:
            sc.close("success").result(timeout=60)
    return result, bundle


def test_matched_initial_state_passes(server, spec, fixed_batch, tmp_path):
    sc, probe_sc = _client(server), _client(server)
    try:
        lines: list[str] = []
        result, bundle = _run(server, spec, fixed_batch, tmp_path, sc=sc, probe_service_client=probe_sc,
                              progress=lines.append)
        probe_sc.close("success").result(timeout=60)  # release setup + probe clients
        assert result.passed, result.failure_message()
        # Never silent: every one of the six steps says so, with how far along it is.
        for k in range(1, 7):
            assert any(m.startswith(f"[preflight] restoration {k}/6: ") for m in lines), (k, lines)
        assert any("LR probe 3/3" in m for m in lines) and lines[-1].startswith("[preflight] restoration passed")
        assert result.lr_scaling["available"] and result.lr_scaling["passed"]
        hashes = {e["initialization"]["adapter_sha256"] for e in result.provenance["arms"].values()}
        assert len(hashes) == 1 and None not in hashes
        assert verify_bundle(bundle.dir) == []
        # The arms were never updated by the probes: their outputs still hash as at step 0.
        for arm, client in result.clients.items():
            assert R.logprobs_sha256(R.full_logprobs(client, result.fixed_batch)) == result.output_sha256[arm]
    finally:
        sc.close("success").result(timeout=60)


def test_different_seed_for_one_arm_fails(server, spec, fixed_batch, tmp_path):
    result, bundle = _run(server, spec, fixed_batch, tmp_path, arm_seed_overrides={"dppo_seed0": 1})
    assert not result.passed
    text = "\n".join(result.failures)
    assert "do not share one initial checkpoint" in text
    assert "adapter_sha256 differ" in text
    # LoRA B starts at zero, so outputs agree: matching logprobs alone do not prove matched init.
    cmp = result.provenance["group"]["initial_output_comparison"]
    assert all(c["within_tolerance"] for c in cmp.values())
    # The failed proof is still written, whole and verifiable.
    assert bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]["initialization"][
        "checkpoint_uri"] != result.initial_checkpoint
    assert verify_bundle(bundle.dir) == []


def test_restore_without_optimizer_state_fails_the_probe(server, spec, fixed_batch, tmp_path):
    result, _ = _run(server, spec, fixed_batch, tmp_path, probe_restore_with_optimizer=False,
                     lr_multipliers=(1.0, 2.0))
    assert not result.passed
    assert any("restored probe update differs from uninterrupted" in f for f in result.failures), result.failures
