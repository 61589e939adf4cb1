"""The harness's `tinker` branch in CI: the embedded server with `--profile spindle` in the test
process (the harness runs as its own process against it), planted credentials, and the harness run
as a user runs it (`pytest -m diagnostic`).

- the main run: unit parity (the loss-parity file) -> preflight -> a shortened diagnostic (test plan: 4 groups x 4,
  2 minibatches x 2 epochs) through a capacity storm shorter than the backoff window;
- the README's recipe "The harness against a server you started", step 2, as written: the same plan
  on the default profile's server (a separate process on a free port), the `tinker` backend,
  exactly the README's variables (no Modal ones) and its command line, plus the CI plan, an
  evidence dir outside the repository given with a space as a user types it, and the test paths
  (unit parity is the loss-parity file); its frozen batch and pooled statistics must agree with
  the main run's;
- a storm longer than the window ends in a correct capacity_block;
- bad credentials and a wrong URL: one line within 30 s, nothing left running.

The storms are the server's seeded refusals at model creation (Spindle's `engine refused work:
trainer capacity exhausted`), the refusal the harness's own backoff handles (an HTTP 429 is
retried inside the SDK first). The harness's backoff is shrunk with DPPO_HARNESS_CAPACITY_SCALE so that both cases take seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_pids import live_child_pids
from harness_paths import LOSS_PARITY
from run_env import harness_env
from server_in_process import ServerInProcess

from dppo_harness.evidence import REHEARSAL_PREFIX
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.service.secrets_scan import SECRET_ENV_VARS, SecretScanner
from dppo_harness.service.wait.watch import SUBMIT_REFUSED_REASON

ROOT = Path(__file__).resolve().parents[2]
# Planted, not real: the server checks them, the evidence must never contain them. Made fresh per
# run: a value written in this file would sit in the code archive, and the harness refuses it.
PLANTED = {
    "TINKER_API_KEY": "tml-planted-" + secrets.token_hex(8),
    "MODAL_PROXY_TOKEN_ID": "wk-planted-" + secrets.token_hex(8),
    "MODAL_PROXY_TOKEN_SECRET": "ws-planted-" + secrets.token_hex(8),
}
WRONG_SECRET = "ws-wrong-" + secrets.token_hex(8)
SHORT_STORM = 2  # refusals; backoff 0.6 s + 1.2 s at scale 0.01, inside the 6 s window
CAPACITY_SCALE = "0.01"  # backoff 0.6/1.2/2.4 s, give-up window 6 s before any comparison step
LONG_STORM_CAPACITY_SCALE = "0.005"  # half of it: the long storm sleeps through its whole window
# `-m diagnostic` on these paths: unit parity is the loss-parity file (harness_paths).
UNIT_PARITY_AND_STAGES = (LOSS_PARITY, "tests/preflight", "tests/diagnostic")
SAMPLER_LP_ATOL = 1e-4  # see test_same_plan_on_the_default_profile_computes_the_same
README_URL = "http://127.0.0.1:8123"
POOLED_ATOL = 1e-4


def _spindle(run_dir: Path, *fault_args: str) -> ServerInProcess:
    """Spindle in this process (tests/support/server_in_process.py): these tests run the harness as
    a user runs it against the service; none is about the server's own process."""
    return ServerInProcess(run_dir, "--profile", "spindle", *fault_args, credentials=PLANTED).start()


def _harness_env(base_url: str | None, **overrides: str | None) -> dict[str, str]:
    return harness_env(
        **{
            **PLANTED,
            "PYTHONPATH": str(ROOT / "src"),
            "DPPO_HARNESS_CAPACITY_SCALE": CAPACITY_SCALE,
            "TINKER_BASE_URL": base_url or None,
            **overrides,
        }
    )


