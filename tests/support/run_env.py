"""The variables of a run, kept out of the tests of the harness itself.

A user who launches `pytest -m diagnostic --backend tinker` has the service's address and
credentials in the environment. Unit parity and the integration tests check the harness, not that
service: they must pass the same with or without it, and an inner pytest or server they start must
never reach it. `scrubbed_environ` is what such a test's process sees; `harness_env` is the clean,
explicit environment a test hands to a subprocess it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Every variable the harness or the SDK reads to find or authenticate a service, or to change a
# run's behaviour (the service's address, its key, proxy tokens, telemetry, the harness's knobs).
RUN_PREFIXES = ("TINKER_", "MODAL_", "RUNS_PROXY_", "CF_ACCESS_", "DPPO_HARNESS_")
RUN_NAMES = frozenset({"CF-Access-Client-Id", "CF-Access-Client-Secret"})


def is_run_variable(name: str) -> bool:
    return name in RUN_NAMES or name.upper().startswith(RUN_PREFIXES)


def scrubbed_environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) without the run's variables, telemetry off."""
    out = {k: v for k, v in (os.environ if env is None else env).items() if not is_run_variable(k)}
    out["TINKER_TELEMETRY"] = "0"
    return out


def harness_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a subprocess a test starts: this process's without the run's variables,
    plus `overrides` (a value of None removes the variable)."""
    env = scrubbed_environ()
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env
