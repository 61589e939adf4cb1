"""Evidence bundle: registry, limits, immutability, atomicity, secrets, result.json, verify CLI."""

import base64
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from dppo_harness import evidence as ev
from dppo_harness.evidence import (
    MAX_FILES,
    REHEARSAL_PREFIX,
    EvidenceBundle,
    EvidenceError,
    ImmutableNameError,
    LimitError,
    ResultShapeError,
    SecretLeakError,
    session,
    verify_bundle,
)
from dppo_harness.evidence.backend import Backend
from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.evidence.provenance import register_code
from dppo_harness.evidence.result import initial_result, validate_result
from dppo_harness.plans import load_plan

SRC = Path(ev.__file__).resolve().parents[2]  # src/ (evidence is a package)
PLANS = SRC.parent / "plans"
FAKE_KEY = "tml-FAKE-leak-canary-7f3a9c"
FAKE_MODAL = "ws-FAKE-modal-secret-b81e"


@pytest.fixture
def bundle(tmp_path):
    return EvidenceBundle.create(tmp_path / "evidence", "run1", env={})


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_create_layout_and_initial_result(tmp_path):
    b = EvidenceBundle.create(tmp_path, env={})
    assert (tmp_path / "LATEST").read_text().strip() == b.run_id
    r = json.loads((b.dir / "result.json").read_text())
    assert r["status"] == "running" and "verdict" not in r
    assert r["evidence"] == {"version": 1, "files": [], "checkpoints": [], "per_arm_metrics": {}}
    b2 = EvidenceBundle.create(tmp_path, "second", env={})
    assert (tmp_path / "LATEST").read_text().strip() == "second" and b2.dir.name == "second"
    with pytest.raises(EvidenceError, match="already exists"):
        EvidenceBundle.create(tmp_path, "second", env={})


def test_register_immutable_names(bundle):
    e = bundle.register_bytes("a.txt", "log", b"hello")
    assert e == {"name": "a.txt", "kind": "log", "sha256": sha256_bytes(b"hello"), "size": 5}
    assert bundle.register_bytes("a.txt", "log", b"hello") == e  # same bytes: idempotent
    with pytest.raises(ImmutableNameError, match="different bytes"):
        bundle.register_bytes("a.txt", "log", b"hellO")
    with pytest.raises(ImmutableNameError, match="different kind"):
        bundle.register_bytes("a.txt", "metrics", b"hello")
    assert bundle.file_path("a.txt").read_bytes() == b"hello"
    assert len(bundle.files()) == 1
    for bad in ("../x", "result.json", "a/b", "", ".hidden"):
        with pytest.raises(EvidenceError, match="file name"):
            bundle.register_bytes(bad, "log", b"x")
    with pytest.raises(EvidenceError, match="unknown kind"):
        bundle.register_bytes("b.txt", "weights", b"x")
    with pytest.raises(EvidenceError, match="NaN"):
        bundle.register_json("nan.json", "metrics", {"x": float("nan")})


def test_limits(bundle):
    mib = 1024 * 1024
    with pytest.raises(LimitError, match=r"10 MiB\) per file"):
        bundle.register_bytes("big.bin", "tensors", b"\0" * (10 * mib + 1))
    assert not bundle.file_path("big.bin").exists()
    for i in range(4):  # exactly 40 MiB is allowed
        bundle.register_bytes(f"chunk{i}.bin", "tensors", bytes([i]) * (10 * mib))
    with pytest.raises(LimitError, match=r"40 MiB\) in total"):
        bundle.register_bytes("one-more.bin", "tensors", b"x")
    assert len(bundle.files()) == 4


def test_file_count_limit(tmp_path):
    b = EvidenceBundle.create(tmp_path, "many", env={})
    for i in range(64):
        b.register_bytes(f"f{i}.txt", "log", str(i).encode())
    with pytest.raises(LimitError, match="64 files"):
        b.register_bytes("f64.txt", "log", b"64")
    assert verify_bundle(b.dir) == []


