"""Model side of the embedded Tinker-protocol server: training models, optimizer, sampling.

``data`` is ``list[(input_tokens, loss_fn_inputs: dict[str, np.ndarray])]``. Token ids are real
Qwen3.5 ids; prompt_logprobs (when requested) is on every returned sequence, first element None.
Sampled-token logprobs are the model's untempered log-softmax (the trainer's distribution),
whatever temperature/top_k/top_p shaped the draw; at temperature 1 without truncation they are
exactly the sampling distribution.

The base model is one of the tiny presets (`PRESETS`: a small Qwen3 over a restricted
vocabulary, on CPU); every sample goes through the batched decode loop of `sampling.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict

import torch
import transformers

from dppo_harness.constants import BASE_MODEL
from dppo_harness.local_server.engine import model, sampling, warmstart
from dppo_harness.local_server.engine.checkpoints import CheckpointsMixin
from dppo_harness.local_server.engine.trainer import (
    TOKEN_BUDGET,
    RetainedForward,
    TrainerMixin,
    TrainModel,
    make_optimizer,
)
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.vocab import Vocab, get_tokenizer, load_vocab


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    prompt_logprobs: list[float | None] | None = None


class TextDecoder(Protocol):
    """A tokenizer's decode, as the stop-string checks use it (a Hugging Face tokenizer declares a
    list of texts for a batch of sequences; one sequence decodes to one text)."""

    def decode(self, token_ids: list[int], /) -> str | list[str]: ...


def decoded_text(tokenizer: TextDecoder, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    if not isinstance(text, str):
        raise TypeError(f"decoding one sequence gave {type(text).__name__}, not text")
    return text


class ModelDataInfo(TypedDict):
    arch: str  # the class of the model really computing
    model_name: str  # the served stand-in name
    tokenizer_id: str


class ModelInfo(TypedDict):
    """`Engine.get_info`: one training model, as the HTTP get_info answer reads it."""

    model_name: str  # the served stand-in name
    model_id: str
    is_lora: bool
    lora_rank: int
    optimizer_config: dict[str, str]
    model_data: ModelDataInfo
    requested_base_model: str


SAMPLER_CACHE_SIZE = 4  # sampler models (base, saved weights) kept merged at once


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


class Engine(TrainerMixin, CheckpointsMixin):
    model_name: str
    served_model_name: str
    served_models: list[str]
    sampler_dtype: torch.dtype
    base_model: transformers.PreTrainedModel
    base_sha256: str
    preset: ModelPreset

    def __init__(
        self,
        run_dir: Path,
        model_name: str = DEFAULT_PRESET,
        sampler_dtype: str | None = None,
        seed: int = 0,
        *,
        cache_dir: Path | None = None,
        batch_window_s: float = 0.05,
        num_threads: int = 2,
        token_budget: int | None = None,
        retain_forward: bool = True,
    ):
        if model_name not in PRESETS:
            raise UserError(f"unknown local model {model_name!r}; choose one of {sorted(PRESETS)}")
        if sampler_dtype not in (None, "float32", "bfloat16"):
            raise UserError(f"sampler_dtype must be 'float32' or 'bfloat16', got {sampler_dtype!r}")
        torch.set_num_threads(int(num_threads))
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.seed = int(seed)
        self.base_info: dict = {}
        self.model_name = model_name
        self.preset = PRESETS[model_name]
        self.served_model_name = self.preset.served_name
        self.served_models = [BASE_MODEL, self.served_model_name]
        self.sampler_dtype = getattr(torch, sampler_dtype or "float32")
        self.vocab = load_vocab()
        self.config = self.preset.config
        self.base_model = self._load_base(cache_dir, self.vocab)
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
        self._sampler_cache: OrderedDict[tuple[str, str], transformers.PreTrainedModel] = OrderedDict()
        self._sampler_cache_lock = threading.Lock()
        self._batch_window_s = float(batch_window_s)
        self._queue: list[_SampleJob] = []
        self._queue_cv = threading.Condition()
        self._closed = False
        self._sampler_thread = threading.Thread(target=self._sampler_loop, name="engine-sampler", daemon=True)
        self._sampler_thread.start()

    # ----- base model -----------------------------------------------------------------------
    @functools.cached_property
    def tokenizer(self) -> TextDecoder:
        """The harness's offline Qwen3.5 tokenizer, built on first use (stop strings): it takes
        seconds to build and most runs stop on token ids alone, so the server starts without it."""
        return get_tokenizer()

    def _load_base(self, cache_dir: Path | None, vocab: Vocab) -> transformers.PreTrainedModel:
        if self.preset.warm_start:
            net, info = warmstart.load_or_build(self.preset.config, vocab, seed=self.seed, cache_dir=cache_dir)
            self.base_info = info
            return net
        net = model.build_base_model(self.preset.config, vocab.num_embeddings, self.seed)
        self.base_info = {"warm_start": None, "init_seed": self.seed}
        return net

    # ----- model lifecycle ------------------------------------------------------------------
    def _check_base(self, base_model: str) -> None:
        if base_model not in self.served_models:
            raise UserError(
                f"base model {base_model!r} is not served by this local server; served: {self.served_models}"
            )

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
        tm = TrainModel(model_id, base_model, lora_rank, lora_seed, net, params, make_optimizer(params), targets)
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

    def get_info(self, model_id: str) -> ModelInfo:
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
    # ----- sampling -------------------------------------------------------------------------
    def _sampler_net(self, key: str) -> transformers.PreTrainedModel:
        dkey = (key, str(self.sampler_dtype))
        with self._sampler_cache_lock:
            if dkey in self._sampler_cache:
                self._sampler_cache.move_to_end(dkey)
                return self._sampler_cache[dkey]
        if key == "base":
            net = copy.deepcopy(self.base_model)
        else:
            d, meta = self._read_ckpt(key)
            adapter = self._load_adapter(d, meta)
            # The presets' output head has its own weight (not tied to the embedding), so merging
            # a LoRA delta into it leaves the input embedding alone.
            pm = model.add_lora(copy.deepcopy(self.base_model), int(meta["lora_rank"]), 0, meta.get("lora_targets"))
            with torch.no_grad():
                for n, q in model.lora_named_parameters(pm):
                    q.copy_(adapter[n])
            net = pm.merge_and_unload()
        # transformers declares PreTrainedModel.to with functools.wraps(nn.Module.to): mypy reads it as
        # an unbound function that wants the model as its first argument.
        net = net.to(self.sampler_dtype).eval()  # type: ignore[arg-type]
        for q in net.parameters():
            q.requires_grad_(False)
        with self._sampler_cache_lock:
            self._sampler_cache[dkey] = net
            while len(self._sampler_cache) > SAMPLER_CACHE_SIZE:
                self._sampler_cache.popitem(last=False)
        return net

    def sample(
        self,
        sampler_path_or_base: str,
        prompt_tokens: Sequence[int],
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
        prompt_logprobs: bool = False,
    ) -> list[SampledSeq]:
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
        if seed is None:
            seed = secrets.randbits(63)
        job = _SampleJob(
            key=key,
            prompt=prompt,
            n=num_samples,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            stop_ids=[int(s) for s in (stop_token_ids or ())],
            stop_strings=[s for s in (stop_strings or ()) if s],
            seed=int(seed),
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

    def _decode_batch(self, net: transformers.PreTrainedModel, jobs: list[_SampleJob]) -> list[list[SampledSeq]]:
        """Every sample of `jobs` (one sampler) decoded together by the one decode loop
        (`sampling.generate`), the restricted vocabulary mapped in and out here."""
        V = self.vocab.size  # OOV stop ids map to the unk row, which is never drawn
        reqs = [
            self._request(
                j,
                self.vocab.to_local(j.prompt).tolist(),
                [s for s in self.vocab.to_local(j.stop_ids).tolist() if s < V] if j.stop_ids else [],
            )
            for j in jobs
        ]
        with torch.no_grad():
            out = sampling.generate(net, reqs, self._preset_text, V)
        return [
            [SampledSeq(self.vocab.to_real(d.tokens), d.logprobs, d.stop_reason, d.prompt_logprobs) for d in seqs]
            for seqs in out
        ]

    @staticmethod
    def _request(job: _SampleJob, prompt: list[int], stop_ids: list[int]) -> sampling.DecodeRequest:
        fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(sampling.DecodeRequest)}
        return sampling.DecodeRequest(**{**fields, "prompt": prompt, "stop_ids": stop_ids})

    def _preset_text(self, local_ids: list[int]) -> str:
        return decoded_text(self.tokenizer, self.vocab.to_real(local_ids))

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
