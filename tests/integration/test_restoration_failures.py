"""Restoration preflight against its own embedded server: a clean run passes, and initial states
that must not pass do not (a different seed for one arm; a restore that drops Adam state). It
creates only the training clients its proofs need, and the diagnostic trains the arm client it
loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from sdk_session import end_session

from dppo_harness import constants, project
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.plans import load_plan
from dppo_harness.stages import restoration
from dppo_harness.stages.restoration import build_fixed_batch
from dppo_harness.stages.write import write_restoration
from dppo_harness.train.clients import full_logprobs
from dppo_harness.train.fingerprints import logprobs_sha256
from dppo_harness.train.restore import Restore

pytestmark = pytest.mark.timeout(900)
DIAG = load_plan(Path(__file__).parents[1] / "fixtures" / "plans" / "diagnostic-ci-tiny.json")  # trains dppo_seed0


@pytest.fixture(scope="module")
def server(shared_random_server):
    # The untrained preset: restoration checks do not need a warm-started model.
    return shared_random_server


@pytest.fixture(scope="module")
def spec():
    return load_plan(project.plan_file(project.SPEC_PLAN))


@pytest.fixture(scope="module")
def fixed_batch():
    return build_fixed_batch()


def _client(server):
    return tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)


def _run(server, spec, fixed_batch, tmp_path, sc=None, **kw):
    own = sc is None
    sc = sc or _client(server)
    bundle = EvidenceBundle.create(tmp_path / "evidence")
    batch, desc = fixed_batch
    try:
        result = restoration.run_restoration_preflight(
            sc,
            spec,
            bundle,
            fixed_batch=batch,
            fixed_batch_description=desc,
            local_run_dir=server.run_dir,
            **kw,
        )
        write_restoration(bundle, result)
    finally:
        if own:
            end_session(sc)
    return result, bundle


def test_matched_initial_state_passes(server, spec, fixed_batch, tmp_path):
    sc, probe_sc = _client(server), _client(server)
    try:
        before = _models(server)
        lines: list[str] = []
        result, bundle = _run(
            server, spec, fixed_batch, tmp_path, sc=sc, probe_service_client=probe_sc, progress=lines.append
        )
        end_session(probe_sc)  # release setup + probe clients
        assert result.passed, result.failure_message()
        # 2 arms + setup (= uninterrupted probe, planned-LR probe) + restored probe + 2 other LRs (8 before)
        assert len(_models(server) - before) == 6
        # Never silent: every one of the six steps says so, with how far along it is.
        for k in range(1, 7):
            assert any(m.startswith(f"[preflight] restoration {k}/6: ") for m in lines), (k, lines)
        assert any("LR probe 3/3" in m for m in lines) and lines[-1].startswith("[preflight] restoration passed")
        assert result.lr_scaling.available and result.lr_scaling.passed
        hashes = {e["initialization"]["adapter_sha256"] for e in result.provenance["arms"].values()}
        e = result.provenance["arms"]["dppo_seed0"]  # the entry's shape, as the brief asks
        assert list(e) == ["initialization", "restore_count", "optimizer_checks", "initial_output"]
        init = e["initialization"]
        assert init["checkpoint_scope"] == "full_initialization" and init["source"] == "server_response"
        assert init["before_first_update"] is True and e["initial_output"]["before_first_update"] is True
        assert len(hashes) == 1 and None not in hashes
        assert verify_bundle(bundle.dir) == []
        # The arms were never updated by the probes: their outputs still hash as at step 0.
        for arm, client in result.clients.items():
            assert logprobs_sha256(full_logprobs(client, result.fixed_batch)) == result.output_sha256[arm]
    finally:
        end_session(sc)


def test_an_arm_loaded_from_another_initial_state_fails(server, spec, fixed_batch, tmp_path, monkeypatch):
    real = restoration.restore

    def other_init_for_dppo(sc, path, name):  # the DPPO arm loads a second fresh client's save instead
        if name == "dppo_seed0":
            other = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32)
            path = other.save_state("other-initial").result().path
        return real(sc, path, name)

    monkeypatch.setattr(restoration, "restore", other_init_for_dppo)
    result, bundle = _run(server, spec, fixed_batch, tmp_path)
    assert not result.passed
    text = "\n".join(result.failures)
    assert "do not share one loaded checkpoint" in text
    assert "adapter_sha256 differ" in text
    # LoRA B starts at zero, so outputs agree: matching logprobs alone do not prove matched init.
    cmp = result.provenance["group"]["initial_output_comparison"]
    assert all(c["within_tolerance"] for c in cmp.values())
    # The failed proof is still written, whole and verifiable.
    init = bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]["initialization"]
    assert init["loaded_checkpoint_uri"] != result.initial_checkpoint
    assert verify_bundle(bundle.dir) == []


def test_restore_without_optimizer_state_fails_the_probe(server, spec, fixed_batch, tmp_path, monkeypatch):
    real = restoration.restore

    def weights_only_probe(sc, path, name):  # the probe's restore drops the Adam moments
        if not name.startswith("restore probe"):
            return real(sc, path, name)
        client = sc.create_training_client_from_state(path)
        return Restore(name, client, path, tinker.types.LoadWeightsResponse(path=path), client.get_info(), 0.0)

    monkeypatch.setattr(restoration, "restore", weights_only_probe)
    result, _ = _run(server, spec, fixed_batch, tmp_path, lr_multipliers=(1.0, 2.0))
    assert not result.passed
    assert any("restored probe update differs from uninterrupted" in f for f in result.failures), result.failures


def _models(server) -> set[str]:
    return set(server.stats()["models"])


def test_a_single_trained_arm_gets_only_the_clients_its_proofs_need(server, fixed_batch, tmp_path):
    """Under the diagnostic plan only the DPPO arm trains: no client for the untrained baseline;
    the setup client is the uninterrupted probe and the planned-LR probe; one restored probe and
    one client per other LR. 5 training clients (8 before: 2 arms, a separate uninterrupted probe,
    one client per LR), and every proof still runs and passes."""
    before = _models(server)
    result, bundle = _run(server, DIAG, fixed_batch, tmp_path)
    created = _models(server) - before
    assert result.passed, result.failure_message()
    assert len(created) == 5, sorted(created)
    assert sorted(result.clients) == ["dppo_seed0"] and set(result.loaded) == {"dppo_seed0"}
    written = bundle.result["initialization_provenance"]
    assert set(written["arms"]) == {"dppo_seed0"} and "grpo_seed0" in written["excluded_arms"]
    # One loaded arm: its initial output is compared with the setup client's, before any update.
    (cmp,) = result.provenance["group"]["initial_output_comparison"].items()
    assert cmp[0] == f"dppo_seed0_vs_{restoration.SOURCE_OUTPUT_KEY}" and cmp[1]["within_tolerance"]
    assert result.probe.restored_vs_uninterrupted["within_tolerance"]
    assert result.probe.base_lr_update_norm > 0
    lr = result.lr_scaling.to_json()
    assert lr["available"] and lr["passed"] and len(lr["lr_scaling"]) == 3
    base = next(p for p in lr["lr_scaling"] if p["learning_rate"] == 2e-5)
    assert base["update_norm"] == result.probe.base_lr_update_norm  # the probe's update 1, not a new client
    assert verify_bundle(bundle.dir) == []


def test_the_diagnostic_trains_the_preflights_loaded_client(server, fixed_batch, tmp_path):
    """No third DPPO client: the bounded diagnostic trains the arm's client the preflight loaded
    (its observed load is the run's restore, restore_count stays 1)."""
    from dppo_harness.stages.diagnostic.loop import run_bounded_diagnostic

    sc = _client(server)
    try:
        result, bundle = _run(server, DIAG, fixed_batch, tmp_path, sc=sc, lr_multipliers=(1.0, 2.0))
        assert result.passed, result.failure_message()
        before = _models(server)
        res = run_bounded_diagnostic(
            sc,
            DIAG,
            bundle,
            result.initial_checkpoint,
            backend="local",
            init_reference=result,
            restored=result.loaded["dppo_seed0"],
        )
        assert not res.state.errors, res.state.errors
        assert _models(server) == before  # no training client created by the diagnostic
        assert res.state.updates_done == 2
        entry = bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]
        assert entry["restore_count"] == 1
        assert [c["after_restore"] for c in entry["optimizer_checks"]] == [0, 1]
        assert entry["initial_output"]["bitwise_equal_to_group"] == {"dppo_seed0": True}
        assert entry["initialization"]["loaded_checkpoint_uri"] == result.initial_checkpoint
    finally:
        end_session(sc)