def test_a_full_bundle_still_gets_its_final_result(tmp_path):
    """All 64 slots used by the stages: the final result is written anyway, and the ledger says the
    budget-ledger file had no slot (it was the first casualty: result.json stayed 'running')."""
    b = EvidenceBundle.create(tmp_path, "full", env={})
    b.set_budget(600.0)  # a ledger with entries, to be registered at the close
    for i in range(MAX_FILES - len(b.files())):
        b.register_bytes(f"f{i}.txt", "log", str(i).encode())
    b.finish(
        "failed",
        "inconclusive",
        "incomplete_execution",
        "Stopped: the stage failed.",
        original_hypothesis_tested=False,
        tested_instead="nothing",
    )
    r = json.loads((b.dir / "result.json").read_text())
    assert r["status"] == "failed" and r["summary"] == "Stopped: the stage failed."
    assert "64 files" in b.ledger()["ledger_file_not_registered"] and b.entry("budget-ledger.json") is None
    assert verify_bundle(b.dir) == []


def test_atomic_write_failure_keeps_old_state(bundle, monkeypatch):
    bundle.update_result(metrics={"x": 1.0})
    before = (bundle.dir / "result.json").read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(ev.UnwritableEvidenceError, match="disk full"):
        bundle.register_bytes("late.txt", "log", b"data")
    with pytest.raises(ev.UnwritableEvidenceError):
        bundle.update_result(metrics={"y": 2.0})
    monkeypatch.undo()
    assert (bundle.dir / "result.json").read_bytes() == before
    assert not list(bundle.dir.rglob(".*tmp-*"))  # no temp files left behind
    assert bundle.entry("late.txt") is None and "y" not in bundle.result["metrics"]
    bundle.register_bytes("late.txt", "log", b"data")  # nothing lost: it still works afterwards
    assert verify_bundle(bundle.dir) == []


@pytest.mark.parametrize(
    "encode",
    [
        lambda s: b"token=" + s.encode(),
        lambda s: base64.b64encode(b"Authorization: " + s.encode() + b"\n"),  # embedded at an offset
        lambda s: base64.b64encode(b"x" + s.encode()),
        lambda s: base64.urlsafe_b64encode(b"ab" + s.encode()),
        lambda s: b"https://h/?k=" + quote(s + "/x", safe="").encode(),
        lambda s: json.dumps({"k": s}).encode(),
        lambda s: s.encode().hex().encode(),
    ],
)
def test_planted_secret_in_file_is_blocked(tmp_path, monkeypatch, encode):
    monkeypatch.setenv("TINKER_API_KEY", FAKE_KEY)
    b = EvidenceBundle.create(tmp_path, "leak")  # env=None: reads os.environ at every scan
    b.update_result(original_hypothesis_tested=False, tested_instead="leak test")
    with pytest.raises(SecretLeakError) as e:
        b.register_bytes("log.txt", "log", b"prefix " + encode(FAKE_KEY) + b" suffix")
    assert "TINKER_API_KEY" in str(e.value) and FAKE_KEY not in str(e.value)
    assert not b.file_path("log.txt").exists() and b.entry("log.txt") is None
    on_disk = (b.dir / "result.json").read_text()
    assert FAKE_KEY not in on_disk
    r = json.loads(on_disk)
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert "secret scanner" in r["summary"]


@pytest.mark.parametrize("where", ["sidecar", "state", "metrics", "server_log"])
def test_a_secret_beside_the_bundle_fails_verify(tmp_path, where):
    """The comparison's state and metrics logs, the run's sidecars and the embedded server's log lie
    beside the registered files: verify scans them like evidence."""
    env = {"TINKER_API_KEY": FAKE_KEY}
    b = EvidenceBundle.create(tmp_path, "beside", env=env)
    b.finish(
        "succeeded",
        "inconclusive",
        "incomplete_execution",
        "Stages run: unit.",
        original_hypothesis_tested=False,
        tested_instead="nothing",
    )
    state = tmp_path / "comparison-state" / b.dir.name
    clean = {
        "sidecar": b.dir / "notes.txt",
        "state": state / "comparison-state.json",
        "metrics": state / "cookbook-metrics" / "grpo_seed0" / "metrics.jsonl",
        "server_log": tmp_path / "local-server" / "server.log",
    }
    for path in clean.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("nothing secret\n")
    assert verify_bundle(b.dir, env=env) == []
    clean[where].write_text(f"headers: X-API-Key: {FAKE_KEY}\n")
    problems = verify_bundle(b.dir, env=env)
    assert len(problems) == 1 and "TINKER_API_KEY" in problems[0] and FAKE_KEY not in problems[0], problems
    assert str(clean[where].relative_to(tmp_path)) in problems[0]


