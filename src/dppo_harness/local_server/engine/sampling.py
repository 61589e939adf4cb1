"""The batched KV-cache decode loop of the embedded server's tiny presets (docs/local-server.md
"Sampler"): every distinct prompt is prefilled alone and its KV copied, right-aligned, into its
samples' rows of preallocated buffers (`BufferLayer`), so a decode step writes one position; all
rows then decode together, compacted as rows finish. Draws are `draws.py`'s, per request generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin

from dppo_harness.local_server.engine.draws import draw
from dppo_harness.local_server.engine.model import token_logprobs


class BufferLayer(CacheLayerMixin):
    """KV-cache layer over a preallocated [B, H, cap, D] buffer (no per-step concatenation)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        self.kbuf, self.vbuf, self.len = keys, values, length
        self.is_initialized = True

    # keys / values are views of the buffers: read-only here, where the mixin declares attributes.
    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        return self.kbuf[:, :, : self.len]

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        return self.vbuf[:, :, : self.len]

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:  # pragma: no cover - prefilled
        raise RuntimeError("buffer layer is prefilled")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        self.kbuf[:, :, self.len : self.len + n] = key_states
        self.vbuf[:, :, self.len : self.len + n] = value_states
        self.len += n
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args: object) -> tuple[int, int]:
        return self.len + query_length, 0

    def get_seq_length(self, *args: object) -> int:
        return self.len

    def get_max_cache_shape(self, *args: object) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.kbuf, self.vbuf = self.kbuf[beam_idx], self.vbuf[beam_idx]


@dataclass
class DecodeRequest:
    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: list[int]
    stop_strings: list[str]
    seed: int
    want_prompt_lp: bool


@dataclass
class Decoded:
    tokens: list[int]  # the model's rows here; real ids once the engine returns them
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    prompt_logprobs: list[float | None] | None


@dataclass
class _Prefill:
    cache_R: Cache  # one row per sample, buffered to the batch's capacity
    last_logits_JV: torch.Tensor  # float32, in-vocabulary columns only
    mask_JL: torch.Tensor  # left-padded prompts
    prompt_lps: list[list[float | None] | None]


def _prefill(
    net: transformers.PreTrainedModel, reqs: Sequence[DecodeRequest], V: int, rows_idx: torch.Tensor, cap: int
) -> _Prefill:
    """Every prompt alone (batch 1, no padding); its KV is copied into its samples' rows of
    zeroed buffers, right-aligned at the longest prompt's end."""
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    J, Lp = len(reqs), max(len(r.prompt) for r in reqs)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    last: list[torch.Tensor] = []
    prompt_lps: list[list[float | None] | None] = []
    for r in reqs:
        ids_1L = torch.tensor([r.prompt], dtype=torch.int64)
        out = decoder(input_ids=ids_1L, use_cache=True)
        if not all(type(layer) is DynamicLayer for layer in out.past_key_values.layers):
            raise ValueError("the preset decode loop needs a pure-attention cache")
        logits_1LV = head(out.last_hidden_state)
        if r.want_prompt_lp:
            lp = token_logprobs(logits_1LV[:, :-1].float(), ids_1L[:, 1:], V)[0]
            prompt_lps.append([None] + lp.tolist())
        else:
            prompt_lps.append(None)
        last.append(logits_1LV[0, -1, :V].float())
        kv.append([(layer.keys, layer.values) for layer in out.past_key_values.layers])
    counts = torch.bincount(rows_idx, minlength=J).tolist()
    R = int(rows_idx.shape[0])
    mask_JL = torch.zeros((J, Lp), dtype=torch.int64)
    for j, r in enumerate(reqs):
        mask_JL[j, Lp - len(r.prompt) :] = 1
    layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin] = []  # what a transformers Cache holds
    for li in range(len(kv[0])):
        k0 = kv[0][li][0]
        kb = k0.new_zeros((R, k0.shape[1], cap, k0.shape[3]))
        vb = k0.new_zeros((R, k0.shape[1], cap, k0.shape[3]))
        row = 0
        for j, r in enumerate(reqs):  # rows of one request are contiguous
            k, v = kv[j][li]
            kb[row : row + counts[j], :, Lp - len(r.prompt) : Lp] = k
            vb[row : row + counts[j], :, Lp - len(r.prompt) : Lp] = v
            row += counts[j]
        layers.append(BufferLayer(kb, vb, Lp))
    return _Prefill(Cache(layers=layers), torch.stack(last), mask_JL, prompt_lps)


