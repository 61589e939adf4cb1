"""Trainer side of the engine: forward / forward_backward over LoRA models, the retained first
passes of forward_backward_custom, optim_step (AdamW), gradient and parameter reads."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers

from dppo_harness.local_server.engine import model
from dppo_harness.local_server.engine.logprobs import head_target_logprobs, lora_head_parts
from dppo_harness.local_server.engine.loss_fns import server_loss
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.vocab import Vocab

if TYPE_CHECKING:
    import peft

DatumIn = tuple[Sequence[int], dict[str, np.ndarray]]
FwdBwdOut = tuple[list[dict[str, np.ndarray]], dict[str, float]]
LossConfigIn = Mapping[str, float | str] | None  # a request's loss_fn_config

ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TOKEN_BUDGET = 6144  # padded tokens per trainer micro-batch (bounds logits memory)
# Retained first passes (see TrainerMixin._run), engine-wide: their kept float32 logits and their number
# (a forward_backward_custom the SDK splits into chunks sends one forward per chunk).
RETAINED_LOGIT_BYTES = 1 << 30
MAX_RETAINED = 4


@dataclass
class TrainModel:
    model_id: str
    requested_base_model: str
    lora_rank: int
    seed: int
    net: peft.PeftModel
    params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.AdamW
    targets: tuple[str, ...] = tuple(model.LORA_TARGETS)
    lock: threading.RLock = field(default_factory=threading.RLock)
    steps: int = 0


@dataclass
class RetainedForward:
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
            for a, b in zip(items, self.items)
        )


def causal_lm(net: torch.nn.Module) -> transformers.PreTrainedModel:
    """The causal LM under a peft wrapper (its base model), or `net` itself."""
    get_base_model = getattr(net, "get_base_model", None)
    causal = get_base_model() if get_base_model is not None else net
    if not isinstance(causal, transformers.PreTrainedModel):
        raise TypeError(f"{type(causal).__name__} is not a transformers causal LM")
    return causal


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [p for _, p in params],
        lr=0.0,
        betas=(ADAM_DEFAULTS["beta1"], ADAM_DEFAULTS["beta2"]),
        eps=ADAM_DEFAULTS["eps"],
        weight_decay=0.0,
    )


class TrainerMixin:
    """The trainer half of `Engine` (mixed into it): validated datums, length-sorted micro-batches,
    target logprobs (the presets' fused head), the registered losses,
    retained first passes, AdamW steps and parameter reads. `Engine.__init__` sets the attributes
    below; `_get` is `Engine`'s."""

    vocab: Vocab
    config: model.TinyConfig
    token_budget: int
    retain_forward: bool
    retained_stats: dict[str, int]
    _retained: list[RetainedForward]
    _retained_lock: threading.Lock

    if TYPE_CHECKING:

        def _get(self, model_id: str) -> TrainModel: ...

    def _validate(self, data: Sequence[DatumIn], loss_fn: str) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
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

    def _microbatches(self, lengths: list[int]) -> list[list[int]]:
        """Datum indices grouped into micro-batches of <= TOKEN_BUDGET padded tokens; datums are
        visited in (stable) length order so padding stays small."""
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_max = 0
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

    def _logprobs_mb(
        self, net: torch.nn.Module, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]], idx: list[int]
    ) -> list[torch.Tensor]:
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
        kw = {"attention_mask": mask_BT} if min(lens) != Tm else {}
        causal = causal_lm(net)
        head = causal.get_output_embeddings()
        if lora_head_parts(head) is None:
            logits_BTV = net(input_ids=ids_BT, use_cache=False, **kw).logits
            lp_BT = model.token_logprobs(logits_BTV, tgt_BT, self.vocab.size)
            return [lp_BT[b, : lens[b]] for b in range(len(idx))]
        # The output head is most of the compute: run it fused, in row chunks, on the real
        # (unpadded) positions only; same values as the logits path above.
        hidden_BTH = causal.get_decoder()(input_ids=ids_BT, use_cache=False, **kw).last_hidden_state
        real_BT = mask_BT.bool()  # right padding: row-major order keeps each datum contiguous
        lp_N = head_target_logprobs(
            hidden_BTH[real_BT], tgt_BT[real_BT], head, self.vocab.size, oov_logprob=model.OOV_TARGET_LOGPROB
        )
        return list(lp_N.split(lens))

    @staticmethod
    def _loss(loss_fn: str, lp_T: torch.Tensor, inp: dict[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
        return server_loss(loss_fn).fn(lp_T, inp, cfg)

    @staticmethod
    def _loss_cfg(loss_fn: str, loss_fn_config: LossConfigIn) -> dict[str, float]:
        return server_loss(loss_fn).config(loss_fn_config)

    def _run(
        self, model_id: str, data: Sequence[DatumIn], loss_fn: str, loss_fn_config: LossConfigIn, backward: bool
    ) -> FwdBwdOut:
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
                plan = (
                    reuse.microbatches
                    if reuse is not None
                    else [(idx, None) for idx in self._microbatches([int(it[0].numel()) for it in items])]
                )
                for idx, lps in plan:
                    if lps is None:
                        lps = self._logprobs_mb(tm.net, items, idx)
                    if retain:
                        kept.append((idx, lps))
                    losses = [
                        self._loss(loss_fn, lp, {k: v.to(lp.device) for k, v in items[i][1].items()}, cfg)
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

    # ----- retained first passes (forward_backward_custom's forward, then its backward) -------
    def _logit_bytes(self, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> int:
        return 4 * self.vocab.size * sum(int(it[0].numel()) for it in items)

    def _retainable(self, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]], loss_fn: str) -> bool:
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

    def _take_retained(
        self, model_id: str, items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    ) -> RetainedForward | None:
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

    def compute_logprobs(self, model_id: str, data: Sequence[DatumIn], *, grad: bool = False) -> list[torch.Tensor]:
        """Per-datum target logprobs exactly as ``forward`` computes them (graph kept if grad)."""
        tm = self._get(model_id)
        only_targets = [
            (t, {"target_tokens": inp["target_tokens"], "weights": np.zeros(len(t), np.float32)})
            if "target_tokens" in inp
            else (t, inp)
            for t, inp in data
        ]
        items = self._validate(only_targets, "cross_entropy")
        out: list[torch.Tensor | None] = [None] * len(items)
        with tm.lock, torch.set_grad_enabled(grad):
            for idx in self._microbatches([int(it[0].numel()) for it in items]):
                for lp, i in zip(self._logprobs_mb(tm.net, items, idx), idx):
                    out[i] = lp
        return [o for o in out if o is not None]

    def optim_step(self, model_id: str, adam: Mapping[str, float | None]) -> dict[str, float]:
        tm = self._get(model_id)
        if "learning_rate" not in adam:
            raise UserError("optim_step needs adam_params.learning_rate")
        p = {**ADAM_DEFAULTS, **{k: v for k, v in adam.items() if v is not None}}
        unknown = set(p) - set(ADAM_DEFAULTS) - {"learning_rate"}
        if unknown:
            raise UserError(f"unknown adam_params fields {sorted(unknown)}")
        lr, b1, b2, eps, wd, clip = (
            float(p[k]) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        )
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

    def direct_loss_grads(
        self, model_id: str, data: Sequence[DatumIn], loss_of_logprobs: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
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
