"""The restricted vocabulary rebuilds from the vendored GSM8K to exactly the shipped asset.

The full rebuild tokenizes and renders all 8,792 GSM8K rows: about 21 s of CPU (100 s wall on
a busy 2-core machine). The CLI's `main` runs in this process (`python -m` adds only an
interpreter, torch and tokenizer start-up to what is checked: exit code and output).
"""

import json

import pytest

from dppo_harness.local_server import vocab


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`python -m dppo_harness.local_server.vocab ARGS`: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = vocab.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_rebuild_matches_the_shipped_vocabulary(tmp_path, capsys):
    out = tmp_path / "vocab.json"
    rc, stdout, stderr = _cli(capsys, "--check", "--out", str(out))
    assert rc == 0, stdout + stderr
    shipped = json.loads(vocab.ASSET_PATH.read_text())
    rebuilt = json.loads(out.read_text())
    assert rebuilt["sha256"] == shipped["sha256"] and rebuilt["real_ids"] == shipped["real_ids"]
    assert "matches the shipped" in stdout


def test_check_fails_when_the_rebuild_differs(tmp_path, capsys):
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        rows = (vocab.DATA_DIR / f"{split}.jsonl").read_text().splitlines()[:2]
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    rc, stdout, stderr = _cli(capsys, "--check", "--data", str(data))
    assert rc == 1 and "MISMATCH" in stderr, stdout + stderr


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