def _harness(args: list[str], env: dict[str, str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def _bundle_dir(evidence_root: Path) -> Path:
    return evidence_root / (evidence_root / "LATEST").read_text().strip()


def _result(evidence_root: Path) -> dict:
    return json.loads((_bundle_dir(evidence_root) / "result.json").read_text())


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """The CI test plan beside a copy of the spec it derives from (so its original plan resolves)."""
    d = tmp_path_factory.mktemp("plans")
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json", d / "exp_e6b0965af3.json")
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json.resolution.json", d)
    shutil.copy(ROOT / "tests" / "fixtures" / "plans" / "diagnostic-ci-short.json", d / "diagnostic-ci-short.json")
    return d / "diagnostic-ci-short.json"


@pytest.fixture(scope="module")
def spindle(tmp_path_factory):
    """The Spindle-profile server of the main run, with a short capacity storm at model creation."""
    srv = _spindle(tmp_path_factory.mktemp("spindle"), "--fault-capacity-exhausted", str(SHORT_STORM))
    yield srv
    srv.stop()
    assert not srv.alive()


@pytest.fixture(scope="module")
def spindle_run(spindle, plan_file, tmp_path_factory):
    evidence = tmp_path_factory.mktemp("evidence-tinker")
    proc, secs = _harness(
        [
            "-m",
            "diagnostic",
            *UNIT_PARITY_AND_STAGES,
            "--backend=tinker",
            f"--plan={plan_file}",
            f"--evidence-dir={evidence}",
            "--timeout=900",
        ],
        _harness_env(spindle.base_url),
        timeout=1200,
    )
    return proc, secs, evidence


def test_spindle_run_passes_and_survives_the_short_storm(spindle_run, spindle):
    proc, secs, evidence = spindle_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    print(f"spindle-profile harness run: {secs:.0f} s")
    faults = spindle.stats()["faults"]
    assert "capacity" in json.dumps(faults), faults
    r = _result(evidence)
    assert r["status"] == "succeeded" and "capacity_block" not in r


def test_bundle_verifies(spindle_run):
    _, _, evidence = spindle_run
    v = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(_bundle_dir(evidence))],
        env=_harness_env(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert v.returncode == 0, v.stdout + v.stderr


def test_rehearsal_label_and_stand_in_everywhere(spindle_run):
    _, _, evidence = spindle_run
    r = _result(evidence)
    block = r["backend"]
    stand_in = block["embedded_server"]["stand_in"]
    assert stand_in and stand_in != "Qwen/Qwen3.5-2B"
    assert block["kind"] == "local" and block["requested_backend"] == "tinker" and block["served_model"] == stand_in
    assert block["embedded_server"]["profile"] == "spindle"
    assert r["summary"].startswith(REHEARSAL_PREFIX)
    assert any(d["field"] == "model" and stand_in in d["effective"] for d in r["deviations"])
    bundle = _bundle_dir(evidence)
    eff = json.loads((bundle / "files" / "effective-config.json").read_text())
    assert eff["backend"]["served_model"] == stand_in
    assert stand_in in (bundle / "files" / "report.md").read_text()
    clients = sorted((bundle / "files").glob("client-identity-*.json"))
    assert clients, "no training client's identity was recorded"
    for f in clients:
        rec = json.loads(f.read_text())
        assert rec["served_model"] == stand_in == rec["get_info"]["model_data"]["model_name"]
        # get_info as Spindle sends it, naming the model that computes; the marker is in the capabilities
        assert rec["get_info"]["parameterization"] == {"type": "lora"} and "optimizer_config" not in rec["get_info"]
        assert rec["get_server_capabilities"]["embedded_server"] == {
            "marker": "dppo-harness",
            "stand_in": stand_in,
            "profile": "spindle",
        }
    index = json.loads((bundle / "files" / "client-identities.json").read_text())["clients"]
    assert len(index) >= 3 and len({c["model_id"] for c in index}) == len(index)  # every training client
    assert all(c["served_model"] == stand_in for c in index)


def test_planted_values_in_no_evidence_file(spindle_run):
    _, _, evidence = spindle_run
    scanner = SecretScanner(PLANTED.items())
    files = [p for p in _bundle_dir(evidence).rglob("*") if p.is_file()]
    assert len(files) > 10
    leaks = {str(p): scanner.find(p.read_bytes()) for p in files}
    assert not {k: v for k, v in leaks.items() if v}


def _user_env() -> dict[str, str]:
    """This environment without any service variable, with this interpreter's bin first on PATH
    (the README's `python` and `pytest` are the installed ones)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS and k != "TINKER_BASE_URL"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def readme_run(readme, plan_file, tmp_path_factory):
    """The README's recipe, step 2, as written, against the default profile's server on a free port."""
    cmd = readme("The harness against a server you started", "TINKER_BASE_URL=")
    assert README_URL in cmd and "MODAL_PROXY" not in cmd and "--backend tinker" in cmd, cmd
    before = live_child_pids()
    evidence = tmp_path_factory.mktemp("runs")
    paths = " ".join(UNIT_PARITY_AND_STAGES)
    with LocalServerProcess(run_dir=tmp_path_factory.mktemp("readme-server")) as srv:
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                "bash",
                "-c",
                cmd.replace(README_URL, srv.base_url)
                + f" {paths} --plan={plan_file} --evidence-dir {evidence} -p no:cacheprovider -q",
            ],
            cwd=ROOT,
            env=_user_env(),
            capture_output=True,
            text=True,
            timeout=1500,
        )
        secs = time.monotonic() - t0
    return proc, secs, evidence, before


def test_separate_server_recipe_step_2_runs_as_written(readme_run):
    proc, secs, evidence, before = readme_run
    print(f"README recipe (diagnostic, CI plan): {secs:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = _bundle_dir(evidence)
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "succeeded" and result["backend"]["requested_backend"] == "tinker", result["backend"]
    conn = json.loads((run / "files" / "connectivity-preflight.json").read_text())
    variables = next(c for c in conn["checks"] if c["check"] == "variables")
    assert "proxy headers: none" in variables["detail"], variables
    verify = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(run)], capture_output=True, text=True, timeout=300
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert live_child_pids() <= before


def test_same_plan_on_the_default_profile_computes_the_same(spindle_run, readme_run):
    """Same plan and seed on the default profile's server (the README recipe's run above).

    Bitwise: every frozen-batch tensor except the sampler logprobs (tokens, advantages, masks,
    rewards, ids, lengths). Not bitwise across server processes: the sampler logprobs. The embedded
    sampler batches the requests that arrive within a short window and left-pads them to one
    length, so which groups share a forward pass depends on arrival timing and changes float
    summation order. In 1 of 3 runs here only the sampler logprobs differed (every other field,
    tokens included, matched; that run's magnitude was not kept); the other runs matched bitwise.
    So sampler logprobs are compared at SAMPLER_LP_ATOL and the pooled second-epoch statistics
    (which use them as p_old) at POOLED_ATOL, counts exactly; each run prints the measured max.
    """
    import io

    import numpy as np

    _, _, evidence = spindle_run
    proc, _, other_ev, _ = readme_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = [_bundle_dir(e) / "files" for e in (evidence, other_ev)]
    # The overall frozen-batch sha256 also covers run metadata (time, checkpoint URIs): compare fields.
    fa, fb = (json.loads((f / "diagnostic-frozen-batch.manifest.json").read_text())["fields"] for f in files)
    assert set(fa) == set(fb)
    assert {k: v for k, v in fa.items() if k != "sampler_logprobs_N"} == {
        k: v for k, v in fb.items() if k != "sampler_logprobs_N"
    }
    za, zb = (np.load(io.BytesIO((f / "diagnostic-frozen-batch.npz").read_bytes())) for f in files)
    lp_diff = float(np.max(np.abs(za["sampler_logprobs_N"].astype(np.float64) - zb["sampler_logprobs_N"])))
    print(
        f"frozen batch: sampler logprobs max |diff| {lp_diff:.3g} (bitwise: {fa['sampler_logprobs_N'] == fb['sampler_logprobs_N']})"
    )
    assert lp_diff <= SAMPLER_LP_ATOL
    pa, pb = (json.loads((f / "diagnostic-analysis.json").read_text())["pooled_second_epoch"] for f in files)
    assert set(pa) == set(pb)
    worst = 0.0
    for k, va in pa.items():
        vb = pb[k]
        if isinstance(va, bool) or not isinstance(va, (int, float)):
            assert va == vb, k
        elif isinstance(va, int) and isinstance(vb, int):
            assert va == vb, k  # token counts, removed/clipped/exceedance counts
        else:
            worst = max(worst, abs(va - vb))
            assert vb == pytest.approx(va, abs=POOLED_ATOL), k
    print(f"pooled second-epoch statistics: max |diff| {worst:.3g}")


def test_long_storm_ends_in_a_correct_capacity_block(plan_file, tmp_path):
    srv = _spindle(tmp_path / "storm", "--fault-capacity-exhausted", "100000")
    try:
        evidence = tmp_path / "evidence-storm"
        proc, _secs = _harness(
            ["tests/preflight", "--backend=tinker", f"--plan={plan_file}", f"--evidence-dir={evidence}"],
            # backoff 0.3/0.6/1.2 s, give-up window 3 s: the storm outlasts it all the same
            _harness_env(srv.base_url, DPPO_HARNESS_CAPACITY_SCALE=LONG_STORM_CAPACITY_SCALE),
            timeout=300,
        )
        assert proc.returncode != 0
        r = _result(evidence)
        assert r["status"] == "failed" and r["verdict"] == "inconclusive"
        assert r["outcome_reason"] == "incomplete_execution"
        cb = r["capacity_block"]
        assert cb["error"].startswith("engine refused work: trainer capacity exhausted"), cb
        assert cb["comparison_steps_completed"] == 0 and cb["released_clients"] is True
        assert srv.stats()["sessions"] >= 1  # it did reach the service
    finally:
        srv.stop()
    assert not srv.alive()


@pytest.mark.parametrize("case", ["missing_key", "wrong_modal_secret", "wrong_url"])
def test_bad_credentials_one_line_within_30s(case, spindle, tmp_path):
    before = live_child_pids()
    sessions_before = spindle.stats()["sessions"]
    url = spindle.base_url
    overrides: dict[str, str | None] = {}
    if case == "missing_key":
        overrides["TINKER_API_KEY"] = None
        expect = "environment variable TINKER_API_KEY is not set"
    elif case == "wrong_modal_secret":
        overrides["MODAL_PROXY_TOKEN_SECRET"] = WRONG_SECRET
        expect = "check MODAL_PROXY_TOKEN_ID/SECRET"
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
        expect = f"cannot connect to TINKER_BASE_URL {url}"
    proc, secs = _harness(
        ["tests/preflight/test_connectivity.py", "--backend=tinker", f"--evidence-dir={tmp_path / 'ev'}"],
        _harness_env(url, **overrides),
        timeout=60,
    )
    assert secs < 30, f"{case}: {secs:.1f} s"
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [ln for ln in out.splitlines() if ln.startswith("connectivity preflight (")]
    assert lines and all(expect in ln for ln in lines), out[-3000:]
    assert "During handling" not in out and "Traceback" not in out, out[-3000:]  # the line, no traceback
    for v in PLANTED.values():
        assert v not in out
    assert WRONG_SECRET not in out
    assert live_child_pids() <= before  # nothing left running
    assert spindle.stats()["sessions"] == sessions_before  # no session was opened on the service


def test_missing_modal_headers_one_line_naming_both_variables(spindle):
    """Modal headers are optional for the harness, not for Spindle: without the two variables the
    spindle profile answers 401 and the line names both (the spindle server keeps requiring them)."""
    from dppo_harness.service.connectivity import ConnectivityError, check_connectivity

    env = {"TINKER_BASE_URL": spindle.base_url, "TINKER_API_KEY": PLANTED["TINKER_API_KEY"]}
    with pytest.raises(ConnectivityError) as e:
        check_connectivity("tinker", None, "Qwen/Qwen3.5-2B", env=env, timeout_s=10)
    assert e.value.check == "auth" and "HTTP 401" in e.value.line, e.value.line
    assert "set MODAL_PROXY_TOKEN_ID and MODAL_PROXY_TOKEN_SECRET" in e.value.line
    assert PLANTED["TINKER_API_KEY"] not in e.value.line


# ---- the service's pauses, hangs and refusals, through the whole harness (service_wait) ---------


def _stopped_run(tmp_path: Path, fault_args: list[str], harness_args: list[str], timeout: float = 300):
    """A harness run against a spindle server with `fault_args`: (process, seconds, result, server stats)."""
    before = live_child_pids()
    srv = _spindle(tmp_path / "srv", *fault_args)
    try:
        evidence = tmp_path / "evidence"
        proc, secs = _harness(
            [*harness_args, "--backend=tinker", f"--evidence-dir={evidence}"],
            _harness_env(srv.base_url),
            timeout=timeout,
        )
        stats = srv.stats()
    finally:
        srv.stop()
    assert not srv.alive() and live_child_pids() <= before  # nothing left running
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "During handling" not in out, out[-3000:]
    for v in PLANTED.values():
        assert v not in out
    v = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(_bundle_dir(evidence))],
        env=_harness_env(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert v.returncode == 0 and "(status failed)" in v.stdout, v.stdout + v.stderr  # a stopped run's bundle verifies
    return proc, secs, _result(evidence), stats


def _assert_stopped(r: dict) -> None:
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert r["service_wait"]["released_clients"] is True


@pytest.mark.usefixtures("short_unload_drain")
def test_a_request_that_never_completes_stops_the_stage_after_the_service_timeout(plan_file, tmp_path):
    """The first save never completes (its polls say active): one line naming the call and the
    client after --service-timeout-s, reported as no answer, not as capacity."""
    proc, secs, r, stats = _stopped_run(
        tmp_path,
        ["--fault-queue-pause", "save_weights:1:forever:active"],
        ["tests/preflight", f"--plan={plan_file}", "--service-timeout-s=2"],
    )
    assert proc.returncode != 0 and secs < 150, secs
    _assert_stopped(r)
    assert "capacity_block" not in r and r["service_wait"]["pauses"] == []
    line = "save_state on setup client (shared): no answer for 2 s"
    assert r["service_wait"]["stopped"]["kind"] == "no_answer" and r["service_wait"]["stopped"]["line"].startswith(line)
    assert line in proc.stdout
    assert stats["faults"]["injected"] == {"save_weights:queue_pause": 1}


@pytest.mark.usefixtures("short_unload_drain")
def test_a_saturated_sample_submit_gives_up_after_the_patience(plan_file, tmp_path):
    """Every sample submit answered 429 `saturated` (Spindle's engine refusing work; the SDK
    resubmits without limit, silently) ends the diagnostic after --capacity-patience-s as a refused
    submit (tinker 0.25 keeps the 429's text to itself); the preflight before it passed."""
    proc, secs, r, stats = _stopped_run(
        tmp_path,
        ["--fault-reject-for", "asample:429:3600"],
        ["tests/preflight", "tests/diagnostic", f"--plan={plan_file}", "--capacity-patience-s=4"],
        timeout=600,
    )
    assert proc.returncode != 0 and secs < 400, proc.stdout[-3000:]
    assert "passed" in proc.stdout and "tests/preflight" not in proc.stdout.split("short test summary")[-1]
    _assert_stopped(r)
    refused = r["service_wait"]["pauses"][-1]
    assert (refused["call"], refused["queue_state"], refused.get("http_status")) == ("sample", "submit_refused", None)
    assert refused["queue_state_reason"] == SUBMIT_REFUSED_REASON and refused["outcome"] == "gave_up"
    block = {"error": SUBMIT_REFUSED_REASON, "comparison_steps_completed": 0, "released_clients": True}
    assert r["capacity_block"] == block
    assert stats["faults"]["injected"]["asample:429"] >= 3  # the SDK kept resubmitting