def generate(
    net: transformers.PreTrainedModel,
    reqs: Sequence[DecodeRequest],
    decode_text: Callable[[list[int]], str],
    vocab_size: int,
) -> list[list[Decoded]]:
    """All samples of all `reqs` (token ids are the model's rows) through the one batched decode
    loop (module docstring). Only the first `vocab_size` logits columns can be drawn (the presets'
    input-only unk row is never drawn). `decode_text` turns model ids into text for stop strings."""
    row_req = [j for j, r in enumerate(reqs) for _ in range(r.n)]  # rows of one request are contiguous
    R = len(row_req)
    Lp = max(len(r.prompt) for r in reqs)
    cap = Lp + max(r.max_tokens for r in reqs)
    rows_idx = torch.tensor(row_req, dtype=torch.int64)
    pre = _prefill(net, reqs, vocab_size, rows_idx, cap)
    attn_RC = torch.zeros((R, cap), dtype=torch.int64)
    attn_RC[:, :Lp] = pre.mask_JL[rows_idx]
    pos_R = torch.tensor([len(reqs[j].prompt) for j in row_req], dtype=torch.int64)
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    gens = [torch.Generator().manual_seed(r.seed) for r in reqs]
    stops = [set(r.stop_ids) for r in reqs]
    toks: list[list[int]] = [[] for _ in range(R)]
    lps: list[list[float]] = [[] for _ in range(R)]
    reason: list[str | None] = [None] * R  # "stop", "length"; None: never finished (counted as "length")
    logits_BV, cache = pre.last_logits_JV[rows_idx], pre.cache_R
    batch_rows = list(range(R))  # original row of each batch position; all running (finished ones are dropped)
    steps = 0
    while True:
        # one token per batch position: each request's rows drawn together from its own generator
        nxt_B = torch.zeros(len(batch_rows), dtype=torch.int64)
        b = 0
        while b < len(batch_rows):
            j, e = row_req[batch_rows[b]], b
            while e < len(batch_rows) and row_req[batch_rows[e]] == j:
                e += 1
            nxt_B[b:e] = draw(logits_BV[b:e], reqs[j], gens[j])
            b = e
        lp_B = torch.log_softmax(logits_BV, dim=-1).gather(-1, nxt_B.unsqueeze(-1)).squeeze(-1)
        nxt_list, lp_list = nxt_B.tolist(), lp_B.tolist()  # the step's one host sync
        for k, row in enumerate(batch_rows):  # a stop token or string, or the token budget, finishes a row
            r = reqs[row_req[row]]
            toks[row].append(nxt_list[k])
            lps[row].append(lp_list[k])
            if nxt_list[k] in stops[row_req[row]] or (
                r.stop_strings and _hits_stop_string(decode_text, toks[row], r.stop_strings)
            ):
                reason[row] = "stop"
            elif len(toks[row]) >= r.max_tokens:
                reason[row] = "length"
        steps += 1
        live_k = [k for k, row in enumerate(batch_rows) if reason[row] is None]
        if not live_k:
            break
        cur = Lp + steps
        if len(live_k) < len(batch_rows):
            kidx = torch.tensor(live_k, dtype=torch.int64)
            # transformers annotates the index with the legacy torch.LongTensor class; an int64 tensor is what it takes.
            cache.reorder_cache(kidx)  # type: ignore[arg-type]
            attn_RC, pos_R, nxt_B = attn_RC[kidx], pos_R[kidx], nxt_B[kidx]
            batch_rows = [batch_rows[k] for k in live_k]
        attn_RC[:, cur - 1] = 1
        out = decoder(
            input_ids=nxt_B.unsqueeze(-1),
            attention_mask=attn_RC[:, :cur],
            position_ids=pos_R.unsqueeze(-1),
            past_key_values=cache,
            use_cache=True,
        )
        logits_BV, cache = head(out.last_hidden_state[:, -1])[:, :vocab_size].float(), out.past_key_values
        pos_R = pos_R + 1
    results, row = [], 0
    for j, r in enumerate(reqs):
        results.append(
            [Decoded(toks[row + i], lps[row + i], reason[row + i] or "length", pre.prompt_lps[j]) for i in range(r.n)]
        )
        row += r.n
    return results


def _hits_stop_string(decode_text: Callable[[list[int]], str], toks: list[int], stop_strings: list[str]) -> bool:
    # The newest token can complete a stop string spanning at most a few earlier tokens.
    longest = max(len(s) for s in stop_strings)
    tail = decode_text(toks[-(longest + 1) :])
    return any(s in tail for s in stop_strings)