def test_a_secret_beside_the_bundle_fails_the_run_at_its_close(tmp_path):
    env = {"TINKER_API_KEY": FAKE_KEY}
    b = EvidenceBundle.create(tmp_path, "beside-close", env=env)
    metrics = tmp_path / "comparison-state" / b.dir.name / "cookbook-metrics" / "dppo_seed0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"step": 1, "note": f"key={FAKE_KEY}"}) + "\n")
    b.finish(
        "succeeded",
        "inconclusive",
        "incomplete_execution",
        "Stages run: unit. All passed.",
        original_hypothesis_tested=False,
        tested_instead="nothing",
    )
    r = json.loads((b.dir / "result.json").read_text())
    assert r["status"] == "failed" and "secret scanner" in r["summary"] and "metrics.jsonl" in r["summary"]
    assert FAKE_KEY not in (b.dir / "result.json").read_text()


def test_planted_secret_in_result_json_is_blocked(tmp_path, monkeypatch):
    monkeypatch.setenv("MODAL_PROXY_TOKEN_SECRET", FAKE_MODAL)
    b = EvidenceBundle.create(tmp_path, "leak2")
    b.update_result(metrics={"kept": 1.0})
    before = (b.dir / "result.json").read_bytes()
    with pytest.raises(SecretLeakError, match="MODAL_PROXY_TOKEN_SECRET"):
        b.update_result(summary=f"headers were Modal-Secret: {FAKE_MODAL}")
    with pytest.raises(SecretLeakError):
        b.add_deviation("model", "a", base64.b64encode(FAKE_MODAL.encode()).decode(), "r")
    with pytest.raises(SecretLeakError):
        b.add_checkpoint("dppo", 1, f"tinker://{FAKE_MODAL}/weights/x")
    text = (b.dir / "result.json").read_text()
    assert FAKE_MODAL not in text and b.result["metrics"]["kept"] == 1.0
    assert json.loads(before)["status"] == "running"


def test_a_failure_is_sticky_whatever_closes_the_run_later(tmp_path, monkeypatch):
    """A scanner refusal swallowed by a wait post marks the run failed; the stage's later
    'succeeded' close must not merge over it (status, verdict, reason and summary stay)."""
    monkeypatch.setenv("MODAL_PROXY_TOKEN_SECRET", FAKE_MODAL)
    b = EvidenceBundle.create(tmp_path, "sticky")
    with pytest.raises(SecretLeakError):
        b.update_result(service_wait={"waiting": {"1": {"queue_state_reason": FAKE_MODAL}}})
    assert b.result["status"] == "failed"
    b.finish(
        "succeeded",
        "supported",
        "supported",
        "The comparison supports the hypothesis.",
        original_hypothesis_tested=True,
        metrics={"late": 1.0},
    )
    r = json.loads((b.dir / "result.json").read_text())
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert "secret scanner" in r["summary"] and r["metrics"]["late"] == 1.0  # the rest still merges


