"""Restoration with arms whose optimizer configs differ: each arm's optimizer checks compare with
the echo of a probe that ran that arm's OWN config (a probe of the first arm's config alone would
report the other arm's planned config as a server mismatch)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import tinker
from sdk_session import end_session

from dppo_harness import constants, project
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.plans import parse_plan
from dppo_harness.stages import restoration
from dppo_harness.stages.restoration import build_fixed_batch

pytestmark = pytest.mark.timeout(900)


def test_each_arm_is_checked_against_a_probe_of_its_own_optimizer_config(shared_random_server, tmp_path):
    server = shared_random_server
    raw = json.loads(project.plan_file(project.SPEC_PLAN).read_text())
    other = copy.deepcopy(raw)
    other["restoration_preflight"]["groups"][0]["arms"][1]["optimizer_config"]["beta2"] = 0.99  # dppo_seed0
    # The variant needs the spec's resolution beside it (the values the spec format has no field for).
    spec_path = project.plan_file(project.SPEC_PLAN)
    shutil.copy(spec_path.with_name(spec_path.name + ".resolution.json"), tmp_path / "variant.json.resolution.json")
    plan = parse_plan(json.dumps(other).encode(), tmp_path / "variant.json", repo_root=project.project_root())
    batch, desc = build_fixed_batch()
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)
    try:
        result = restoration.run_restoration_preflight(
            sc,
            plan,
            EvidenceBundle.create(tmp_path / "evidence"),
            fixed_batch=batch,
            fixed_batch_description=desc,
            local_run_dir=server.run_dir,
        )
    finally:
        end_session(sc)
    assert result.passed, result.failure_message()
    assert set(result.probe.own_config_probes) == {"dppo_seed0"}
    assert result.probe.own_config_probes["dppo_seed0"].adam_params["beta2"] == 0.99
    assert result.probe.adam_params["beta2"] == 0.95
    for arm, beta2 in (("grpo_seed0", 0.95), ("dppo_seed0", 0.99)):
        checks = _checks(result.provenance["arms"][arm])
        assert len(checks) == 2
        for check in checks:
            assert check["requested_config"]["beta2"] == beta2
            assert check["matches"] and not check["mismatches"], check
            assert check["actual_config"]["beta2"] == beta2  # echoed by a probe of the arm's own config
    assert all(
        "#dppo_seed0:probe_optim_step_1" in c["evidence_ref"] for c in _checks(result.provenance["arms"]["dppo_seed0"])
    )


def _checks(entry: dict) -> list[dict]:
    return entry.get("optimizer_checks") or entry["initialization"]["optimizer_checks"]
