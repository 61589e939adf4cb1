"""The cookbook's own RL loop (`recipes.math_rl`, GSM8K) as a peer client of the embedded server.

The README's cookbook command ("The cookbook's recipes against the embedded server") as written,
through dppo_harness.local_server.cookbook_offline (offline tokenizer under the served name, vendored GSM8K),
with the server's URL, a temporary log path and CI sizes in place of its numbers: 2 training
steps, then a second run that loads the final checkpoint, which makes the cookbook read
`GET /api/v1/training_runs/{id}` to confirm the renderer.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

RENDERER_WARNING = "Could not fetch renderer metadata"
CI_SIZE = {"lora_rank": "8", "group_size": "2", "groups_per_batch": "2", "max_tokens": "24", "save_every": "1"}


def _math_rl(readme, base_url: str, log_path: Path, **extra: str) -> subprocess.CompletedProcess:
    words = shlex.split(readme("The cookbook's recipes against the embedded server", "TINKER_API_KEY="))
    module = words.index("-m")
    assert words[module + 1] == "dppo_harness.local_server.cookbook_offline" and words[module - 1] == "python", words
    env = dict(os.environ, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    env.pop("TINKER_BASE_URL", None)
    env.update(w.split("=", 1) for w in words[: module - 1])  # the README's VAR=value prefix
    args = dict(w.split("=", 1) for w in words[module + 2 :])
    assert {"base_url", "env", "model_name", "renderer_name", "log_path"} <= set(args), args
    args.update(CI_SIZE, base_url=base_url, log_path=str(log_path), **extra)
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.local_server.cookbook_offline", *(f"{k}={v}" for k, v in args.items())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _final_state_path(log_path: Path) -> str:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("name") == "final"][-1]["state_path"]


def test_math_rl_two_steps_then_load_checkpoint(readme, tmp_path, shared_server):
    srv = shared_server
    first = _math_rl(readme, srv.base_url, tmp_path / "run1", max_steps="2")
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    assert all(m["optim/step"] >= 1 for m in metrics)
    state = _final_state_path(tmp_path / "run1")
    assert state.startswith("tinker://") and "/weights/" in state

    second = _math_rl(readme, srv.base_url, tmp_path / "run2", max_steps="1", load_checkpoint_path=state)
    assert second.returncode == 0, second.stderr[-3000:]
    # The cookbook confirms the renderer of a loaded checkpoint through training_runs.
    assert RENDERER_WARNING not in second.stdout + second.stderr, "training_runs lookup failed"
    assert (tmp_path / "run2" / "metrics.jsonl").read_text().strip()
