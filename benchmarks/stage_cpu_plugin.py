"""pytest plugin for benchmarks/diagnostic_profile.py: each test's wall window and this process's
CPU seconds (user + system) around it, written as JSON to $DIAGNOSTIC_PROFILE_TESTS at the end.

    PYTHONPATH=benchmarks pytest -p stage_cpu_plugin ...
"""

from __future__ import annotations

import json
import os
import time

import pytest

_rows: list[dict] = []


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, cpu = time.time(), _cpu()
    yield
    _rows.append({"nodeid": item.nodeid, "start": start, "end": time.time(), "cpu_s": _cpu() - cpu})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DIAGNOSTIC_PROFILE_TESTS")
    if path:
        with open(path, "w") as f:
            json.dump({"tests": _rows, "session_cpu_s": _cpu()}, f)
