"""Stage `preflight`: the restoration preflight on the session's backend (thin: asserts on the
library's measured result; `restoration` runs once and later stages reuse its clients)."""

from __future__ import annotations

from dppo_harness.stages import restoration as restoration_module
from dppo_harness.stages import write
from dppo_harness.stages.restoration import DEFAULT_LR_MULTIPLIERS
from dppo_harness.train.fingerprints import batch_sha256
from dppo_harness.train.optimizer_checks import own_response_only


def test_restoration_preflight_passes(restoration):
    assert restoration.passed, restoration.failure_message()


def test_both_arms_loaded_the_one_initial_checkpoint(restoration, plan):
    arms = [a.name for a in restoration_module.restoration_arms(plan.spec_plan.experiment)]
    if plan.kind == "bounded_diagnostic":  # only the arm that trains gets a client
        arms = [plan.diagnostic.fixed_settings.treatment.arm]
    assert sorted(restoration.clients) == sorted(arms)
    assert {a: r.loaded_path for a, r in restoration.loaded.items()} == dict.fromkeys(
        arms, restoration.initial_checkpoint
    )
    entries = restoration.provenance["arms"]
    for a in arms:
        init = entries[a]["initialization"]
        assert init["checkpoint_uri"] == init["loaded_checkpoint_uri"] == restoration.initial_checkpoint
        assert init["load_succeeded"] and init["checkpoint_immutable"]


def test_initial_outputs_match_before_any_update(restoration):
    cmp = restoration.provenance["group"]["initial_output_comparison"]
    assert cmp and all(c["within_tolerance"] for c in cmp.values()), cmp
    assert restoration.batch_sha256 == batch_sha256(restoration.fixed_batch)
    assert all(
        e["initial_output"]["batch_sha256"] == restoration.batch_sha256 for e in restoration.provenance["arms"].values()
    )


def test_restored_probe_update_matches_uninterrupted(restoration):
    probe = restoration.probe.to_json()
    assert probe["restored_vs_uninterrupted"]["within_tolerance"], probe["restored_vs_uninterrupted"]
    assert not probe["second_update_effect"]["within_tolerance"], "the probe update must move logprobs"


def test_optimizer_checks_cover_creation_and_every_restore(restoration):
    for arm, e in restoration.provenance["arms"].items():
        assert [c["after_restore"] for c in e["optimizer_checks"]] == list(range(e["restore_count"] + 1))
        for c in e["optimizer_checks"]:
            assert c["matches"], (arm, c["mismatches"])
            if c["actual_config"] is None:  # nothing exposed it: must stay unverified
                # a service may expose the family (get_info) but no config echo: a Spindle-like one
                assert c["actual_config_source"] == "declared" and not c["verified"]


def test_lr_scaling_measured_where_the_backend_can(restoration, service_backend):
    lr = restoration.lr_scaling.to_json()
    if service_backend.kind == "local":
        assert lr["available"] and lr["passed"], lr
        assert len(lr["lr_scaling"]) >= 2 and all(p["update_norm"] > 0 for p in lr["lr_scaling"])
    else:  # read back through save_weights_external where the service allows it, else the exact reason
        assert (lr["available"] and lr["lr_scaling"]) or lr["reason"]


def test_provenance_is_in_the_evidence(restoration, evidence_bundle, plan):
    written = evidence_bundle.result["initialization_provenance"]
    assert written["version"] == 1
    posted = {a: e for a, e in restoration.provenance["arms"].items() if a not in written.get("excluded_arms", {})}
    if plan.kind == "bounded_diagnostic":  # posted checks keep only the arm's own responses
        posted = {
            a: dict(e, optimizer_checks=[own_response_only(c) for c in e["optimizer_checks"]])
            for a, e in posted.items()
        }
    assert written["arms"] == posted
    if plan.kind == "bounded_diagnostic":  # the untrained baseline is left out
        trained = plan.diagnostic.fixed_settings.treatment.arm
        assert set(written["arms"]) == {trained}
        assert set(written["excluded_arms"]) == {a.name for a in plan.spec_plan.run.arms} - {trained}
    names = {f["name"] for f in evidence_bundle.files()}
    assert {
        write.PROVENANCE_FILE,
        write.FIXED_BATCH_FILE,
        write.INITIAL_OUTPUT_FILE,
        write.RESPONSES_FILE,
    } <= names


def test_setup_and_probe_clients_live_in_their_own_closed_session(restoration, client_registry):
    """Created only what the launch needs: the arms that train (on the session's ServiceClient) and
    the setup/probe clients on their own session, closed when the preflight ended."""
    sessions = {r["stage"]: r for r in client_registry.records()}
    probes = sessions["preflight-probes"]
    assert probes["released"] and probes["released_at"]
    roles = [c["role"] or "" for c in probes["training_clients"]]
    assert roles[0].startswith("setup (shared") and "uninterrupted restore probe" in roles[0]
    # two more (a fresh uninterrupted and a restored client) per other optimizer config the arms train with
    extra = 2 * len({r.mid_checkpoint for r in restoration.probe.own_config_probes.values()})
    assert sum(r.startswith("restore probe") for r in roles) == 1 + extra
    assert len(roles) <= 2 + len(DEFAULT_LR_MULTIPLIERS) - 1 + extra  # one client per LR other than the planned one
    arms = [c for c in sessions["session"]["training_clients"] if (c["role"] or "").startswith("arm ")]
    assert sorted(c["role"].split()[1].rstrip(":") for c in arms) == sorted(restoration.clients)