def test_result_merge_keeps_numbers_and_shape(bundle):
    bundle.update_result(
        metrics={"a": 1.0, "arms": {"dppo": {"loss": 0.5}}},
        correctness_preflight={"required": True, "paths": [{"errors": {"x": {"max_abs_error": 1e-9}}}]},
    )
    bundle.update_result(metrics={"b": 2.0})
    bundle.post_arm_metrics("dppo", {"masked": 0.01}, completed=True)
    r = bundle.result
    assert r["metrics"]["a"] == 1.0 and r["metrics"]["b"] == 2.0
    assert r["metrics"]["arms"]["dppo"] == {"loss": 0.5, "masked": 0.01}
    assert r["completed_arms"] == ["dppo"] and r["evidence"]["per_arm_metrics"]["dppo"] == {"masked": 0.01}
    bundle.update_result(completed_arms=[])  # completed_arms only grows
    assert bundle.result["completed_arms"] == ["dppo"]
    with pytest.raises(EvidenceError, match="metrics.a: an earlier posted number would be dropped"):
        bundle.update_result(metrics={"a": None})
    with pytest.raises(EvidenceError, match="correctness_preflight.paths"):
        bundle.update_result(correctness_preflight={"paths": []})
    with pytest.raises(ResultShapeError, match="verdict: leave it out while status is running"):
        bundle.update_result(verdict="supported")
    with pytest.raises(ResultShapeError, match="unknown key"):
        bundle.update_result(feasibility_check={"status": "ok"})
    with pytest.raises(ResultShapeError, match="finite"):
        bundle.update_result(metrics={"c": float("inf")})
    with pytest.raises(ResultShapeError, match="requires verdict 'inconclusive'"):
        bundle.update_result(
            status="succeeded", verdict="supported", outcome_reason="tie", original_hypothesis_tested=True
        )
    with pytest.raises(EvidenceError, match="dedicated bundle method"):
        bundle.update_result(deviations=[])
    with pytest.raises(EvidenceError, match="evidence.files"):
        bundle.update_result(evidence={"files": []})
    assert bundle.result["status"] == "running"  # every refused update changed nothing
    bundle.finish(
        "succeeded",
        "inconclusive",
        "incomplete_execution",
        original_hypothesis_tested=False,
        tested_instead="the DPPO mask's activation only",
        summary="Diagnostic ran.",
    )
    assert bundle.result["verdict"] == "inconclusive"


def test_local_summary_is_always_a_rehearsal(bundle):
    bundle.update_result(summary="DPPO mask fired on 2% of tokens.")
    bundle.set_backend(
        Backend(
            kind="local",
            requested_model="Qwen/Qwen3.5-2B",
            served_model="tiny-qwen3-gsm8k",
            sdk_versions={"tinker": "0.38.0"},
            base_url="http://127.0.0.1:1234",
        )
    )
    assert bundle.result["summary"] == REHEARSAL_PREFIX + "DPPO mask fired on 2% of tokens."
    bundle.update_result(summary="Second sentence only.")
    assert bundle.result["summary"].startswith(REHEARSAL_PREFIX)
    assert json.loads((bundle.dir / "result.json").read_text())["backend"]["kind"] == "local"
    with pytest.raises(ResultShapeError, match="rehearsal"):
        bad = bundle.result
        bad["summary"] = "not labelled"
        validate_result(bad)


def test_deviations_and_checkpoints(bundle):
    bundle.add_deviation("steps", 100, 16, "bounded diagnostic")
    bundle.add_deviation("steps", 100, 16, "bounded diagnostic")
    assert bundle.result["deviations"] == [
        {"field": "steps", "original": "100", "effective": "16", "reason": "bounded diagnostic"}
    ]
    with pytest.raises(EvidenceError, match=r"deviations\[1\]\.field: expected one of"):
        bundle.add_deviation("schedule", "a", "b", "c")
    bundle.add_checkpoint("dppo_seed0", 16, "tinker://sess:train:0/weights/step-16")
    assert bundle.result["evidence"]["checkpoints"] == [
        {"arm": "dppo_seed0", "step": 16, "uri": "tinker://sess:train:0/weights/step-16"}
    ]
    with pytest.raises(EvidenceError, match="query string"):
        bundle.add_checkpoint("dppo_seed0", 1, "https://bucket/x?X-Amz-Signature=abc")


