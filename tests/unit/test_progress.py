"""No long silences: the throttled progress lines, the embedded server's start-up (its log's progress
lines forwarded while the harness waits for readiness, a heartbeat otherwise), and the warm start's
own progress lines."""

from __future__ import annotations

import itertools
import logging
import sys
import textwrap

import pytest

from dppo_harness.evidence import progress
from dppo_harness.local_server import process
from dppo_harness.local_server.engine import warmstart
from dppo_harness.loss import correctness_golden


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ticker_says_where_it_is_at_least_every_interval_and_at_the_end():
    clock, lines, said_at = Clock(), [], []

    def say(msg):
        lines.append(msg)
        said_at.append(clock.t)

    t = progress.Ticker(say, "[x] phase", total=40, every_s=5.0, clock=clock)
    t.start()
    for i in range(1, 41):
        clock.t += 1.5  # every item takes 1.5 s
        t.tick(i, f"item {i}")
    gaps = [b - a for a, b in itertools.pairwise(said_at)]
    assert max(gaps) <= 5.0 + 1.5 and len(lines) < 20
    assert lines[0] == "[x] phase: started (40 steps) (0s)"
    assert lines[-1] == "[x] phase: 40/40 (100%), item 40 (60s)"


def test_golden_parity_reports_progress(tmp_path):
    from pathlib import Path

    golden = Path(__file__).resolve().parents[1] / "fixtures" / "dppo_golden_v1.json"
    lines: list[str] = []
    report = correctness_golden.check_golden(golden, modes=("float64",), progress=lines.append)
    assert lines[0].startswith("[preflight] correctness: golden parity: started")
    assert lines[-1].startswith(
        f"[preflight] correctness: golden parity: {len(report.results)}/{len(report.results)} (100%)"
    )


FAKE_SERVER = textwrap.dedent('''
    """Stands in for `python -m dppo_harness.local_server`: logs warm-start progress lines to
    stderr (the server log) for a while, then serves healthz and prints the ready line."""
    import http.server, json, sys, threading, time

    for k in range(3):
        print(f"2026-12-01 dppo_harness.local_server.warmstart progress: warm start: step {k + 1}/3", file=sys.stderr,
              flush=True)
        time.sleep(0.6)
    time.sleep(2.5)  # silent: the harness must say it is still waiting

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(f"listening on http://127.0.0.1:{srv.server_address[1]}", flush=True)
    time.sleep(600)
''')


@pytest.mark.integration  # a server process (a stand-in) over seconds: the default run, not unit parity
def test_server_start_forwards_its_progress_and_never_goes_quiet(tmp_path):
    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    script.chmod(0o755)
    lines: list[str] = []
    with process.LocalServerProcess(
        run_dir=tmp_path / "run", python=str(script), progress=lines.append, heartbeat_s=1.0, startup_timeout=60
    ) as server:
        assert server.base_url.startswith("http://127.0.0.1:")
    forwarded = [ln for ln in lines if "warm start: step" in ln]
    assert forwarded == [f"[local server] warm start: step {k}/3" for k in (1, 2, 3)]
    assert any("waiting for its ready line" in ln for ln in lines), lines
    assert lines[0].startswith("[local server] starting the embedded server")
    assert lines[-1].startswith("[local server] ready at http://127.0.0.1:")


@pytest.mark.integration  # trains the engine's warm start: the default run, not unit parity
def test_warm_start_logs_progress_lines_the_harness_forwards(caplog):
    from dppo_harness.local_server.engine import model
    from dppo_harness.local_server.vocab import load_vocab

    cfg = model.TinyConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
    )
    recipe = {**warmstart.RECIPE, "steps": 3, "batch_size": 2, "warmup_steps": 1}
    with caplog.at_level(logging.INFO, logger=warmstart.__name__):
        warmstart.load_or_build(cfg, load_vocab(), seed=0, recipe=recipe)
    texts = [
        process.PROGRESS_RE.search(r.getMessage()).group(1)
        for r in caplog.records
        if process.PROGRESS_RE.search(r.getMessage())
    ]
    assert texts[0].startswith("warm start: no shipped stand-in model for this config")
    assert any(t.startswith("warm start: step 3/3 (100%)") for t in texts)
    assert texts[-1].startswith("warm start: built in ")


@pytest.mark.parametrize("msg", ["warm start: step 1/60 (2%), loss 3.1 (4s)"])
def test_progress_marker_round_trip(msg):
    line = f"2026-12-01 10:00:00,000 {warmstart.__name__} {warmstart.PROGRESS_MARKER}{msg}"
    assert process.PROGRESS_RE.search(line).group(1) == msg


def test_watchdog_repeats_a_blocking_step_and_stops_with_its_block():
    import time

    lines: list[str] = []
    with progress.Watchdog(lines.append, every_s=0.3, poll_s=0.05) as w:
        w.say("[x] 1/2: a slow call")
        time.sleep(1.1)
        w.say("[x] 2/2: a quick one")
    n = len(lines)
    time.sleep(0.5)
    assert len(lines) == n  # nothing after the block
    still = [ln for ln in lines if ln.startswith("[x] 1/2: a slow call: still working (")]
    assert 2 <= len(still) <= 4 and lines[0] == "[x] 1/2: a slow call" and lines[-1] == "[x] 2/2: a quick one"
