"""The tiny presets compute bitwise what they computed when pinned (before the decode loops were
merged; re-pinned for the trainer's fused output head, see the fixture's `_about`): the sha256 of
every section of `local_server.fingerprint` (training outputs, optimizer step, seeded sampling,
prompt logprobs) equals the pinned value. The pins hold for one torch build, CPU capability and
set of CPU kernels (`fingerprint.platform_sha256`: plain torch, no harness code); elsewhere the test
skips and says which differs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dppo_harness.local_server import fingerprint

pytestmark = pytest.mark.integration

PINS = json.loads((Path(__file__).parents[1] / "fixtures" / "preset_fingerprints.json").read_text())


def mismatches(got: fingerprint.Fingerprint, pin: dict) -> list[str]:
    """Names of what differs from the pin (empty: bitwise the same)."""
    bad = [] if got.base_sha256 == pin["base_sha256"] else ["base weights (re-pin if the preset changed on purpose)"]
    return bad + [s for s, h in pin["sections"].items() if got.sections.get(s) != h]


def why_the_pin_does_not_apply(pin: dict) -> str | None:
    """Why this machine cannot reproduce `pin` bitwise (None: it can, so any difference is the harness's)."""
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    if here != (pin["torch"], pin["cpu_capability"]):
        return f"pinned on torch {pin['torch']} / {pin['cpu_capability']}; this is {here[0]} / {here[1]}"
    platform = fingerprint.platform_sha256(pin["threads"])
    if platform != pin["platform_sha256"]:
        return (
            f"this machine's torch kernels round differently from the pin machine's (platform sha256 "
            f"{platform[:12]}, pinned {pin['platform_sha256'][:12]}): the pins say nothing here"
        )
    return None


@pytest.mark.parametrize("model", ["tiny-qwen3-random", "tiny-qwen3-gsm8k"])
def test_preset_outputs_are_bitwise_pinned(model, tmp_path):
    pin = PINS[model]
    reason = why_the_pin_does_not_apply(pin)
    if reason:
        pytest.skip(reason)
    got = fingerprint.preset_fingerprint(model, tmp_path / "run")
    # the script reaches every way a row can finish (rows dropping out of the batch at different steps)
    assert {"stop", "stop_string", "length"} <= set(got.coverage), got.coverage
    assert mismatches(got, pin) == [], got
    # the comparison can fail: one changed section is named
    assert mismatches(replace(got, sections={**got.sections, "sampling": "0" * 64}), pin) == ["sampling"]


def test_a_pin_from_other_kernels_does_not_apply():
    """The platform hash is the same on a second call, and a pin whose platform hash is not this
    machine's is skipped with the reason (so a changed section elsewhere is the harness's)."""
    pin = PINS["tiny-qwen3-random"]
    here = {
        **pin,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform_sha256": fingerprint.platform_sha256(pin["threads"]),
    }
    assert why_the_pin_does_not_apply(here) is None
    reason = why_the_pin_does_not_apply({**here, "platform_sha256": "0" * 64})
    assert reason and "round differently" in reason
    assert "pinned on torch 0.0" in why_the_pin_does_not_apply({**here, "torch": "0.0"})


def test_hasher_sees_one_ulp():
    a, b = fingerprint._Hasher(), fingerprint._Hasher()
    x = np.asarray([0.1, -2.5], np.float32)
    a.add("x", x)
    b.add("x", np.nextafter(x, np.float32(1)).astype(np.float32))
    assert a.hexdigest() != b.hexdigest()
    c = fingerprint._Hasher()
    c.add("x", x.copy())
    assert c.hexdigest() == a.hexdigest()