def test_budget_ledger_blocks_a_stage(tmp_path):
    now = [0.0]
    b = EvidenceBundle.create(tmp_path, "budget", env={}, clock=lambda: now[0])
    b.set_budget(720.0)
    now[0] += 500.0
    b.stage_timing("preflight", 500.0, "passed")
    assert b.budget_allows("diagnostic", 200.0)
    assert not b.budget_allows("diagnostic", 221.0)
    m = b.result["metrics"]
    assert m["budget/wall_seconds/preflight"] == 500.0 and m["budget/blocked/diagnostic"] == 1.0
    assert m["budget/remaining_seconds/diagnostic"] == 220.0
    b.stage_timing("gate", 3.0, "failed")
    stages = b.ledger()["stages"]
    assert [(s["stage"], s["status"]) for s in stages] == [
        ("preflight", "passed"),
        ("diagnostic", "blocked_by_budget"),
        ("gate", "failed"),
    ]
    b.update_result(original_hypothesis_tested=False, tested_instead="nothing")
    b.finish("failed", "inconclusive", "incomplete_execution")
    assert b.entry("budget-ledger.json")["kind"] == "manifest"
    assert verify_bundle(b.dir) == []


def test_provenance_plan_and_code_revision(tmp_path, bundle):
    plan = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
    entry = bundle.register_bytes(plan.name, "plan", plan.data)
    assert entry["sha256"] == plan.sha256 and entry["kind"] == "plan"
    repo = tmp_path / "repo"
    (repo / "src" / "dppo_harness").mkdir(parents=True)
    (repo / "src" / "dppo_harness" / "m.py").write_text("x = 1\n")
    git_env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e"
    )
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=git_env, capture_output=True)
    (repo / "src" / "dppo_harness" / "m.py").write_text("x = 2\n")
    (repo / "new_file.py").write_text("y = 3\n")
    (repo / ".env").write_text("HF_TOKEN=hf_planted_in_an_untracked_dotenv_file\n")  # no .gitignore rule here
    status_before = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True).stdout
    entries = register_code(bundle, repo)
    assert [e["kind"] for e in entries] == ["code_revision", "code_patch", "script"]
    info = json.loads(bundle.file_path("code-revision.json").read_text())
    assert len(info["commit"]) == 40 and info["dirty"] and info["untracked_files"] == [".env", "new_file.py"]
    assert [u["path"] for u in info["untracked_not_in_patch"]] == [".env", "new_file.py"]  # by hash only
    patch = bundle.file_path("code.patch").read_text()
    assert "+x = 2" in patch and "+y = 3" not in patch and "hf_planted" not in patch  # tracked diff only
    assert (
        subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True).stdout == status_before
    )


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_verify_good_tampered_and_missing(bundle):
    bundle.register_json("metrics.json", "metrics", {"a": 1})
    bundle.register_bytes("predictions.jsonl", "predictions", b'{"item_id": "1"}\n')
    bundle.update_result(initialization_provenance={"dppo": {"initial_output": {"evidence_ref": "metrics.json#a"}}})
    running = _cli("verify", str(bundle.dir))  # hashes hold, but the run has not ended (killed, or still running)
    assert running.returncode == 3 and "INCOMPLETE" in running.stdout and "'running'" in running.stdout, running.stdout
    bundle.update_result(
        status="failed",
        verdict="inconclusive",
        outcome_reason="incomplete_execution",
        original_hypothesis_tested=False,
        tested_instead="nothing: a test bundle",
    )
    ok = _cli("verify", str(bundle.dir))
    assert ok.returncode == 0 and "verify: OK" in ok.stdout and "(status failed)" in ok.stdout, ok.stdout + ok.stderr
    assert _cli("verify", str(bundle.dir.parent)).returncode == 0  # root with LATEST
    path = bundle.file_path("metrics.json")
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01  # one-byte tamper, same size
    path.write_bytes(bytes(data))
    bad = _cli("verify", str(bundle.dir))
    assert bad.returncode == 1 and "metrics.json: sha256 does not match" in bad.stdout
    path.write_bytes(bytes(data[:3]) + bytes([data[3] ^ 0x01]) + bytes(data[4:]))
    assert _cli("verify", str(bundle.dir)).returncode == 0
    bundle.file_path("predictions.jsonl").unlink()
    gone = _cli("verify", str(bundle.dir))
    assert gone.returncode == 1 and "predictions.jsonl: registered but missing" in gone.stdout
    assert _cli("verify", str(bundle.dir / "nope")).returncode == 2


