"""Model side of the embedded Tinker-protocol server: training models, optimizer, sampling.

Final signatures (docs/architecture.md contract; extensions are optional keyword args only):

    class UserError(Exception)
    @dataclass SampledSeq(tokens: list[int], logprobs: list[float], stop_reason: "stop"|"length",
                          prompt_logprobs: list[float | None] | None)
    class Engine:
        __init__(run_dir, model_name="tiny-qwen3-gsm8k", sampler_dtype=None, seed=0, *,
                 cache_dir=None, batch_window_s=0.05, num_threads=2,
                 model_path=None, device="auto", dtype=None, served_name=None, token_budget=None,
                 decode_mode="auto", linear_attention="auto", retain_forward=None)
        served_models: list[str]; served_model_name: str; model_name: str
        kernels: dict  # hf_model.kernel_report: implementation per layer type (fast kernels / torch fallback)
        retained_stats: dict[str, int]  # kept first passes: retained, reused, dropped
        create_model(base_model, lora_rank, seed, *, model_id=None, train_mlp=True, train_attn=True,
                     train_unembed=True) -> str
        get_info(model_id) -> dict  # model_name (served), model_id, is_lora, lora_rank,
                                    # optimizer_config {"type": "adamw"}, model_data, requested_base_model
        forward(model_id, data, loss_fn, loss_fn_config=None) -> (outputs, metrics)
        forward_backward(model_id, data, loss_fn, loss_fn_config=None) -> (outputs, metrics)
        optim_step(model_id, adam) -> dict[str, float]
        save_state(model_id, name, overwrite=False) -> "tinker://<model_id>/weights/<name>"
        save_for_sampler(model_id, name=None, *, overwrite=False) -> "tinker://<model_id>/sampler_weights/<name>"
        load_state(model_id, path, with_optimizer) -> None
        create_model_from_state(path, with_optimizer, *, model_id=None) -> str
        sample(sampler_path_or_base, prompt_tokens, num_samples, max_tokens, temperature, top_k,
               top_p, stop_token_ids, stop_strings, seed, prompt_logprobs) -> list[SampledSeq]
        compute_logprobs(model_id, data, *, grad=False) -> list[torch.Tensor]   # in-process tests
        direct_loss_grads(model_id, data, loss_of_logprobs) -> dict[str, torch.Tensor]  # parity reference
        get_parameter_grads(model_id) -> dict[str, torch.Tensor]
        get_parameters(model_id) -> dict[str, torch.Tensor]
        unload_model(model_id) -> None
        drop_retained(model_id) -> None  # free its kept first passes (the model's session ended)
        close() -> None

``data`` is ``list[(input_tokens, loss_fn_inputs: dict[str, np.ndarray])]``. Token ids are real
Qwen3.5 ids; prompt_logprobs (when requested) is on every returned sequence, first element None.
Sampled-token logprobs are the model's untempered log-softmax (the trainer's distribution),
whatever temperature/top_k/top_p shaped the draw; at temperature 1 without truncation they are
exactly the sampling distribution.

Two base-model backends: the tiny presets (restricted vocabulary, CPU, offline/CI default) and
`model_path=DIR`, a local Hugging Face Qwen3 / Qwen3.5 checkpoint with its full vocabulary on
CUDA or CPU (`hf_model.py`; chunked target logprobs, `logprobs.py`). Both sample through the one
batched decode loop of `sampling.py` (`DecodeSpec`: Gumbel-max for checkpoints, the presets'
multinomial draw for the presets).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dppo_harness.constants import BASE_MODEL
from dppo_harness.local_server import hf_model, model, sampling
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    chunked_target_logprobs,
    head_target_logprobs,
    lora_head_parts,
)
from dppo_harness.local_server.loss_fns import get_loss
from dppo_harness.local_server.vocab import Vocab, get_tokenizer, load_vocab

DatumIn = tuple[Sequence[int], dict[str, np.ndarray]]
FwdBwdOut = tuple[list[dict[str, np.ndarray]], dict[str, float]]

ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TOKEN_BUDGET = 6144  # padded tokens per trainer micro-batch (bounds logits memory)
# Retained first passes (see Engine._run), engine-wide: their kept float32 logits and their number
# (a forward_backward_custom the SDK splits into chunks sends one forward per chunk).
RETAINED_LOGIT_BYTES = 1 << 30
MAX_RETAINED = 4
CUDA_TOKEN_BUDGET = 16384  # --model-path on CUDA: logits are chunked, so the budget bounds activations only
_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    prompt_logprobs: list[float | None] | None = None


@dataclass(frozen=True)
class ModelPreset:
    served_name: str
    config: model.TinyConfig
    warm_start: bool


PRESETS = {
    "tiny-qwen3-gsm8k": ModelPreset("local/tiny-qwen3-gsm8k", model.TinyConfig(), True),
    # Fast random-init model for unit tests of the protocol plumbing (no warm start).
    "tiny-qwen3-random": ModelPreset(
        "local/tiny-qwen3-random",
        model.TinyConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32),
        False,
    ),
}


def preset_decode_spec(in_vocab: int) -> sampling.DecodeSpec:
    """The presets' draw and batching (multinomial, each prompt prefilled alone, compaction as soon
    as a row finishes): what they always computed, pinned bitwise by
    tests/integration/test_preset_fingerprint.py."""
    return sampling.DecodeSpec(vocab_size=in_vocab, draw="multinomial", prefill="each", compact_fraction=0.0)


@dataclass
class _TrainModel:
    model_id: str
    requested_base_model: str
    lora_rank: int
    seed: int
    net: torch.nn.Module
    params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.AdamW
    targets: tuple[str, ...] = tuple(model.LORA_TARGETS)
    lock: threading.RLock = field(default_factory=threading.RLock)
    steps: int = 0


@dataclass
class _RetainedForward:
    """A grad-mode forward of one request: its validated inputs and each micro-batch's logprobs
    (still attached to the graph), so a forward_backward on exactly these inputs runs only the
    backward. The logprobs are what a fresh grad-mode forward computes, bit for bit."""

    model_id: str
    items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    microbatches: list[tuple[list[int], list[torch.Tensor]]]
    logit_bytes: int

    def matches(self, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> bool:
        return len(items) == len(self.items) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1]["target_tokens"], b[1]["target_tokens"])
            for a, b in zip(items, self.items))


def _make_optimizer(params: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [p for _, p in params], lr=0.0, betas=(ADAM_DEFAULTS["beta1"], ADAM_DEFAULTS["beta2"]),
        eps=ADAM_DEFAULTS["eps"], weight_decay=0.0,
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
        model_name: str = "tiny-qwen3-gsm8k",
        sampler_dtype: str | None = None,
        seed: int = 0,
        *,
        cache_dir: Path | None = None,
        batch_window_s: float = 0.05,
        num_threads: int = 2,
        model_path: str | Path | None = None,
        device: str = "auto",
        dtype: str | None = None,
        served_name: str | None = None,
        token_budget: int | None = None,
        decode_mode: str = "auto",
        linear_attention: str = "auto",
        retain_forward: bool | None = None,
    ):
        if model_path is None and model_name not in PRESETS:
            raise UserError(f"unknown local model {model_name!r}; choose one of {sorted(PRESETS)}")
        if sampler_dtype not in (None, "float32", "bfloat16"):
            raise UserError(f"sampler_dtype must be 'float32' or 'bfloat16', got {sampler_dtype!r}")
        torch.set_num_threads(int(num_threads))
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.seed = int(seed)
        self.base_info: dict = {}
        self.checkpoint: hf_model.LoadedCheckpoint | None = None
        self.device = torch.device("cpu")
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS
        if decode_mode not in sampling.MODES:
            raise UserError(f"decode_mode must be one of {sampling.MODES}, got {decode_mode!r}")
        self.decode_mode = decode_mode  # sampling.generate's mode; "auto" = CUDA graph on CUDA, eager on CPU
        self.last_sample_stats: dict = {}
        if linear_attention not in ("auto", "torch"):
            raise UserError(f"linear_attention must be 'auto' or 'torch', got {linear_attention!r}")
        if model_path is not None:
            self._init_checkpoint(model_path, device, dtype, served_name, sampler_dtype)
            if linear_attention == "torch":  # transformers' torch fallback whatever kernels it found
                hf_model.use_torch_linear_attention(self.base_model)
        else:
            self.model_name = model_name
            self.preset = PRESETS[model_name]
            self.served_model_name = self.preset.served_name
            self.served_models = [BASE_MODEL, self.served_model_name]
            self.sampler_dtype = getattr(torch, sampler_dtype or "float32")
            self.vocab: Vocab | hf_model.FullVocab = load_vocab()
            self.tokenizer = get_tokenizer()
            self.config = self.preset.config
            self.base_model = self._load_base(cache_dir)
            self.base_sha256 = model.state_sha256(self.base_model.state_dict())
            self.decode_spec = preset_decode_spec(self.vocab.size)
        self.kernels = hf_model.kernel_report(self.base_model)  # which implementation each layer type runs
        default_budget = CUDA_TOKEN_BUDGET if self.device.type == "cuda" else TOKEN_BUDGET
        self.token_budget = int(token_budget or default_budget)
        self._sampler_cache_size = 4 if self.checkpoint is None else 2
        # Keep a zero-weight cross-entropy forward's graph for the forward_backward that follows on
        # the same inputs (default on the tiny presets; a checkpoint's activations can be large).
        self.retain_forward = self.checkpoint is None if retain_forward is None else bool(retain_forward)
        self.retained_stats = {"retained": 0, "reused": 0, "dropped": 0}
        self._retained: list[_RetainedForward] = []
        self._retained_lock = threading.Lock()
        self._models: dict[str, _TrainModel] = {}
        self._models_lock = threading.Lock()
        self._counter = 0
        self._sampler_cache: OrderedDict[tuple[str, str], torch.nn.Module] = OrderedDict()
        self._sampler_cache_lock = threading.Lock()
        self._batch_window_s = float(batch_window_s)
        self._queue: list[_SampleJob] = []
        self._queue_cv = threading.Condition()
        self._closed = False
        self._sampler_thread = threading.Thread(target=self._sampler_loop, name="engine-sampler", daemon=True)
        self._sampler_thread.start()

    # ----- base model -----------------------------------------------------------------------
    def _init_checkpoint(self, model_path, device: str, dtype: str | None, served_name: str | None,
                         sampler_dtype: str | None) -> None:
        """--model-path backend: full vocabulary, served under the checkpoint's name (or
        `served_name`); the stand-in identity (HTTP model_data.arch) is local/<dir name>."""
        ck = hf_model.load_checkpoint(model_path, device=device, dtype=dtype)  # CheckpointError: one line
        self.checkpoint = ck
        self.device = ck.device
        self.model_name = served_name or ck.name
        self.served_model_name = f"local/{ck.dir_name}"
        self.served_models = list(dict.fromkeys([BASE_MODEL, self.model_name, self.served_model_name]))
        # Sampler precision defaults to the checkpoint's dtype (bf16 on CUDA).
        self.sampler_dtype = getattr(torch, sampler_dtype) if sampler_dtype else ck.dtype
        self.vocab = hf_model.FullVocab(ck.vocab_size)
        self.decode_spec = sampling.DecodeSpec(vocab_size=ck.vocab_size)
        self.tokenizer = self._checkpoint_tokenizer(ck)
        self.config = hf_model.ContextConfig(ck.max_position_embeddings)
        self.base_model = ck.net
        self.base_sha256 = ck.identity_sha256
        self.base_info = {"checkpoint": str(ck.path), "checkpoint_name": ck.name, "model_type": ck.model_type,
                          "device": str(ck.device), "dtype": str(ck.dtype).removeprefix("torch."),
                          "vocab_size": ck.vocab_size, "identity_sha256": ck.identity_sha256}

    @staticmethod
    def _checkpoint_tokenizer(ck: hf_model.LoadedCheckpoint):
        """The checkpoint's own tokenizer when it ships one (for stop strings), else the
        harness's offline Qwen3.5 tokenizer."""
        if any((ck.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            try:
                import transformers

                return transformers.AutoTokenizer.from_pretrained(ck.path, local_files_only=True)
            except (OSError, ValueError):
                pass
        return get_tokenizer()

    def _decode_text(self, ids: list[int]) -> str:
        """Text of model ids for stop-string checks; ids the tokenizer cannot decode (padding rows
        of the embedding) are skipped."""
        try:
            return self.tokenizer.decode(ids)
        except ValueError:
            out = []
            for i in ids:
                try:
                    out.append(self.tokenizer.decode([i]))
                except ValueError:
                    continue
            return "".join(out)

    def _load_base(self, cache_dir: Path | None) -> torch.nn.Module:
        if self.preset.warm_start:
            from dppo_harness.local_server import warmstart

            net, info = warmstart.load_or_build(self.config, self.vocab, seed=self.seed, cache_dir=cache_dir)
            self.base_info = info
            return net
        net = model.build_base_model(self.config, self.vocab.num_embeddings, self.seed)
        self.base_info = {"warm_start": None, "init_seed": self.seed}
        return net

    # ----- model lifecycle ------------------------------------------------------------------
    def _check_base(self, base_model: str) -> None:
        if base_model not in self.served_models:
            raise UserError(
                f"base model {base_model!r} is not served by this local server; served: {self.served_models}"
            )

    def create_model(self, base_model: str, lora_rank: int, seed: int | None, *, model_id: str | None = None,
                     train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True) -> str:
        """LoRA of `lora_rank` on the linear layers the three switches select (Tinker's
        train_mlp / train_attn / train_unembed); AdamW over the LoRA parameters only."""
        targets = hf_model.lora_targets(self.base_model, train_attn=train_attn, train_mlp=train_mlp,
                                  train_unembed=train_unembed)
        if not targets:
            raise UserError("train_mlp, train_attn and train_unembed are all off: nothing to train")
        return self._create_model(base_model, lora_rank, seed, tuple(targets), model_id)

    def _create_model(self, base_model: str, lora_rank: int, seed: int | None, targets: tuple[str, ...],
                      model_id: str | None) -> str:
        self._check_base(base_model)
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
        tm = _TrainModel(model_id, base_model, lora_rank, lora_seed, net, params, _make_optimizer(params), targets)
        with self._models_lock:
            self._models[model_id] = tm
        return model_id

    def _get(self, model_id: str) -> _TrainModel:
        tm = self._models.get(model_id)
        if tm is None:
            raise UserError(f"unknown model id {model_id!r}")
        return tm

    def unload_model(self, model_id: str) -> None:
        with self._models_lock:
            tm = self._models.pop(model_id, None)
        if tm is not None:
            self._drop_retained(model_id)

    def get_info(self, model_id: str) -> dict:
        tm = self._get(model_id)
        return {
            "model_name": self.served_model_name,
            "model_id": model_id,
            "is_lora": True,
            "lora_rank": tm.lora_rank,
            "optimizer_config": {"type": "adamw"},
            "model_data": {
                "arch": type(self.base_model).__name__,
                "model_name": self.served_model_name,
                "tokenizer_id": BASE_MODEL,
            },
            "requested_base_model": tm.requested_base_model,
        }

    # ----- trainer --------------------------------------------------------------------------
    def _validate(self, data: Sequence[DatumIn], loss_fn: str) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        required_inputs = get_loss(loss_fn).inputs  # UserError naming the supported losses
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
                    conv[key] = self._to_local(arr.astype(np.int64), f"datum {i}: loss_fn_inputs['target_tokens']")
                else:
                    t = torch.from_numpy(arr.astype(np.float32))
                    if not bool(torch.isfinite(t).all()):
                        raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has non-finite values")
                    conv[key] = t
            out.append((self._to_local(toks, f"datum {i}: model_input"), conv))
        return out

    def _to_local(self, ids, what: str) -> torch.Tensor:
        try:
            return self.vocab.to_local(ids)
        except ValueError as exc:  # full vocabulary: ids outside the model's rows
            raise UserError(f"{what}: {exc}") from None

    def _microbatches(self, lengths: list[int]) -> list[list[int]]:
        """Datum indices grouped into micro-batches of <= TOKEN_BUDGET padded tokens; datums are
        visited in (stable) length order so padding stays small."""
        batches, cur, cur_max = [], [], 0
        for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
            L = lengths[i]
            new_max = max(cur_max, L)
            if cur and new_max * (len(cur) + 1) > self.token_budget:
                batches.append(cur)
                cur, new_max = [], L
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
        return batches

    def _logprobs_mb(self, net: torch.nn.Module, items: list[tuple[torch.Tensor, dict]], idx: list[int]) -> list[torch.Tensor]:
        lens = [int(items[i][0].numel()) for i in idx]
        Tm = max(lens)
        ids_BT = torch.zeros((len(idx), Tm), dtype=torch.int64)
        tgt_BT = torch.zeros((len(idx), Tm), dtype=torch.int64)
        mask_BT = torch.zeros((len(idx), Tm), dtype=torch.int64)
        for b, i in enumerate(idx):
            L = lens[b]
            ids_BT[b, :L] = items[i][0]
            tgt_BT[b, :L] = items[i][1]["target_tokens"]
            mask_BT[b, :L] = 1
        if self.checkpoint is not None:
            return self._logprobs_hf(net, ids_BT, tgt_BT, mask_BT, lens)
        kw = {"attention_mask": mask_BT} if min(lens) != Tm else {}
        causal = net.get_base_model() if hasattr(net, "get_base_model") else net
        head = causal.get_output_embeddings()
        if lora_head_parts(head) is None:
            logits_BTV = net(input_ids=ids_BT, use_cache=False, **kw).logits
            lp_BT = model.token_logprobs(logits_BTV, tgt_BT, self.vocab.size)
            return [lp_BT[b, : lens[b]] for b in range(len(idx))]
        # The output head is most of the compute: run it fused, in row chunks, on the real
        # (unpadded) positions only; same values as the logits path above.
        hidden_BTH = causal.get_decoder()(input_ids=ids_BT, use_cache=False, **kw).last_hidden_state
        real_BT = mask_BT.bool()  # right padding: row-major order keeps each datum contiguous
        lp_N = head_target_logprobs(hidden_BTH[real_BT], tgt_BT[real_BT], head, self.vocab.size,
                                    oov_logprob=model.OOV_TARGET_LOGPROB)
        return list(lp_N.split(lens))

    def _logprobs_hf(self, net: torch.nn.Module, ids_BT: torch.Tensor, tgt_BT: torch.Tensor, mask_BT: torch.Tensor,
                     lens: list[int]) -> list[torch.Tensor]:
        """Full vocabulary: the decoder's hidden states at the real (unpadded) positions, then the
        target log-softmax in token chunks (never a [B, T, V] float32 logits tensor)."""
        causal = net.get_base_model() if hasattr(net, "get_base_model") else net
        dev = self.device
        ids_BT, tgt_BT, mask_BT = ids_BT.to(dev), tgt_BT.to(dev), mask_BT.to(dev)
        kw = {"attention_mask": mask_BT} if min(lens) != ids_BT.shape[1] else {}
        hidden_BTH = causal.get_decoder()(input_ids=ids_BT, use_cache=False, **kw).last_hidden_state
        real_BT = mask_BT.bool()  # right padding: row-major order keeps each datum contiguous
        lp_N = chunked_target_logprobs(hidden_BTH[real_BT], tgt_BT[real_BT], causal.get_output_embeddings(),
                                       self.chunk_tokens)
        return list(lp_N.split(lens))

    @staticmethod
    def _loss(loss_fn: str, lp_T: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
        return get_loss(loss_fn).fn(lp_T, inp, cfg)

    @staticmethod
    def _loss_cfg(loss_fn: str, loss_fn_config: dict | None) -> dict:
        return get_loss(loss_fn).config(loss_fn_config)

    def _run(self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: dict | None,
             backward: bool) -> FwdBwdOut:
        tm = self._get(model_id)
        cfg = self._loss_cfg(loss_fn, loss_fn_config)
        items = self._validate(data, loss_fn)
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(items)
        total = 0.0
        with tm.lock:
            reuse = self._take_retained(model_id, items) if backward and loss_fn == "cross_entropy" else None
            retain = not backward and self._retainable(items, loss_fn)
            kept: list[tuple[list[int], list[torch.Tensor]]] = []
            with torch.set_grad_enabled(backward or retain):
                plan = reuse.microbatches if reuse is not None else [
                    (idx, None) for idx in self._microbatches([int(it[0].numel()) for it in items])]
                for idx, lps in plan:
                    if lps is None:
                        lps = self._logprobs_mb(tm.net, items, idx)
                    if retain:
                        kept.append((idx, lps))
                    losses = [self._loss(loss_fn, lp, {k: v.to(lp.device) for k, v in items[i][1].items()}, cfg)
                              for lp, i in zip(lps, idx)]
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
                self._keep_retained(_RetainedForward(model_id, items, kept, self._logit_bytes(items)))
        return [o for o in outputs if o is not None], {"loss:sum": total}

    # ----- retained first passes (forward_backward_custom's forward, then its backward) -------
    def _logit_bytes(self, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> int:
        return 4 * self.vocab.size * sum(int(it[0].numel()) for it in items)

    def _retainable(self, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]], loss_fn: str) -> bool:
        """The SDK's first pass of forward_backward_custom: a cross-entropy forward with every
        weight zero (a forward with weights is never kept), small enough to keep."""
        return (self.retain_forward and loss_fn == "cross_entropy"
                and all(not bool(it[1]["weights"].any()) for it in items)
                and self._logit_bytes(items) <= RETAINED_LOGIT_BYTES)

    def _keep_retained(self, entry: _RetainedForward) -> None:
        with self._retained_lock:
            self._retained.append(entry)
            self.retained_stats["retained"] += 1
            while len(self._retained) > MAX_RETAINED or sum(e.logit_bytes for e in self._retained) > RETAINED_LOGIT_BYTES:
                self._retained.pop(0)  # the oldest first
                self.retained_stats["dropped"] += 1

    def _take_retained(self, model_id: str, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
                       ) -> _RetainedForward | None:
        with self._retained_lock:
            for k, entry in enumerate(self._retained):
                if entry.model_id == model_id and entry.matches(items):
                    self.retained_stats["reused"] += 1
                    return self._retained.pop(k)
        return None

    def drop_retained(self, model_id: str) -> None:
        """Free the model's kept first passes (its session ended: no second pass will come)."""
        self._drop_retained(model_id)

    def _drop_retained(self, model_id: str) -> None:
        """The model's weights change (or it goes): a kept graph no longer describes them."""
        with self._retained_lock:
            kept = [e for e in self._retained if e.model_id != model_id]
            self.retained_stats["dropped"] += len(self._retained) - len(kept)
            self._retained = kept

    def forward(self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: dict | None = None) -> FwdBwdOut:
        return self._run(model_id, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, model_id: str, data: Sequence[DatumIn], loss_fn: str,
                         loss_fn_config: dict | None = None) -> FwdBwdOut:
        """Forward + backward; LoRA gradients accumulate until ``optim_step``."""
        return self._run(model_id, data, loss_fn, loss_fn_config, backward=True)

    def compute_logprobs(self, model_id: str, data: Sequence[DatumIn], *, grad: bool = False) -> list[torch.Tensor]:
        """Per-datum target logprobs exactly as ``forward`` computes them (graph kept if grad)."""
        tm = self._get(model_id)
        only_targets = [(t, {"target_tokens": inp["target_tokens"], "weights": np.zeros(len(t), np.float32)})
                        if "target_tokens" in inp else (t, inp) for t, inp in data]
        items = self._validate(only_targets, "cross_entropy")
        out: list[torch.Tensor | None] = [None] * len(items)
        with tm.lock, torch.set_grad_enabled(grad):
            for idx in self._microbatches([int(it[0].numel()) for it in items]):
                for lp, i in zip(self._logprobs_mb(tm.net, items, idx), idx):
                    out[i] = lp
        return [o for o in out if o is not None]

    def optim_step(self, model_id: str, adam: dict) -> dict[str, float]:
        tm = self._get(model_id)
        if "learning_rate" not in adam:
            raise UserError("optim_step needs adam_params.learning_rate")
        p = {**ADAM_DEFAULTS, **{k: v for k, v in adam.items() if v is not None}}
        unknown = set(p) - set(ADAM_DEFAULTS) - {"learning_rate"}
        if unknown:
            raise UserError(f"unknown adam_params fields {sorted(unknown)}")
        lr, b1, b2, eps, wd, clip = (float(p[k]) for k in
                                     ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"))
        checks = [(lr >= 0 and math.isfinite(lr), "learning_rate >= 0"), (0 <= b1 < 1, "0 <= beta1 < 1"),
                  (0 <= b2 < 1, "0 <= beta2 < 1"), (eps > 0, "eps > 0"), (wd >= 0, "weight_decay >= 0"),
                  (clip >= 0, "grad_clip_norm >= 0 (0 = off)")]
        for ok, what in checks:
            if not ok:
                raise UserError(f"invalid adam_params: need {what}, got {adam}")
        with tm.lock:
            self._drop_retained(model_id)
            grads = [q.grad for _, q in tm.params if q.grad is not None]
            grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
            if clip > 0 and grads:
                torch.nn.utils.clip_grad_norm_([q for _, q in tm.params if q.grad is not None], clip)
            for g in tm.optimizer.param_groups:
                g.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
            tm.optimizer.step()
            tm.optimizer.zero_grad(set_to_none=True)
            tm.steps += 1
        return {"optim/learning_rate": lr, "optim/beta1": b1, "optim/beta2": b2, "optim/eps": eps,
                "optim/weight_decay": wd, "optim/grad_clip_norm": clip, "optim/grad_norm": grad_norm,
                "optim/step": float(tm.steps)}

    def direct_loss_grads(self, model_id: str, data: Sequence[DatumIn],
                          loss_of_logprobs: Callable[[list[torch.Tensor]], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gradient of ``loss_of_logprobs(per-datum target logprobs)`` w.r.t. the LoRA parameters by
        plain autograd through the model (no accumulation into ``.grad``): the reference the
        two-pass ``forward_backward_custom`` path must reproduce."""
        tm = self._get(model_id)
        with tm.lock:
            lps = self.compute_logprobs(model_id, data, grad=True)
            loss = loss_of_logprobs(lps)
            grads = torch.autograd.grad(loss, [q for _, q in tm.params], allow_unused=True)
        return {n: (g if g is not None else torch.zeros_like(q)).detach() for (n, q), g in zip(tm.params, grads)}

    def get_parameter_grads(self, model_id: str) -> dict[str, torch.Tensor]:
        tm = self._get(model_id)
        with tm.lock:
            return {n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q)) for n, q in tm.params}

    def get_parameters(self, model_id: str) -> dict[str, torch.Tensor]:
        tm = self._get(model_id)
        with tm.lock:
            return {n: q.detach().clone() for n, q in tm.params}

    # ----- checkpoints ----------------------------------------------------------------------
    def _ckpt_dir(self, model_id: str, kind: str, name: str) -> Path:
        safe_id = model_id.replace("/", "_")
        return self.run_dir / "checkpoints" / safe_id / kind / name

    def _parse_path(self, path: str) -> tuple[str, str, str]:
        m = re.match(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$", path or "")
        if not m:
            raise UserError(f"malformed checkpoint path {path!r}; expected tinker://<model_id>/weights/<name>")
        return m.group(1), m.group(2), m.group(3)

    def _meta(self, tm: _TrainModel, kind: str, name: str) -> dict:
        return {"kind": kind, "name": name, "model_id": tm.model_id, "requested_base_model": tm.requested_base_model,
                "served_model": self.served_model_name, "lora_rank": tm.lora_rank, "lora_seed": tm.seed, "optimizer_steps": tm.steps,
                "lora_targets": list(tm.targets),
                "base_sha256": self.base_sha256, "created_unix": time.time()}

    def save_state(self, model_id: str, name: str, overwrite: bool = False) -> str:
        tm = self._get(model_id)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UserError(f"checkpoint name {name!r} must match {_NAME_RE.pattern}")
        with tm.lock:
            adapter = {n: q.detach().to("cpu", copy=True) for n, q in tm.params}
            files = {"adapter.pt": model.tensor_bytes(adapter),
                     "optimizer.pt": model.tensor_bytes(tm.optimizer.state_dict())}
            meta = self._meta(tm, "weights", name) | {"adapter_sha256": model.state_sha256(adapter)}
        files["meta.json"] = json.dumps(meta, indent=1).encode()
        _atomic_dir_write(self._ckpt_dir(model_id, "weights", name), files, overwrite)
        path = f"tinker://{model_id}/weights/{name}"
        self._forget_sampler(path)
        return path

    def save_for_sampler(self, model_id: str, name: str | None = None, *, overwrite: bool = False) -> str:
        tm = self._get(model_id)
        if name is None:
            name = f"sampler-{tm.steps}-{secrets.token_hex(4)}"
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UserError(f"sampler weights name {name!r} must match {_NAME_RE.pattern}")
        with tm.lock:
            adapter = {n: q.detach().to("cpu", copy=True) for n, q in tm.params}
            meta = self._meta(tm, "sampler_weights", name) | {"adapter_sha256": model.state_sha256(adapter)}
        files = {"adapter.pt": model.tensor_bytes(adapter), "meta.json": json.dumps(meta, indent=1).encode()}
        _atomic_dir_write(self._ckpt_dir(model_id, "sampler_weights", name), files, overwrite)
        path = f"tinker://{model_id}/sampler_weights/{name}"
        self._forget_sampler(path)
        return path

    def _forget_sampler(self, path: str) -> None:
        """Drop a cached sampler built from ``path`` (its bytes were just overwritten)."""
        with self._sampler_cache_lock:
            for k in [k for k in self._sampler_cache if k[0] == path]:
                del self._sampler_cache[k]

    def _read_ckpt(self, path: str) -> tuple[Path, dict]:
        mid, kind, name = self._parse_path(path)
        d = self._ckpt_dir(mid, kind, name)
        if not (d / "meta.json").exists():
            raise UserError(f"checkpoint {path!r} not found")
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("base_sha256") != self.base_sha256:
            raise UserError(f"checkpoint {path!r} was saved on a different base model (base weights hash differs)")
        return d, meta

    def _load_adapter(self, d: Path, meta: dict) -> dict[str, torch.Tensor]:
        adapter = torch.load(d / "adapter.pt", map_location="cpu", weights_only=True)
        if model.state_sha256(adapter) != meta.get("adapter_sha256"):
            raise UserError(f"checkpoint {d} fails its adapter sha256 check")
        return adapter

    def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        tm = self._get(model_id)
        d, meta = self._read_ckpt(path)
        if meta["kind"] != "weights" and with_optimizer:
            raise UserError(f"{path!r} is sampler weights: it has no optimizer state")
        if int(meta["lora_rank"]) != tm.lora_rank:
            raise UserError(f"checkpoint rank {meta['lora_rank']} != model rank {tm.lora_rank}")
        adapter = self._load_adapter(d, meta)
        with tm.lock:
            self._drop_retained(model_id)
            names = [n for n, _ in tm.params]
            if sorted(adapter) != sorted(names):
                raise UserError(f"checkpoint {path!r} parameter names do not match the model")
            with torch.no_grad():
                for n, q in tm.params:
                    q.copy_(adapter[n])
                    q.grad = None
            tm.optimizer = _make_optimizer(tm.params)
            if with_optimizer:
                tm.optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))
                tm.steps = int(meta.get("optimizer_steps", 0))
            else:
                tm.steps = 0

    def create_model_from_state(self, path: str, with_optimizer: bool, *, model_id: str | None = None) -> str:
        _, meta = self._read_ckpt(path)
        targets = tuple(meta.get("lora_targets") or model.LORA_TARGETS)
        mid = self._create_model(meta["requested_base_model"], int(meta["lora_rank"]), int(meta["lora_seed"]),
                                 targets, model_id)
        try:
            self.load_state(mid, path, with_optimizer)
        except Exception:
            self.unload_model(mid)
            raise
        return mid

    # ----- sampling -------------------------------------------------------------------------
    def _sampler_net(self, key: str) -> torch.nn.Module:
        dkey = (key, str(self.sampler_dtype))
        with self._sampler_cache_lock:
            if dkey in self._sampler_cache:
                self._sampler_cache.move_to_end(dkey)
                return self._sampler_cache[dkey]
        if key == "base" and self.checkpoint is not None and self.sampler_dtype == self.checkpoint.dtype:
            net = self.base_model  # frozen and never modified: no copy of a multi-GB model
        elif key == "base":
            net = copy.deepcopy(self.base_model)
        else:
            d, meta = self._read_ckpt(key)
            adapter = self._load_adapter(d, meta)
            base = copy.deepcopy(self.base_model)
            hf_model.untie_output_head(base)  # merging into a tied head would also change the embedding
            pm = model.add_lora(base, int(meta["lora_rank"]), 0, meta.get("lora_targets"))
            with torch.no_grad():
                for n, q in model.lora_named_parameters(pm):
                    q.copy_(adapter[n])
            net = pm.merge_and_unload()
        net = net.to(self.sampler_dtype).eval()
        for q in net.parameters():
            q.requires_grad_(False)
        with self._sampler_cache_lock:
            self._sampler_cache[dkey] = net
            while len(self._sampler_cache) > self._sampler_cache_size:
                self._sampler_cache.popitem(last=False)
        return net

    def sample(self, sampler_path_or_base: str, prompt_tokens: Sequence[int], num_samples: int, max_tokens: int,
               temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
               stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
               seed: int | None = None, prompt_logprobs: bool = False) -> list[SampledSeq]:
        """Blocking; concurrent calls are batched together by the sampler thread."""
        if sampler_path_or_base in self.served_models:
            key = "base"
        elif isinstance(sampler_path_or_base, str) and sampler_path_or_base.startswith("tinker://"):
            self._read_ckpt(sampler_path_or_base)  # validates now, with a clear error
            key = sampler_path_or_base
        else:
            raise UserError(f"cannot sample from {sampler_path_or_base!r}: not a served base model or tinker:// path")
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise UserError("prompt is empty")
        if self.checkpoint is not None:
            self._to_local(prompt, "prompt")
        if not (isinstance(num_samples, int) and 1 <= num_samples <= 1024):
            raise UserError(f"num_samples must be an integer in [1, 1024], got {num_samples!r}")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.config.max_position_embeddings:
            raise UserError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context "
                            f"{self.config.max_position_embeddings}")
        if temperature is None or temperature < 0 or not math.isfinite(temperature):
            raise UserError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is None or (top_k != -1 and top_k < 1):
            raise UserError(f"top_k must be -1 (off) or >= 1, got {top_k!r}")
        if top_p is None or not (0 < top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is None:
            seed = secrets.randbits(63)
        job = _SampleJob(key=key, prompt=prompt, n=num_samples, max_tokens=max_tokens, temperature=float(temperature),
                         top_k=int(top_k), top_p=float(top_p), stop_ids=[int(s) for s in (stop_token_ids or ())],
                         stop_strings=[s for s in (stop_strings or ()) if s], seed=int(seed), want_prompt_lp=bool(prompt_logprobs))
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

    def _decode_batch(self, net: torch.nn.Module, jobs: list[_SampleJob]) -> list[list[SampledSeq]]:
        """Every sample of `jobs` (one sampler) decoded together by the one decode loop
        (`sampling.generate`); the presets map their restricted vocabulary in and out here."""
        if self.checkpoint is not None:
            reqs = [self._request(j, j.prompt, [s for s in j.stop_ids if 0 <= s < self.vocab.size]) for j in jobs]
            decode_text, to_real = self._decode_text, list
        else:
            V = self.vocab.size  # OOV stop ids map to the unk row, which is never drawn
            reqs = [self._request(j, self.vocab.to_local(j.prompt).tolist(),
                                  [s for s in self.vocab.to_local(j.stop_ids).tolist() if s < V] if j.stop_ids else [])
                    for j in jobs]
            decode_text, to_real = self._preset_text, self.vocab.to_real
        stats: dict = {}
        with torch.no_grad():
            out = sampling.generate(net, reqs, decode_text, self.decode_spec, mode=self.decode_mode, stats=stats)
        self.last_sample_stats = stats
        return [[SampledSeq(to_real(d.tokens), d.logprobs, d.stop_reason, d.prompt_logprobs) for d in seqs]
                for seqs in out]

    @staticmethod
    def _request(job: _SampleJob, prompt: list[int], stop_ids: list[int]) -> sampling.DecodeRequest:
        fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(sampling.DecodeRequest)}
        return sampling.DecodeRequest(**{**fields, "prompt": prompt, "stop_ids": stop_ids})

    def _preset_text(self, local_ids: list[int]) -> str:
        return self.tokenizer.decode(self.vocab.to_real(local_ids))

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
