"""Deterministic warm start of the tiny model: a short supervised pass on GSM8K train solutions
(docs/local-server.md "Warm start"; RECIPE is part of the shipped asset's key).

Same config and seed -> same weights sha256 only on the same torch build and CPU kernels: 60
float32 steps amplify another CPU's summation order into another model, and the tests that pilot
it then measure a different stand-in. So the default preset's result ships with the package
(``assets/warmstart-<version>.pt`` beside its ``.json`` key and sha256) and is loaded wherever its
key, torch version aside, is the one asked for; any other config is built in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from torch.nn.utils.rnn import pad_sequence

from dppo_harness.data.sha256sums import DataIntegrityError, pinned_sha256
from dppo_harness.local_server.engine import model
from dppo_harness.local_server.vocab import Vocab, get_renderer, prompt_messages, read_jsonl, solution_reply

if TYPE_CHECKING:
    from tinker_cookbook.renderers import Renderer


log = logging.getLogger(__name__)
# Lines the server logs (stderr) with this marker are forwarded to the harness user by
# process.LocalServerProcess while it waits for the ready line (a config with no shipped model builds it).
PROGRESS_MARKER = "progress: "
PROGRESS_EVERY_S = 5.0

RECIPE_VERSION = "gsm8k-sft-v1"
RECIPE = {
    "version": RECIPE_VERSION,
    "steps": 60,
    "schedule_steps": 300,
    "batch_size": 8,
    "lr": 3e-3,
    "warmup_steps": 15,
    "final_lr_frac": 0.1,
    "betas": [0.9, 0.98],
    "eps": 1e-8,
    "weight_decay": 0.01,
    "grad_clip_norm": 1.0,
    "num_threads": 2,
}


def data_dir() -> Path:
    override = os.environ.get("DPPO_HARNESS_GSM8K_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "data" / "gsm8k"


def _train_sha256(ddir: Path) -> str:
    """sha256 of ``train.jsonl``; it must equal the value pinned in ``ddir/SHA256SUMS``."""
    got = hashlib.sha256((ddir / "train.jsonl").read_bytes()).hexdigest()
    pinned = pinned_sha256("train", ddir)
    if got != pinned:
        raise DataIntegrityError(f"{ddir / 'train.jsonl'} sha256 {got} != pinned {pinned} (SHA256SUMS)")
    return got


def config_key(config: model.TinyConfig, vocab: Vocab, seed: int, recipe: dict, train_sha: str) -> dict:
    return {
        "recipe": recipe,
        "model_config": config.to_dict(),
        "vocab_sha256": vocab.sha256,
        "num_embeddings": vocab.num_embeddings,
        "seed": int(seed),
        "train_sha256": train_sha,
        "torch": torch.__version__,
    }


def asset_paths(version: str = RECIPE_VERSION) -> tuple[Path, Path]:
    """(weights, meta) of the shipped warm start of ``version``."""
    adir = Path(__file__).resolve().parents[1] / "assets"
    return adir / f"warmstart-{version}.pt", adir / f"warmstart-{version}.json"


def shipped_key(key: dict) -> dict:
    """The part of a config key a shipped warm start must match: all of it but the torch version
    that loads it (the weights are data; the build's torch is recorded in the asset's meta)."""
    return {k: v for k, v in key.items() if k != "torch"}


def build_example(vocab: Vocab, renderer: Renderer, row: Mapping[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(local token ids [T], loss weights [T]) of one GSM8K train row."""
    msgs = prompt_messages(row["question"]) + [{"role": "assistant", "content": solution_reply(row["answer"])}]
    mi, w = renderer.build_supervised_example(msgs)
    return vocab.to_local(mi.to_ints()), torch.as_tensor(w, dtype=torch.float32)


def train(
    config: model.TinyConfig, vocab: Vocab, seed: int, recipe: dict, ddir: Path
) -> tuple[transformers.Qwen3ForCausalLM, dict]:
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(int(recipe["num_threads"]))
    try:
        t0 = time.time()
        rows = read_jsonl(ddir / "train.jsonl")
        gen = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(len(rows), generator=gen).tolist()
        steps, bs = int(recipe["steps"]), int(recipe["batch_size"])
        sched = int(recipe.get("schedule_steps", steps))  # cosine length; training may stop earlier
        examples = _visited_examples(vocab, rows, order, steps * bs)
        t_data = time.time() - t0
        _progress(f"warm start: {steps} supervised steps of {bs} examples ({t_data:.0f}s)")
        last_said = time.time()
        net = model.build_base_model(config, vocab.num_embeddings, seed)
        net.train()
        opt = torch.optim.AdamW(
            net.parameters(), recipe["lr"], tuple(recipe["betas"]), recipe["eps"], recipe["weight_decay"]
        )
        losses = []
        for step in range(steps):
            lr = _lr_at(step, recipe, sched)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = _padded_batch([examples[order[(step * bs + k) % len(order)]] for k in range(bs)])
            loss = _batch_loss(net, batch, vocab.size)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), recipe["grad_clip_norm"])
            opt.step()
            losses.append(float(loss.detach()))
            if time.time() - last_said >= PROGRESS_EVERY_S or step == steps - 1:
                last_said = time.time()
                _progress(
                    f"warm start: step {step + 1}/{steps} ({100 * (step + 1) / steps:.0f}%), loss "
                    f"{losses[-1]:.3f} ({last_said - t0:.0f}s)"
                )
        net.eval()
        info = {
            "data_seconds": t_data,
            "train_seconds": time.time() - t0 - t_data,
            "final_loss_mean_last10": sum(losses[-10:]) / len(losses[-10:]),
            "first_loss": losses[0],
        }
        return net, info
    finally:
        torch.set_num_threads(prev_threads)