def test_verify_fails_on_dangling_reference(bundle):
    bundle.update_result(evaluation={"scores": [{"predictions_ref": "predictions.jsonl"}]})
    problems = verify_bundle(bundle.dir)
    assert problems == [
        "evaluation.scores[0].predictions_ref: references 'predictions.jsonl', which is not a registered file"
    ]
    bundle.register_bytes("predictions.jsonl", "predictions", b"{}\n")
    bundle.update_result(
        decision={"version": 1, "observations_file": {"name": "predictions.jsonl", "sha256": "0" * 64}}
    )
    assert any("sha256 for 'predictions.jsonl' differs" in p for p in verify_bundle(bundle.dir))


def test_result_json_tamper_fails_verify(bundle):
    bundle.register_json("m.json", "metrics", {"a": 1})
    r = json.loads((bundle.dir / "result.json").read_text())
    r["evidence"]["files"][0]["size"] += 1
    (bundle.dir / "result.json").write_text(json.dumps(r))
    assert any("size" in p for p in verify_bundle(bundle.dir))
    (bundle.dir / "result.json").write_text("{not json")
    assert "not valid JSON" in verify_bundle(bundle.dir)[0]


_WRITER = r"""
import sys, itertools
from pathlib import Path
from dppo_harness.evidence import EvidenceBundle
b = EvidenceBundle.create(Path(sys.argv[1]), "killed", env={})
b.update_result(metrics={"first": 1.0})
b.register_json("early.json", "metrics", {"posted": 1})
for i in itertools.count():
    b.register_bytes(f"update-{i:04d}.bin", "tensors", bytes([i % 256]) * 4096) if i < 60 else None
    b.update_result(metrics={f"update/{i % 500}": float(i)})
    if i == 20:
        print("ready", flush=True)
"""


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_killed_run_leaves_a_valid_partial_bundle(tmp_path):
    root = tmp_path / "evidence"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        # Waits until the writer, inside its write loop, says so (EOF if it died first).
        assert select.select([proc.stdout], [], [], 60)[0], "writer never got ready"
        assert proc.stdout.readline() == "ready\n", "writer exited before its write loop"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run = root / "killed"
    assert verify_bundle(run) == []
    r = json.loads((run / "result.json").read_text())
    assert r["status"] == "running" and "verdict" not in r
    assert r["metrics"]["first"] == 1.0 and r["metrics"]["update/20"] == 20.0
    assert any(f["name"] == "early.json" for f in r["evidence"]["files"])
    told = _cli("verify", str(root))  # as a reader runs it, through LATEST: never read as verified
    assert told.returncode == 3 and "verify: INCOMPLETE" in told.stdout and "OK" not in told.stdout, told.stdout


def test_record_plan_before_training(bundle):
    from dppo_harness.evidence.backend import Backend

    plan = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
    session.record_plan(
        bundle, plan, Backend(kind="local", requested_model="Qwen/Qwen3.5-2B", served_model="tiny-qwen3-gsm8k")
    )
    r = bundle.result
    assert bundle.entry(plan.name)["sha256"] == plan.sha256
    assert bundle.entry("effective-config.json")["kind"] == "effective_config"
    assert len(r["deviations"]) == len(plan.deviations) + 1 and r["deviations"][-1]["field"] == "model"
    assert r["original_hypothesis_tested"] is False and r["tested_instead"] == plan.raw["tested_instead"]
    assert r["generation_audit"]["status"] == "not_applicable"
    assert [e["kind"] for e in bundle.files()].count("plan") == 1  # no resolution file beside a diagnostic


