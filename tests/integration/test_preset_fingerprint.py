"""The tiny presets compute bitwise what they computed when pinned (before the decode loops were
merged; re-pinned for the trainer's fused output head, see the fixture's `_about`): the sha256 of
every section of `local_server.fingerprint` (training outputs, optimizer step, seeded sampling,
prompt logprobs) equals the pinned value. The pins hold for one torch build and CPU
capability; elsewhere the test skips and says which differs."""

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


@pytest.mark.parametrize("model", ["tiny-qwen3-random", "tiny-qwen3-gsm8k"])
def test_preset_outputs_are_bitwise_pinned(model, tmp_path):
    pin = PINS[model]
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    if here != (pin["torch"], pin["cpu_capability"]):
        pytest.skip(f"pinned on torch {pin['torch']} / {pin['cpu_capability']}; this is {here[0]} / {here[1]}")
    got = fingerprint.preset_fingerprint(model, tmp_path / "run")
    # the script reaches every way a row can finish (rows dropping out of the batch at different steps)
    assert {"stop", "stop_string", "length"} <= set(got.coverage), got.coverage
    assert mismatches(got, pin) == [], got
    # the comparison can fail: one changed section is named
    assert mismatches(replace(got, sections={**got.sections, "sampling": "0" * 64}), pin) == ["sampling"]


def test_hasher_sees_one_ulp():
    a, b = fingerprint._Hasher(), fingerprint._Hasher()
    x = np.asarray([0.1, -2.5], np.float32)
    a.add("x", x)
    b.add("x", np.nextafter(x, np.float32(1)).astype(np.float32))
    assert a.hexdigest() != b.hexdigest()
    c = fingerprint._Hasher()
    c.add("x", x.copy())
    assert c.hexdigest() == a.hexdigest()
