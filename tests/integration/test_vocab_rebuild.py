"""The restricted vocabulary rebuilds from the vendored GSM8K to exactly the shipped asset.

The full rebuild tokenizes and renders all 8,792 GSM8K rows: about 21 s of CPU (100 s wall on
a busy 2-core machine).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from dppo_harness.local_server import vocab

SRC = Path(vocab.__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC), TINKER_TELEMETRY="0")
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.local_server.vocab", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def test_rebuild_matches_the_shipped_vocabulary(tmp_path):
    out = tmp_path / "vocab.json"
    res = _cli("--check", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    shipped = json.loads(vocab.ASSET_PATH.read_text())
    rebuilt = json.loads(out.read_text())
    assert rebuilt["sha256"] == shipped["sha256"] and rebuilt["real_ids"] == shipped["real_ids"]
    assert "matches the shipped" in res.stdout


def test_check_fails_when_the_rebuild_differs(tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        rows = (vocab.DATA_DIR / f"{split}.jsonl").read_text().splitlines()[:2]
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    res = _cli("--check", "--data", str(data))
    assert res.returncode == 1 and "MISMATCH" in res.stderr, res.stdout + res.stderr


def test_prompt_is_the_cookbook_math_env_prompt():
    """vocab.prompt_messages renders to the tokens of the cookbook MathEnv's first observation."""
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer

    from dppo_harness.data import gsm8k

    item = gsm8k.load_split("train", seed=0).batch(0, 1)[0]
    renderer = vocab.get_renderer()
    ours = renderer.build_generation_prompt(vocab.prompt_messages(item.question)).to_ints()
    assert ours == gsm8k.build_prompt(item, renderer)[0].to_ints()
    row = json.loads((vocab.DATA_DIR / "train.jsonl").read_text().splitlines()[0])
    assert vocab.solution_reply(row["answer"]).endswith(f"\\boxed{{{extract_gsm8k_final_answer(row['answer'])}}}.")
