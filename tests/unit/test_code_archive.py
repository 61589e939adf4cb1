"""All executed library code is archived as one hashed script archive."""

import hashlib
import io
import json
import zipfile
from pathlib import Path

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.provenance import (
    ARCHIVE_NAME,
    MANIFEST_MEMBER,
    build_archive,
    register_code,
)

ROOT = Path(__file__).parents[2]


def _members_match_manifest(data: bytes) -> bool:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        manifest = json.loads(zf.read(MANIFEST_MEMBER))
        members = {m["path"]: m["sha256"] for m in manifest["members"]}
        names = set(zf.namelist()) - {MANIFEST_MEMBER}
        return names == set(members) and all(hashlib.sha256(zf.read(n)).hexdigest() == members[n] for n in names)


def test_archive_holds_the_library_the_server_and_the_tests_deterministically():
    data, manifest = build_archive(ROOT, commit="abc")
    paths = {m["path"] for m in manifest["members"]}
    for must in (
        "src/dppo_harness/stages/diagnostic/loop.py",
        "src/dppo_harness/loss/losses.py",
        "src/dppo_harness/instrument/instrumentation.py",
        "src/dppo_harness/local_server/engine/engine.py",
        "src/dppo_harness/local_server/http/app.py",
        "tests/diagnostic/test_bounded_diagnostic.py",
        "plans/exp_e6b0965af3-diagnostic-r1.json",
    ):
        assert must in paths, must
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in paths)
    src = ROOT / "src/dppo_harness/loss/losses.py"
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("src/dppo_harness/loss/losses.py") == src.read_bytes()
        assert json.loads(zf.read(MANIFEST_MEMBER))["commit"] == "abc"
    assert _members_match_manifest(data)
    assert build_archive(ROOT, commit="abc")[0] == data  # deterministic
    assert len(data) < 10 * 1024 * 1024


def test_archive_is_one_script_file_in_the_bundle(tmp_path):
    b = EvidenceBundle.create(tmp_path)
    entry = register_code(b, ROOT)[-1]
    files = [f for f in b.result["evidence"]["files"] if f["kind"] == "script" and f["name"] == ARCHIVE_NAME]
    assert len(files) == 1 and files[0] == entry


def test_weight_assets_are_referenced_by_hash_not_archived():
    """The shipped warm start (tens of MB of weights) would put the one archive over the per-file
    limit: it is listed with the sha256 of its bytes; its sidecar, an archived member, pins its weights."""
    data, manifest = build_archive(ROOT, commit="abc")
    paths = {m["path"] for m in manifest["members"]}
    referenced = {m["path"]: m for m in manifest["referenced"]}
    asset = "src/dppo_harness/local_server/assets/warmstart-gsm8k-sft-v1.pt"
    assert asset in referenced and asset not in paths
    raw = (ROOT / asset).read_bytes()
    assert referenced[asset] == {"path": asset, "sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    assert "src/dppo_harness/local_server/assets/warmstart-gsm8k-sft-v1.json" in paths
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert asset not in zf.namelist()
    assert _members_match_manifest(data)


def test_the_archive_takes_tracked_files_only_and_never_a_secret_named_one(tmp_path):
    import os
    import subprocess

    repo = tmp_path / "repo"
    (repo / "src" / "dppo_harness").mkdir(parents=True)
    (repo / "src" / "dppo_harness" / "m.py").write_text("x = 1\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_m.py").write_text("def test(): pass\n")
    git_env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@e"
    )
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=git_env, capture_output=True)
    (repo / "tests" / ".env").write_text("WANDB_API_KEY=planted-untracked-dotenv-value\n")
    (repo / "tests" / "scratch_notes.py").write_text("TOKEN = 'planted-untracked-notes'\n")
    data, manifest = build_archive(repo, commit="abc")
    assert [m["path"] for m in manifest["members"]] == ["src/dppo_harness/m.py", "tests/test_m.py"]
    assert b"planted-untracked" not in data
    # without git nothing tells tracked from untracked, but a secret-named file is still never taken
    import shutil

    shutil.rmtree(repo / ".git")
    _, manifest = build_archive(repo, commit=None)
    paths = [m["path"] for m in manifest["members"]]
    assert "tests/.env" not in paths and "tests/scratch_notes.py" in paths
