"""The default preset's warm start ships with the package: every machine pilots the same stand-in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dppo_harness.local_server.engine import model, warmstart
from dppo_harness.local_server.engine.engine import PRESETS
from dppo_harness.local_server.vocab import load_vocab


def _default_key() -> dict:
    vocab = load_vocab()
    return warmstart.config_key(
        PRESETS["tiny-qwen3-gsm8k"].config,
        vocab,
        0,
        dict(warmstart.RECIPE),
        warmstart._train_sha256(warmstart.data_dir()),
    )


def test_the_shipped_asset_is_the_default_recipe():
    """A recipe, model, vocabulary or data change without a rebuilt asset fails here, not as a
    silent local build that pilots another model on each CPU."""
    meta = json.loads(warmstart.asset_paths()[1].read_text())
    assert meta["key"] == warmstart.shipped_key(_default_key())


def test_the_default_preset_loads_the_shipped_weights():
    net, info = warmstart.load_or_build(PRESETS["tiny-qwen3-gsm8k"].config, load_vocab(), seed=0)
    meta = json.loads(warmstart.asset_paths()[1].read_text())
    assert info["source"] == "shipped"
    assert model.state_sha256(net.state_dict()) == meta["weights_sha256"] == info["weights_sha256"]


def test_another_key_does_not_use_the_shipped_weights():
    key = _default_key()
    assert warmstart.load_shipped(PRESETS["tiny-qwen3-gsm8k"].config, load_vocab(), 1, {**key, "seed": 1}) is None
    other = {**key, "recipe": {**key["recipe"], "steps": 3}}
    assert warmstart.load_shipped(PRESETS["tiny-qwen3-gsm8k"].config, load_vocab(), 0, other) is None


def test_a_shipped_asset_that_fails_its_sha256_is_refused(tmp_path, monkeypatch):
    wfile, mfile = warmstart.asset_paths()
    bad_w, bad_m = tmp_path / wfile.name, tmp_path / mfile.name
    state = torch.load(wfile, weights_only=True)
    next(iter(state.values())).add_(1e-3)
    torch.save(state, bad_w)
    shutil.copy(mfile, bad_m)
    monkeypatch.setattr(warmstart, "asset_paths", lambda version=warmstart.RECIPE_VERSION: (bad_w, bad_m))
    with pytest.raises(ValueError, match="shipped warm start .* fails its sha256 check"):
        warmstart.load_shipped(PRESETS["tiny-qwen3-gsm8k"].config, load_vocab(), 0, _default_key())