def _visited_examples(
    vocab: Vocab, rows: list[dict[str, str]], order: list[int], n_examples: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The examples of the first `n_examples` positions of `order` (cycled), by row: only the rows
    the schedule visits are rendered."""
    renderer = get_renderer()
    visit = sorted({order[k % len(order)] for k in range(n_examples)})
    _progress(f"warm start: rendering {len(visit)} GSM8K train examples")
    return {i: build_example(vocab, renderer, rows[i]) for i in visit}


def _lr_at(step: int, recipe: dict, sched: int) -> float:
    """Linear warmup to the peak lr, then a cosine decay to `final_lr_frac` of it laid out over
    `sched` steps."""
    if step < recipe["warmup_steps"]:
        return recipe["lr"] * (step + 1) / recipe["warmup_steps"]
    frac = (step - recipe["warmup_steps"]) / max(1, sched - recipe["warmup_steps"])
    return recipe["lr"] * (
        recipe["final_lr_frac"] + (1 - recipe["final_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * frac))
    )


@dataclass(frozen=True)
class _PaddedBatch:
    """Examples right-padded to the longest one, T = its length - 1 (inputs predict the next token)."""

    ids_BT: torch.Tensor  # input tokens
    tgt_BT: torch.Tensor  # next tokens
    wts_BT: torch.Tensor  # loss weight of each target (0 on padding)
    att_BT: torch.Tensor  # attention mask


def _padded_batch(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> _PaddedBatch:
    columns = zip(*((t[:-1], t[1:], w[1:], torch.ones_like(t[1:])) for t, w in batch))
    return _PaddedBatch(*(pad_sequence(list(c), batch_first=True) for c in columns))  # right padding with 0


def _batch_loss(net: transformers.Qwen3ForCausalLM, batch: _PaddedBatch, vocab_size: int) -> torch.Tensor:
    """Weighted mean of the targets' negative logprobs over the loss positions."""
    # The unembedding (15k rows) dominates the cost: apply it only where the loss looks.
    hidden = net.model(input_ids=batch.ids_BT, attention_mask=batch.att_BT, use_cache=False).last_hidden_state
    sel = batch.wts_BT > 0
    logits = net.lm_head(hidden[sel]).unsqueeze(0)
    lp = model.token_logprobs(logits, batch.tgt_BT[sel].unsqueeze(0), vocab_size)[0]
    return -(lp * batch.wts_BT[sel]).sum() / batch.wts_BT[sel].sum()


def load_or_build(
    config: model.TinyConfig, vocab: Vocab, seed: int = 0, recipe: dict | None = None
) -> tuple[transformers.Qwen3ForCausalLM, dict]:
    """The warm-started base model (eval mode) and its provenance: the shipped one when its key is
    asked for, else built here (every preset the server starts, at its seed 0, is the shipped one;
    tests/unit/test_warmstart_shipped.py holds the asset to the recipe)."""
    recipe = dict(recipe or RECIPE)
    ddir = data_dir()
    if not (ddir / "train.jsonl").exists():
        raise FileNotFoundError(f"GSM8K train data not found at {ddir} (set DPPO_HARNESS_GSM8K_DIR)")
    key = config_key(config, vocab, seed, recipe, _train_sha256(ddir))
    shipped = load_shipped(config, vocab, seed, key)
    if shipped is not None:
        return shipped
    t0 = time.time()
    _progress("warm start: no shipped stand-in model for this config; building it (deterministic)")
    net, info = train(config, vocab, seed, recipe, ddir)
    _progress(f"warm start: built in {time.time() - t0:.0f}s")
    meta = {"key": key, "weights_sha256": model.state_sha256(net.state_dict()), "build_seconds": time.time() - t0}
    return net, meta | info | {"source": "built"}


def load_shipped(
    config: model.TinyConfig, vocab: Vocab, seed: int, key: dict
) -> tuple[transformers.Qwen3ForCausalLM, dict] | None:
    """The shipped warm start when its key is ``key`` (torch aside), sha256 checked; else None."""
    wfile, mfile = asset_paths(str(key["recipe"].get("version", "")))
    if not (wfile.exists() and mfile.exists()):
        return None
    meta = json.loads(mfile.read_text())
    if meta.get("key") != shipped_key(key):
        return None
    state = torch.load(wfile, map_location="cpu", weights_only=True)
    if model.state_sha256(state) != meta.get("weights_sha256"):
        raise ValueError(
            f"shipped warm start {wfile} fails its sha256 check {meta.get('weights_sha256')}; reinstall the package"
        )
    net = model.build_base_model(config, vocab.num_embeddings, seed)
    net.load_state_dict(state)
    net.eval()
    return net, meta | {"source": "shipped", "asset": wfile.name}


def write_shipped(net: torch.nn.Module, key: dict, info: dict) -> Path:
    """Write ``net`` as the shipped warm start of ``key`` (run once by whoever changes the recipe)."""
    wfile, mfile = asset_paths(str(key["recipe"]["version"]))
    state = net.state_dict()
    torch.save(state, wfile)
    meta = {
        "key": shipped_key(key),
        "weights_sha256": model.state_sha256(state),
        "built_with": {"torch": key["torch"], "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "final_loss_mean_last10": info.get("final_loss_mean_last10"),
        "first_loss": info.get("first_loss"),
    }
    mfile.write_text(json.dumps(meta, indent=1) + "\n")
    return wfile


def _progress(text: str) -> None:
    log.info("%s%s", PROGRESS_MARKER, text)
