"""Model side of the embedded Tinker-protocol server: training models, optimizer, checkpoints and
sampling on a tiny preset (docs/local-server.md "Model" to "Checkpoints").

``data`` is ``list[(input_tokens, loss_fn_inputs: dict[str, np.ndarray])]``; token ids are real
Qwen3.5 ids. Sampled-token logprobs are the untempered log-softmax (the trainer's distribution).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from tinker import types
from torch.nn.utils.rnn import pad_sequence

from dppo_harness.constants import BASE_MODEL
from dppo_harness.data.tokenizer import TmlQwen35Tokenizer
from dppo_harness.local_server.checkpoint_files import ADAPTER_FILE, checkpoint_dir
from dppo_harness.local_server.engine import model, sampling, warmstart
from dppo_harness.local_server.engine.logprobs import head_target_logprobs
from dppo_harness.local_server.engine.loss_fns import server_loss
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.vocab import get_tokenizer, load_vocab

if TYPE_CHECKING:
    import peft

DatumIn = tuple[Sequence[int], dict[str, np.ndarray]]
FwdBwdOut = tuple[list[dict[str, np.ndarray]], dict[str, float]]
LossConfigIn = Mapping[str, float | str] | None  # a request's loss_fn_config
Items = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]  # validated datums: local tokens, tensor inputs

TOKEN_BUDGET = 6144  # padded tokens per trainer micro-batch (bounds logits memory)
# Retained first passes (see Engine._run), engine-wide: their kept float32 logits and their number
# (a forward_backward_custom the SDK splits into chunks sends one forward per chunk).
RETAINED_LOGIT_BYTES = 1 << 30
MAX_RETAINED = 4
SAMPLER_CACHE_SIZE = 4  # sampler models (base, saved weights) kept merged at once
_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")


@dataclass(frozen=True)
class ModelPreset:
    served_name: str
    config: model.TinyConfig
    warm_start: bool


DEFAULT_PRESET = "tiny-qwen3-gsm8k"
PRESETS = {
    DEFAULT_PRESET: ModelPreset("local/tiny-qwen3-gsm8k", model.TinyConfig(), True),
    # Fast random-init model for unit tests of the protocol plumbing (no warm start).
    "tiny-qwen3-random": ModelPreset(
        "local/tiny-qwen3-random",
        model.TinyConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        ),
        False,
    ),
}


@dataclass
class TrainModel:
    model_id: str
    requested_base_model: str
    lora_rank: int
    seed: int
    net: peft.PeftModel
    params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.AdamW
    targets: tuple[str, ...]
    lock: threading.RLock = field(default_factory=threading.RLock)
    steps: int = 0


@dataclass
class RetainedForward:
    """A grad-mode forward of one request: its validated inputs and each micro-batch's logprobs
    (still attached to the graph), so a forward_backward on exactly these inputs runs only the
    backward. The logprobs are what a fresh grad-mode forward computes, bit for bit."""

    model_id: str
    items: Items
    microbatches: list[tuple[list[int], list[torch.Tensor]]]
    logit_bytes: int

    def matches(self, items: Items) -> bool:
        return len(items) == len(self.items) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1]["target_tokens"], b[1]["target_tokens"])
            for a, b in zip(items, self.items)
        )


def _atomic_dir_write(final: Path, files: dict[str, bytes], overwrite: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    for fname, data in files.items():
        (tmp / fname).write_bytes(data)
    if final.exists():
        if not overwrite:
            shutil.rmtree(tmp)
            raise UserError(f"checkpoint {final.name!r} already exists; pass overwrite=True to replace it")
        old = final.parent / f".old-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)


class Engine:
    def __init__(
        self,
        run_dir: Path,
        model_name: str = DEFAULT_PRESET,
        seed: int = 0,
        *,
        batch_window_s: float = 0.05,
        num_threads: int = 1,
        token_budget: int | None = None,
        retain_forward: bool = True,
    ):
        if model_name not in PRESETS:
            raise UserError(f"unknown local model {model_name!r}; choose one of {sorted(PRESETS)}")
        torch.set_num_threads(int(num_threads))
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.seed = int(seed)
        self.model_name = model_name
        self.preset = PRESETS[model_name]
        self.served_model_name = self.preset.served_name
        self.served_models = [BASE_MODEL, self.served_model_name]
        self.vocab = load_vocab()
        self.config = self.preset.config
        self.base_info: dict[str, Any]
        if self.preset.warm_start:
            self.base_model, self.base_info = warmstart.load_or_build(self.config, self.vocab, seed=self.seed)
        else:
            self.base_model = model.build_base_model(self.config, self.vocab.num_embeddings, self.seed)
            self.base_info = {"warm_start": None, "init_seed": self.seed}
        self.base_sha256 = model.state_sha256(self.base_model.state_dict())
        self.token_budget = int(token_budget or TOKEN_BUDGET)
        # Keep a zero-weight cross-entropy forward's graph for the forward_backward that follows on
        # the same inputs.
        self.retain_forward = bool(retain_forward)
        self.retained_stats = {"retained": 0, "reused": 0, "dropped": 0}
        self._retained: list[RetainedForward] = []
        self._retained_lock = threading.Lock()
        self._models: dict[str, TrainModel] = {}
        self._models_lock = threading.Lock()
        self._counter = 0
        self._sampler_cache: OrderedDict[str, transformers.PreTrainedModel] = OrderedDict()
        self._sampler_cache_lock = threading.Lock()
        self._batch_window_s = float(batch_window_s)
        self._queue: list[_SampleJob] = []
        self._queue_cv = threading.Condition()
        self._closed = False
        self._sampler_thread = threading.Thread(target=self._sampler_loop, name="engine-sampler", daemon=True)
        self._sampler_thread.start()

    @functools.cached_property
    def tokenizer(self) -> TmlQwen35Tokenizer:
        """The harness's offline Qwen3.5 tokenizer, built on first use (stop strings): it takes
        seconds to build and most runs stop on token ids alone, so the server starts without it."""
        return get_tokenizer()

    # ----- model lifecycle ------------------------------------------------------------------
    def create_model(
        self,
        base_model: str,
        lora_rank: int,
        seed: int | None,
        *,
        model_id: str | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> str:
        """LoRA of `lora_rank` on the linear layers the three switches select (Tinker's
        train_mlp / train_attn / train_unembed); AdamW over the LoRA parameters only."""
        targets = model.lora_targets(train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        if not targets:
            raise UserError("train_mlp, train_attn and train_unembed are all off: nothing to train")
        return self._create_model(base_model, lora_rank, seed, tuple(targets), model_id)

    def _create_model(
        self, base_model: str, lora_rank: int, seed: int | None, targets: tuple[str, ...], model_id: str | None
    ) -> str:
        if base_model not in self.served_models:
            raise UserError(
                f"base model {base_model!r} is not served by this local server; served: {self.served_models}"
            )
        if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 1 or lora_rank > 512:
            raise UserError(f"lora_rank must be an integer in [1, 512], got {lora_rank!r}")
        with self._models_lock:
            n = self._counter
            self._counter += 1
            model_id = model_id or f"local-model-{n}"
            if model_id in self._models:
                raise UserError(f"model id {model_id!r} already exists")
        # seed=None: derived from the server seed and the creation counter (deterministic per server run).
        lora_seed = int(seed) if seed is not None else self.seed * 1_000_003 + n
        net = model.add_lora(copy.deepcopy(self.base_model), lora_rank, lora_seed, targets)
        net.eval()  # no dropout anywhere; training mode is irrelevant for this model
        params = list(model.lora_named_parameters(net))
        tm = TrainModel(
            model_id,
            base_model,
            lora_rank,
            lora_seed,
            net,
            params,
            torch.optim.AdamW([q for _, q in params], lr=0.0),
            targets,
        )
        with self._models_lock:
            self._models[model_id] = tm
        return model_id

    def _get(self, model_id: str) -> TrainModel:
        tm = self._models.get(model_id)
        if tm is None:
            raise UserError(f"unknown model id {model_id!r}")
        return tm

    def unload_model(self, model_id: str) -> None:
        with self._models_lock:
            tm = self._models.pop(model_id, None)
        if tm is not None:
            self._drop_retained(model_id)

    # ----- trainer: validated datums, length-sorted micro-batches, target logprobs (the presets'
    # fused head), the registered losses, retained first passes, AdamW steps, parameter reads -----
    def _validate(self, data: Sequence[DatumIn], loss_fn: str) -> Items:
        required_inputs = server_loss(loss_fn).inputs  # UserError naming the supported losses
        if len(data) == 0:
            raise UserError("data is empty")
        out = []
        for i, (tokens, inputs) in enumerate(data):
            toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
            T = int(toks.size)
            if T == 0:
                raise UserError(f"datum {i}: empty model_input")
            if self.config.max_position_embeddings < T:
                raise UserError(f"datum {i}: {T} tokens exceed the model's {self.config.max_position_embeddings}")
            conv: dict[str, torch.Tensor] = {}
            for key in required_inputs:
                if key not in inputs or inputs[key] is None:
                    raise UserError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
                arr = np.asarray(inputs[key]).reshape(-1)
                if arr.size != T:
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has length {arr.size}, model_input has {T}")
                if key == "target_tokens":
                    conv[key] = self.vocab.to_local(arr.astype(np.int64))  # unknown ids: the unk row
                else:
                    t = torch.from_numpy(arr.astype(np.float32))
                    if not bool(torch.isfinite(t).all()):
                        raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has non-finite values")
                    conv[key] = t
            out.append((self.vocab.to_local(toks), conv))
        return out

    def _microbatches(self, items: Items) -> list[list[int]]:
        """Datum indices grouped into micro-batches of <= token_budget padded tokens; datums are
        visited in (stable) length order so padding stays small."""
        lengths = [int(it[0].numel()) for it in items]
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_max = 0
        for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
            new_max = max(cur_max, lengths[i])
            if cur and new_max * (len(cur) + 1) > self.token_budget:
                batches.append(cur)
                cur, new_max = [], lengths[i]
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
        return batches

    def _logprobs_mb(self, net: peft.PeftModel, items: Items, idx: list[int]) -> list[torch.Tensor]:
        lens = [int(items[i][0].numel()) for i in idx]
        ids_BT = pad_sequence([items[i][0] for i in idx], batch_first=True)  # right padding with 0
        tgt_BT = pad_sequence([items[i][1]["target_tokens"] for i in idx], batch_first=True)
        mask_BT = pad_sequence([torch.ones_like(items[i][0]) for i in idx], batch_first=True)
        kw = {"attention_mask": mask_BT} if min(lens) != max(lens) else {}
        causal = net.get_base_model()
        assert isinstance(causal, transformers.PreTrainedModel)  # the Qwen3 causal LM under the peft wrapper
        head = causal.get_output_embeddings()  # a plain or LoRA float32 Linear in every preset: fusable
        # The output head is most of the compute: run it fused, in row chunks, on the real
        # (unpadded) positions only; same values as `model.token_logprobs` over the full logits.
        hidden_BTH = causal.get_decoder()(input_ids=ids_BT, use_cache=False, **kw).last_hidden_state
        real_BT = mask_BT.bool()  # right padding: row-major order keeps each datum contiguous
        lp_N = head_target_logprobs(
            hidden_BTH[real_BT], tgt_BT[real_BT], head, self.vocab.size, oov_logprob=model.OOV_TARGET_LOGPROB
        )
        return list(lp_N.split(lens))

    def _run(
        self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: LossConfigIn, backward: bool
    ) -> FwdBwdOut:
        tm = self._get(model_id)
        loss = server_loss(loss_fn)
        cfg = loss.config(loss_fn_config)
        items = self._validate(data, loss_fn)
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(items)
        total = 0.0
        with tm.lock:
            reuse = self._take_retained(model_id, items) if backward and loss_fn == "cross_entropy" else None
            retain = not backward and self._retainable(items, loss_fn)
            kept: list[tuple[list[int], list[torch.Tensor]]] = []
            with torch.set_grad_enabled(backward or retain):
                plan = reuse.microbatches if reuse is not None else [(idx, None) for idx in self._microbatches(items)]
                for idx, lps in plan:
                    if lps is None:
                        lps = self._logprobs_mb(tm.net, items, idx)
                    if retain:
                        kept.append((idx, lps))
                    losses = [
                        loss.fn(lp, {k: v.to(lp.device) for k, v in items[i][1].items()}, cfg)
                        for lp, i in zip(lps, idx)
                    ]
                    mb_loss = torch.stack([loss_T.sum() for loss_T in losses]).sum()
                    if backward:
                        mb_loss.backward()
                    total += float(mb_loss.detach())
                    for lp, loss_T, i in zip(lps, losses, idx):
                        outputs[i] = {
                            "logprobs": lp.detach().float().cpu().numpy().copy(),
                            "elementwise_loss": loss_T.detach().float().cpu().numpy().copy(),
                        }
            if retain:
                self._keep_retained(RetainedForward(model_id, items, kept, self._logit_bytes(items)))
        return [o for o in outputs if o is not None], {"loss:sum": total}

    def _logit_bytes(self, items: Items) -> int:
        return 4 * self.vocab.size * sum(int(it[0].numel()) for it in items)

    def _retainable(self, items: Items, loss_fn: str) -> bool:
        """The SDK's first pass of forward_backward_custom: a cross-entropy forward with every
        weight zero (a forward with weights is never kept), small enough to keep."""
        return (
            self.retain_forward
            and loss_fn == "cross_entropy"
            and all(not bool(it[1]["weights"].any()) for it in items)
            and self._logit_bytes(items) <= RETAINED_LOGIT_BYTES
        )

    def _keep_retained(self, entry: RetainedForward) -> None:
        with self._retained_lock:
            self._retained.append(entry)
            self.retained_stats["retained"] += 1
            while (
                len(self._retained) > MAX_RETAINED or sum(e.logit_bytes for e in self._retained) > RETAINED_LOGIT_BYTES
            ):
                self._retained.pop(0)  # the oldest first
                self.retained_stats["dropped"] += 1

    def _take_retained(self, model_id: str, items: Items) -> RetainedForward | None:
        with self._retained_lock:
            for k, entry in enumerate(self._retained):
                if entry.model_id == model_id and entry.matches(items):
                    self.retained_stats["reused"] += 1
                    return self._retained.pop(k)
        return None

    def _drop_retained(self, model_id: str) -> None:
        """The model's weights change (or it goes): a kept graph no longer describes them."""
        with self._retained_lock:
            kept = [e for e in self._retained if e.model_id != model_id]
            self.retained_stats["dropped"] += len(self._retained) - len(kept)
            self._retained = kept

    def forward(
        self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: LossConfigIn = None
    ) -> FwdBwdOut:
        return self._run(model_id, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: LossConfigIn = None
    ) -> FwdBwdOut:
        """Forward + backward; LoRA gradients accumulate until ``optim_step``."""
        return self._run(model_id, data, loss_fn, loss_fn_config, backward=True)

    def optim_step(self, model_id: str, adam: Mapping[str, float]) -> dict[str, float]:
        """`adam`: `AdamParams` fields; the SDK's defaults fill those left out. The optimizer's
        hyperparameters are set from them at every step."""
        tm = self._get(model_id)
        p = types.AdamParams.model_validate(adam)
        lr, b1, b2, eps, wd, clip = p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm
        checks = [
            (lr >= 0 and math.isfinite(lr), "learning_rate >= 0"),
            (0 <= b1 < 1, "0 <= beta1 < 1"),
            (0 <= b2 < 1, "0 <= beta2 < 1"),
            (eps > 0, "eps > 0"),
            (wd >= 0, "weight_decay >= 0"),
            (clip >= 0, "grad_clip_norm >= 0 (0 = off)"),
        ]
        for ok, what in checks:
            if not ok:
                raise UserError(f"invalid adam_params: need {what}, got {adam}")
        with tm.lock:
            self._drop_retained(model_id)
            grads = [q.grad for _, q in tm.params if q.grad is not None]
            grad_norm = (
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
                if grads
                else 0.0
            )
            if clip > 0 and grads:
                torch.nn.utils.clip_grad_norm_([q for _, q in tm.params if q.grad is not None], clip)
            for g in tm.optimizer.param_groups:
                g.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
            tm.optimizer.step()
            tm.optimizer.zero_grad(set_to_none=True)
            tm.steps += 1
        return {
            "optim/learning_rate": lr,
            "optim/beta1": b1,
            "optim/beta2": b2,
            "optim/eps": eps,
            "optim/weight_decay": wd,
            "optim/grad_clip_norm": clip,
            "optim/grad_norm": grad_norm,
            "optim/step": float(tm.steps),
        }

    # ----- checkpoints ------------------------------------------------------------------------
    def _save(self, model_id: str, kind: str, name: str, overwrite: bool, with_optimizer: bool) -> str:
        tm = self._get(model_id)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            what = "checkpoint name" if kind == "weights" else "sampler weights name"
            raise UserError(f"{what} {name!r} must match {_NAME_RE.pattern}")
        with tm.lock:
            adapter = {n: q.detach().to("cpu", copy=True) for n, q in tm.params}
            files = {ADAPTER_FILE: model.tensor_bytes(adapter)}
            if with_optimizer:
                files["optimizer.pt"] = model.tensor_bytes(tm.optimizer.state_dict())
            meta = {
                "kind": kind,
                "name": name,
                "model_id": tm.model_id,
                "requested_base_model": tm.requested_base_model,
                "served_model": self.served_model_name,
                "lora_rank": tm.lora_rank,
                "lora_seed": tm.seed,
                "optimizer_steps": tm.steps,
                "lora_targets": list(tm.targets),
                "base_sha256": self.base_sha256,
                "created_unix": time.time(),
                "adapter_sha256": model.state_sha256(adapter),
            }
        files["meta.json"] = json.dumps(meta, indent=1).encode()
        path = f"tinker://{model_id}/{kind}/{name}"
        d = checkpoint_dir(self.run_dir, path)
        assert d is not None  # an engine model id has no "/", and the name passed _NAME_RE
        _atomic_dir_write(d, files, overwrite)
        with self._sampler_cache_lock:  # a cached sampler built from `path` is stale now
            self._sampler_cache.pop(path, None)
        return path

    def save_state(self, model_id: str, name: str, overwrite: bool = False) -> str:
        return self._save(model_id, "weights", name, overwrite, with_optimizer=True)

    def save_for_sampler(self, model_id: str, name: str | None = None, *, overwrite: bool = False) -> str:
        if name is None:
            name = f"sampler-{self._get(model_id).steps}-{secrets.token_hex(4)}"
        return self._save(model_id, "sampler_weights", name, overwrite, with_optimizer=False)

    def read_checkpoint(self, path: str) -> tuple[Path, dict]:
        """(its directory, what it says about itself): a restarted server still knows a checkpoint."""
        d = checkpoint_dir(self.run_dir, path)
        if d is None:
            raise UserError(f"malformed checkpoint path {path!r}; expected tinker://<model_id>/weights/<name>")
        if not (d / "meta.json").exists():
            raise UserError(f"checkpoint {path!r} not found")
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("base_sha256") != self.base_sha256:
            raise UserError(f"checkpoint {path!r} was saved on a different base model (base weights hash differs)")
        return d, meta

    def _load_adapter(self, d: Path, meta: dict) -> dict[str, torch.Tensor]:
        adapter = torch.load(d / ADAPTER_FILE, map_location="cpu", weights_only=True)
        if model.state_sha256(adapter) != meta.get("adapter_sha256"):
            raise UserError(f"checkpoint {d} fails its adapter sha256 check")
        return adapter

    def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        tm = self._get(model_id)
        d, meta = self.read_checkpoint(path)
        if meta["kind"] != "weights" and with_optimizer:
            raise UserError(f"{path!r} is sampler weights: it has no optimizer state")
        if int(meta["lora_rank"]) != tm.lora_rank:
            raise UserError(f"checkpoint rank {meta['lora_rank']} != model rank {tm.lora_rank}")
        adapter = self._load_adapter(d, meta)
        with tm.lock:
            self._drop_retained(model_id)
            if sorted(adapter) != sorted(n for n, _ in tm.params):
                raise UserError(f"checkpoint {path!r} parameter names do not match the model")
            with torch.no_grad():
                for n, q in tm.params:
                    q.copy_(adapter[n])
                    q.grad = None
            tm.optimizer = torch.optim.AdamW([q for _, q in tm.params], lr=0.0)
            tm.steps = 0
            if with_optimizer:
                tm.optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))
                tm.steps = int(meta.get("optimizer_steps", 0))

    def create_model_from_state(self, path: str, with_optimizer: bool, *, model_id: str | None = None) -> str:
        _, meta = self.read_checkpoint(path)
        targets = tuple(meta.get("lora_targets") or model.LORA_TARGETS)
        mid = self._create_model(
            meta["requested_base_model"], int(meta["lora_rank"]), int(meta["lora_seed"]), targets, model_id
        )
        try:
            self.load_state(mid, path, with_optimizer)
        except Exception:
            self.unload_model(mid)
            raise
        return mid

    # ----- sampling ---------------------------------------------------------------------------
    def _sampler_net(self, key: str) -> transformers.PreTrainedModel:
        with self._sampler_cache_lock:
            if key in self._sampler_cache:
                self._sampler_cache.move_to_end(key)
                return self._sampler_cache[key]
        if key == "base":
            net = copy.deepcopy(self.base_model)
        else:
            d, meta = self.read_checkpoint(key)
            adapter = self._load_adapter(d, meta)
            # The presets' output head has its own weight (not tied to the embedding), so merging
            # a LoRA delta into it leaves the input embedding alone.
            pm = model.add_lora(copy.deepcopy(self.base_model), int(meta["lora_rank"]), 0, meta.get("lora_targets"))
            with torch.no_grad():
                for n, q in model.lora_named_parameters(pm):
                    q.copy_(adapter[n])
            net = pm.merge_and_unload()
        net.eval()
        for q in net.parameters():
            q.requires_grad_(False)
        with self._sampler_cache_lock:
            self._sampler_cache[key] = net
            while len(self._sampler_cache) > SAMPLER_CACHE_SIZE:
                self._sampler_cache.popitem(last=False)
        return net

    def sample(
        self,
        sampler_path_or_base: str,
        prompt_tokens: Sequence[int],
        num_samples: int,
        max_tokens: int | None,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
        prompt_logprobs: bool = False,
    ) -> list[sampling.Decoded]:
        """Blocking; concurrent calls are batched together by the sampler thread."""
        if sampler_path_or_base in self.served_models:
            key = "base"
        elif sampler_path_or_base.startswith("tinker://"):
            self.read_checkpoint(sampler_path_or_base)  # validates now, with a clear error
            key = sampler_path_or_base
        else:
            raise UserError(f"cannot sample from {sampler_path_or_base!r}: not a served base model or tinker:// path")
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise UserError("prompt is empty")
        if not (isinstance(num_samples, int) and 1 <= num_samples <= 1024):
            raise UserError(f"num_samples must be an integer in [1, 1024], got {num_samples!r}")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.config.max_position_embeddings:
            raise UserError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context "
                f"{self.config.max_position_embeddings}"
            )
        if temperature is None or temperature < 0 or not math.isfinite(temperature):
            raise UserError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is None or (top_k != -1 and top_k < 1):
            raise UserError(f"top_k must be -1 (off) or >= 1, got {top_k!r}")
        if top_p is None or not (0 < top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {top_p!r}")
        V = self.vocab.size  # OOV stop ids map to the unk row, which is never drawn
        job = _SampleJob(
            key=key,
            prompt=self.vocab.to_local(prompt).tolist(),
            n=num_samples,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            stop_ids=[s for s in self.vocab.to_local([int(s) for s in stop_token_ids]).tolist() if s < V],
            stop_strings=[s for s in stop_strings if s],
            seed=int(secrets.randbits(63) if seed is None else seed),
            want_prompt_lp=bool(prompt_logprobs),
        )
        with self._queue_cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(job)
            self._queue_cv.notify()
        return job.future.result()

    def _sampler_loop(self) -> None:
        while True:
            with self._queue_cv:
                while not self._queue and not self._closed:
                    self._queue_cv.wait()
                if self._closed and not self._queue:
                    return
            time.sleep(self._batch_window_s)  # let concurrent requests join the batch
            with self._queue_cv:
                key = self._queue[0].key
                jobs = [j for j in self._queue if j.key == key]
                self._queue = [j for j in self._queue if j.key != key]
            try:
                results = self._decode_batch(self._sampler_net(key), jobs)
                for j, r in zip(jobs, results):
                    j.future.set_result(r)
            except Exception as e:
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)

    def _decode_batch(self, net: transformers.PreTrainedModel, jobs: list[_SampleJob]) -> list[list[sampling.Decoded]]:
        """Every sample of `jobs` (one sampler, their ids local) decoded together by the one decode
        loop (`sampling.generate`); the sampled ids are mapped back to real ones here."""
        with torch.no_grad():
            out = sampling.generate(
                net, jobs, lambda ids: self.tokenizer.decode(self.vocab.to_real(ids)), self.vocab.size
            )
        return [[dataclasses.replace(d, tokens=self.vocab.to_real(d.tokens)) for d in seqs] for seqs in out]

    def close(self) -> None:
        with self._queue_cv:
            self._closed = True
            self._queue_cv.notify_all()
        self._sampler_thread.join(timeout=10)


@dataclass
class _SampleJob(sampling.DecodeRequest):
    """One queued sample request: the decode request plus its cache key and result future."""

    key: str = ""
    future: Future = field(default_factory=Future)