def _git_repo(tmp_path):
    repo = tmp_path / "proj"
    for d in ("tests/preflight", "tests/comparison", "tests/unit", "plans"):
        (repo / d).mkdir(parents=True)
    (repo / "conftest.py").write_text("pytest_plugins = []\n")
    (repo / "tests/preflight/test_a.py").write_text("def test_a(): pass\n")
    (repo / "tests/comparison/test_c.py").write_text("def test_c(): pass\n")
    (repo / "tests/unit/test_u.py").write_text("def test_u(): pass\n")
    for p in PLANS.glob("*.json"):
        (repo / "plans" / p.name).write_bytes(p.read_bytes())
    git_env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e"
    )
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=git_env, capture_output=True)
    return repo


def test_session_start_and_finish(tmp_path):
    repo = _git_repo(tmp_path)
    plan = load_plan(repo / "plans" / "exp_e6b0965af3-diagnostic-r1.json")
    b = EvidenceBundle.create(tmp_path / "evidence", "sess", env={})
    session.start_session(
        b,
        backend="local",
        plan=plan,
        stages=["unit", "preflight", "diagnostic"],
        project_root=repo,
        test_files=[
            str(repo / f"tests/{f}") for f in ("preflight/test_a.py", "comparison/test_c.py", "unit/test_u.py")
        ],
    )
    names = {f["name"]: f["kind"] for f in b.files()}
    assert names == {
        "code-revision.json": "code_revision",
        "test-files.json": "manifest",
        "exp_e6b0965af3-diagnostic-r1.json": "plan",
        "effective-config.json": "effective_config",
        "code-archive.zip": "script",
        "revised-diagnostic-spec.json": "plan",
    }
    # Executed test files: hashed in one manifest (stage files flagged), their bytes in the archive.
    listed = json.loads((b.dir / "files" / "test-files.json").read_text())
    assert listed["archive"] == "code-archive.zip"
    assert {f["path"]: f["stage_test"] for f in listed["files"]} == {
        "tests/comparison/test_c.py": True,  # every stage's folder but unit's (pytest_plugin.stages)
        "tests/preflight/test_a.py": True,
        "conftest.py": True,
        "tests/unit/test_u.py": False,
    }
    r = b.result
    assert r["backend"]["kind"] == "local" and r["summary"].startswith(REHEARSAL_PREFIX)
    assert r["deviations"][-1]["field"] == "model" and r["original_hypothesis_tested"] is False
    # The diagnostic plan's own 12 minutes, from the session start (not 7200 s).
    assert r["metrics"]["budget/max_wall_seconds"] == 720.0
    # The revised spec exists before any stage ran (same bytes as the plan).
    assert b.entry("revised-diagnostic-spec.json")["sha256"] == plan.sha256
    b.stage_timing("preflight", 3.0, "failed")
    session.finish_session(b, {"preflight": "tests/preflight/test_a.py::test_a"})
    r = b.result
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert "preflight (tests/preflight/test_a.py::test_a)" in r["summary"]
    assert b.entry("budget-ledger.json") is not None
    assert verify_bundle(b.dir) == []
    done = EvidenceBundle.create(tmp_path / "evidence", "sess2", env={})
    spec = load_plan(repo / "plans" / "exp_e6b0965af3.json")
    session.start_session(
        done, backend="tinker", plan=spec, stages=["preflight"], project_root=repo, served_model="Qwen/Qwen3.5-2B"
    )
    assert done.result["deviations"] == [] and done.result["original_hypothesis_tested"] is True
    session.finish_session(done, {})
    assert (done.result["status"], done.result["verdict"]) == ("succeeded", "inconclusive")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r: r["metrics"]["arms"].__setitem__("dppo", {"loss": True}),
            "metrics.arms.dppo.loss: expected number, got bool",
        ),
        (lambda r: r["metrics"].__setitem__("x", "1.0"), "metrics.x: expected number, got str"),
        (
            lambda r: r["deviations"].append({"field": "model", "original": "a", "effective": "b"}),
            "deviations[0].reason: missing required key",
        ),
        (
            lambda r: r["evidence"]["files"].append({"name": "a", "kind": "weights", "sha256": "0" * 64, "size": 1}),
            "evidence.files[0].kind: expected one of",
        ),
        (lambda r: r["evidence"].__setitem__("version", 2), "evidence.version: expected one of"),
        (lambda r: r.__setitem__("backend", {"kind": "remote"}), "backend.kind: expected one of"),
        (lambda r: r.__setitem__("completed_arms", ["dppo"]), "completed_arms: arm 'dppo' has no metrics"),
        (
            lambda r: r.update(
                status="failed", verdict="inconclusive", original_hypothesis_tested=False, tested_instead=" "
            ),
            "tested_instead: required when",
        ),
        (
            lambda r: r.update(
                status="failed",
                verdict="inconclusive",
                original_hypothesis_tested=True,
                capacity_block={"error": "x", "comparison_steps_completed": 1.0, "released_clients": True},
            ),
            "capacity_block.comparison_steps_completed: expected integer, got float",
        ),
        (lambda r: r.__setitem__("decision", {"p": float("nan")}), "result: non-finite number"),
        (lambda r: r.__setitem__("verdict", None), "verdict: expected a value, got null (leave the key out instead)"),
    ],
)
def test_result_shape_errors_name_the_field(mutate, message):
    r = initial_result()
    validate_result(r)
    mutate(r)
    with pytest.raises(ResultShapeError) as e:
        validate_result(r)
    assert str(e.value).startswith(message), str(e.value)


