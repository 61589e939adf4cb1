"""Unit parity checks the harness, not the service a user has configured: every test here runs
without the run's variables (tests/support/run_env.py), whatever the launching shell holds."""

from __future__ import annotations

import os

import pytest
from run_env import is_run_variable


@pytest.fixture(autouse=True)
def _without_run_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if is_run_variable(k)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