def test_rehearsal_plan_result_is_labelled_and_inconclusive(tmp_path):
    from dppo_harness.evidence.backend import Backend

    spec = json.loads((PLANS / "exp_e6b0965af3.json").read_text())
    spec["max_seq_len"] = 2048
    raw = {
        "kind": "rehearsal",
        "version": 1,
        "plan_id": "t",
        "label": "rehearsal",
        "purpose": "test",
        "derived_from": {
            "path": "plans/exp_e6b0965af3.json",
            "sha256": sha256_bytes((PLANS / "exp_e6b0965af3.json").read_bytes()),
        },
        "differences": [{"field": "max_seq_len", "spec": 1024, "rehearsal": 2048, "reason": "longer"}],
        "spec": spec,
    }
    path = tmp_path / "plans" / "rehearsal" / "r.json"
    path.parent.mkdir(parents=True)
    (tmp_path / "plans" / "exp_e6b0965af3.json").write_bytes((PLANS / "exp_e6b0965af3.json").read_bytes())
    path.write_text(json.dumps(raw))
    resolution = json.loads((PLANS / "exp_e6b0965af3.json.resolution.json").read_text())
    del resolution["launch"]  # the saved spec's launch, not this rehearsal's
    path.with_name("r.json.resolution.json").write_text(json.dumps(resolution))
    plan = load_plan(path)
    b = EvidenceBundle.create(tmp_path / "evidence", "reh", env={})
    session.record_plan(
        b, plan, Backend(kind="tinker", requested_model="Qwen/Qwen3.5-2B", served_model="Qwen/Qwen3.5-2B")
    )
    assert b.result["deviations"][0]["original"] == "max_seq_len = 1024"
    with pytest.raises(ResultShapeError, match="rehearsal plan is always 'inconclusive'"):
        b.finish("succeeded", "supported", "supported", original_hypothesis_tested=True, summary="DPPO wins.")
    b.finish(
        "succeeded",
        "inconclusive",
        "incomplete_execution",
        original_hypothesis_tested=False,
        tested_instead="the rehearsal's plumbing",
        summary="Ran.",
    )
    assert b.result["summary"].startswith(ev.result.REHEARSAL_PLAN_PREFIX)


def test_atomic_write_syncs_the_file_and_then_its_directory(tmp_path, monkeypatch):
    import os
    import stat

    from dppo_harness.evidence import files

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    files.atomic_write(tmp_path / "result.json", b"{}\n")
    assert synced == ["file", "dir"] and (tmp_path / "result.json").read_bytes() == b"{}\n"
