"""Batched KV-cache sampling for Hugging Face causal LMs (the `--model-path` backend).

Every sample of every request in a batch goes through one decode loop:
1. prefill the distinct prompts once, as one left-padded batch (attention mask + position ids);
2. copy each prompt's cache to its samples' rows (`Cache.reorder_cache` with repeated indices);
   pure-attention models (Qwen3) move their KV into preallocated buffers (`BufferLayer`), so a
   step writes one position instead of concatenating the whole cache;
3. decode all rows together; the output head runs on the last position only; finished rows stay
   in the batch until a quarter of it is finished, then the batch is compacted.

Decode modes (`generate(..., mode=)`): "dynamic" runs the steps above eagerly. "static" (Qwen3,
pure attention) gives every step the same shapes and no host values: attention covers the whole
preallocated cache under a boolean mask, the new KV is written at a position held in a device
tensor, finished rows stay in the batch. "graph" is "static" with the step captured once as a
CUDA graph and replayed (the decode of a 2B model is bound by CPU dispatch otherwise, see
gpu-anchor.md). "auto" = "graph" on CUDA for pure-attention models, else "dynamic"; a failed
capture falls back to "static" and says so in the returned stats.

Draws: temperature 0 is argmax; otherwise Gumbel-max, `argmax(logits / T - log E)` with
`E ~ Exp(1)` drawn from the request's own `torch.Generator` (seeded with the request seed, on
the model's device). That is an exact draw from softmax(logits / T) (after top_k / top_p),
costs one elementwise pass instead of softmax + multinomial over the vocabulary, and keeps the
seed's meaning: the same request alone, or with the same concurrent batch, gives the same tokens.
Per-token logprobs are the untempered log-softmax of the drawn token (the trainer's distribution).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from dppo_harness.local_server.logprobs import chunked_target_logprobs

COMPACT_FRACTION = 0.25  # compact the batch once this fraction of its rows has finished
MODES = ("auto", "dynamic", "static", "graph")
log = logging.getLogger(__name__)


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
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    prompt_logprobs: list[float | None] | None


class BufferLayer(CacheLayerMixin):
    """KV-cache layer over a preallocated [B, H, cap, D] buffer (no per-step concatenation)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        self.kbuf, self.vbuf, self.len = keys, values, length
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.kbuf[:, :, : self.len]

    @property
    def values(self) -> torch.Tensor:
        return self.vbuf[:, :, : self.len]

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - prefilled
        raise RuntimeError("buffer layer is prefilled")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        self.kbuf[:, :, self.len : self.len + n] = key_states
        self.vbuf[:, :, self.len : self.len + n] = value_states
        self.len += n
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.len + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.len

    def get_max_cache_shape(self, *args) -> int:
        return -1

    def select(self, idx: torch.Tensor) -> None:
        self.kbuf, self.vbuf = self.kbuf[idx], self.vbuf[idx]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx.to(self.kbuf.device))


GQA_DECODE_ATTENTION = "dppo_gqa_decode"


def gqa_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """Single-query attention over a grouped KV cache without repeating K/V per query head (sdpa
    with a mask repeats the whole cache per step); any other shape goes to transformers' sdpa.
    Query head h reads KV head h // (H / Hkv), as transformers' repeat_kv does."""
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    R, H, _, D = query.shape
    Hkv = key.shape[1]
    q_RKGD = query.reshape(R, Hkv, H // Hkv, D)
    scale = scaling if scaling is not None else D**-0.5
    scores_RKGC = torch.matmul(q_RKGD, key.transpose(-1, -2)).float() * scale
    scores_RKGC = scores_RKGC.masked_fill(~attention_mask, float("-inf"))  # mask [R, 1, 1, C] broadcasts
    out_RKGD = torch.matmul(scores_RKGC.softmax(dim=-1).to(value.dtype), value)
    return out_RKGD.reshape(R, H, 1, D).transpose(1, 2).contiguous(), None


@functools.cache
def register_gqa_decode_attention() -> str:
    """Registered on first static decode (importing transformers' attention registry early slows
    the preset server's first requests)."""
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_DECODE_ATTENTION, gqa_decode_attention)
    return GQA_DECODE_ATTENTION


class StaticKVLayer(CacheLayerMixin):
    """Fixed-shape KV layer for captured decode steps: writes the new position at the column held
    in the shared device tensor `write_col` and returns the whole buffer (the attention mask hides
    unused columns), so a step's shapes and kernels never change."""

    is_sliding = False
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_col: torch.Tensor):
        self.kbuf, self.vbuf, self.write_col = keys, values, write_col
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.kbuf

    @property
    def values(self) -> torch.Tensor:
        return self.vbuf

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - prefilled
        raise RuntimeError("static layer is prefilled")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.kbuf.index_copy_(2, self.write_col, key_states)
        self.vbuf.index_copy_(2, self.write_col, value_states)
        return self.kbuf, self.vbuf

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.kbuf.shape[2], 0

    def get_seq_length(self, *args) -> int:
        return self.kbuf.shape[2]

    def get_max_cache_shape(self, *args) -> int:
        return self.kbuf.shape[2]


class StaticDecodeStep:
    """One decode step over fixed buffers: ids/positions/mask/column are copied into static
    tensors, then the step runs eagerly or as a replayed CUDA graph (captured on first use)."""

    def __init__(self, net, layers: list[BufferLayer], attn_RC: torch.Tensor, use_graph: bool):
        self.decoder, self.head = net.get_decoder(), net.get_output_embeddings()
        dev = attn_RC.device
        R = attn_RC.shape[0]
        self.write_col = torch.zeros(1, dtype=torch.int64, device=dev)
        self.cache = Cache(layers=[StaticKVLayer(lay.kbuf, lay.vbuf, self.write_col) for lay in layers])
        self.mask_R11C = attn_RC.bool()[:, None, None, :].clone()
        self.ids_R1 = torch.zeros((R, 1), dtype=torch.int64, device=dev)
        self.pos_R1 = torch.zeros((R, 1), dtype=torch.int64, device=dev)
        self.use_graph = use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_RV: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        cfg = self.decoder.config
        prev, cfg._attn_implementation = cfg._attn_implementation, register_gqa_decode_attention()
        try:
            out = self.decoder(input_ids=self.ids_R1, attention_mask={"full_attention": self.mask_R11C},
                               position_ids=self.pos_R1, past_key_values=self.cache, use_cache=True)
        finally:
            cfg._attn_implementation = prev
        return self.head(out.last_hidden_state[:, -1]).float()

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (rewrites the same column: idempotent)
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # trainer threads may run meanwhile
            self.logits_RV = self._forward()
        self.graph = graph

    def __call__(self, ids_R: torch.Tensor, pos_R: torch.Tensor, col: int) -> torch.Tensor:
        self.ids_R1.copy_(ids_R.unsqueeze(-1))
        self.pos_R1.copy_(pos_R.unsqueeze(-1))
        self.write_col.fill_(col)
        self.mask_R11C[:, 0, 0, col] = True
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits_RV


def filter_logits(logits_RV: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Tempered logits with everything outside top_k / the top_p nucleus set to -inf."""
    x = logits_RV / temperature
    if top_k != -1 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = cum_before >= top_p  # keep the smallest prefix reaching top_p (always >= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def gumbel_max(x_RV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from softmax(x): argmax(x - log E), E ~ Exp(1)."""
    e_RV = torch.empty_like(x_RV, dtype=torch.float32).exponential_(generator=generator)
    return (x_RV.float() - e_RV.log()).argmax(dim=-1)


def draw(logits_RV: torch.Tensor, req: DecodeRequest, generator: torch.Generator) -> torch.Tensor:
    if req.temperature == 0.0:
        return logits_RV.argmax(dim=-1)
    return gumbel_max(filter_logits(logits_RV, req.temperature, req.top_k, req.top_p), generator)


def _buffered(cache: Cache, cap: int) -> Cache:
    """Pure-attention caches move into preallocated buffers of `cap` positions; others (e.g.
    Qwen3.5's linear-attention layers) are used as they are."""
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return cache
    layers = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        kb = k.new_zeros((k.shape[0], k.shape[1], cap, k.shape[3]))
        vb = v.new_zeros((v.shape[0], v.shape[1], cap, v.shape[3]))
        kb[:, :, : k.shape[2]] = k
        vb[:, :, : v.shape[2]] = v
        layers.append(BufferLayer(kb, vb, k.shape[2]))
    return Cache(layers=layers)


@dataclass
class _Prefill:
    cache: Cache
    last_logits_JV: torch.Tensor
    mask_JL: torch.Tensor
    prompt_lps: list[list[float | None] | None]


def _prefill(net, reqs: Sequence[DecodeRequest], device: torch.device) -> _Prefill:
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    J, Lp = len(reqs), max(len(r.prompt) for r in reqs)
    ids_JL = torch.zeros((J, Lp), dtype=torch.int64)
    mask_JL = torch.zeros((J, Lp), dtype=torch.int64)
    for j, r in enumerate(reqs):
        ids_JL[j, Lp - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.int64)
        mask_JL[j, Lp - len(r.prompt):] = 1
    ids_JL, mask_JL = ids_JL.to(device), mask_JL.to(device)
    pos_JL = (mask_JL.cumsum(-1) - 1).clamp_min(0)
    out = decoder(input_ids=ids_JL, attention_mask=mask_JL, position_ids=pos_JL, use_cache=True)
    hidden_JLH = out.last_hidden_state
    prompt_lps: list[list[float | None] | None] = []
    for j, r in enumerate(reqs):
        if not r.want_prompt_lp:
            prompt_lps.append(None)
            continue
        L = len(r.prompt)
        tgt = torch.tensor(r.prompt[1:], dtype=torch.int64, device=device)
        lp = chunked_target_logprobs(hidden_JLH[j, Lp - L : Lp - 1], tgt, head)
        prompt_lps.append([None] + lp.cpu().tolist())
    last = head(hidden_JLH[:, -1]).float()
    return _Prefill(out.past_key_values, last, mask_JL, prompt_lps)


def resolve_mode(mode: str, net, cache: Cache) -> str:
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
    static_ok = isinstance(cache, Cache) and all(isinstance(lay, BufferLayer) for lay in cache.layers) and not getattr(
        net.get_decoder(), "has_sliding_layers", False)
    on_cuda = net.get_output_embeddings().weight.device.type == "cuda"
    if mode == "auto":
        return "graph" if (static_ok and on_cuda) else "dynamic"
    if mode in ("static", "graph") and not static_ok:
        return "dynamic"  # hybrid / sliding caches have no static step
    if mode == "graph" and not on_cuda:
        return "static"
    return mode


def generate(net, reqs: Sequence[DecodeRequest], decode_text: Callable[[list[int]], str], mode: str = "auto",
             stats: dict | None = None) -> list[list[Decoded]]:
    """All samples of all `reqs` through one batched decode loop (see module docstring). `stats`,
    if given, receives the decode mode used and the step count."""
    head = net.get_output_embeddings()
    decoder = net.get_decoder()
    device = head.weight.device
    pre = _prefill(net, reqs, device)
    Lp = pre.mask_JL.shape[1]
    row_req = [j for j, r in enumerate(reqs) for _ in range(r.n)]
    R = len(row_req)
    cap = Lp + max(r.max_tokens for r in reqs)
    rows_idx = torch.tensor(row_req, dtype=torch.int64, device=device)
    cache = pre.cache
    cache.reorder_cache(rows_idx)  # each prompt's cache -> one row per sample
    cache = _buffered(cache, cap)
    attn_RC = torch.zeros((R, cap), dtype=torch.int64, device=device)
    attn_RC[:, :Lp] = pre.mask_JL[rows_idx]
    mode = resolve_mode(mode, net, cache)
    static = StaticDecodeStep(net, cache.layers, attn_RC, mode == "graph") if mode in ("static", "graph") else None
    pos_R = torch.tensor([len(reqs[j].prompt) for j in row_req], dtype=torch.int64, device=device)
    gens = [torch.Generator(device=device).manual_seed(r.seed) for r in reqs]
    stops = [set(r.stop_ids) for r in reqs]
    toks: list[list[int]] = [[] for _ in range(R)]
    lps: list[list[float]] = [[] for _ in range(R)]
    reason: list[str | None] = [None] * R
    batch_rows = list(range(R))  # original row of each batch position
    logits_BV = pre.last_logits_JV[rows_idx]
    step = 0
    while True:
        nxt_B = torch.zeros(len(batch_rows), dtype=torch.int64, device=device)  # finished rows feed 0
        b = 0
        while b < len(batch_rows):  # rows of one request are contiguous
            j = row_req[batch_rows[b]]
            e = b
            while e < len(batch_rows) and row_req[batch_rows[e]] == j:
                e += 1
            live = [k for k in range(b, e) if reason[batch_rows[k]] is None]
            if live:
                sel = torch.tensor(live, dtype=torch.int64, device=device) if len(live) < e - b else slice(b, e)
                nxt_B[sel] = draw(logits_BV[sel], reqs[j], gens[j])
            b = e
        lp_B = logits_BV.gather(-1, nxt_B.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits_BV, dim=-1)
        nxt_list, lp_list = nxt_B.tolist(), lp_B.tolist()  # the step's one host sync
        for k, row in enumerate(batch_rows):
            if reason[row] is not None:
                continue
            r = reqs[row_req[row]]
            toks[row].append(nxt_list[k])
            lps[row].append(lp_list[k])
            if nxt_list[k] in stops[row_req[row]] or (r.stop_strings and _hits_stop_string(decode_text, toks[row], r.stop_strings)):
                reason[row] = "stop"
            elif len(toks[row]) >= r.max_tokens:
                reason[row] = "length"
        step += 1
        live_k = [k for k, row in enumerate(batch_rows) if reason[row] is None]
        if not live_k:
            break
        dead = len(batch_rows) - len(live_k)
        cur = Lp + step
        if static is not None:  # fixed shapes: finished rows keep running, their tokens are ignored
            try:
                logits_BV = static(nxt_B, pos_R, cur - 1)
            except Exception as exc:
                if not static.use_graph or static.graph is not None:
                    raise
                log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", exc)
                mode, static.use_graph = "static", False
                logits_BV = static(nxt_B, pos_R, cur - 1)
            pos_R = pos_R + 1
            continue
        if dead and dead >= max(1, int(COMPACT_FRACTION * len(batch_rows))):
            kidx = torch.tensor(live_k, dtype=torch.int64, device=device)
            cache.reorder_cache(kidx)
            attn_RC, pos_R, nxt_B = attn_RC[kidx], pos_R[kidx], nxt_B[kidx]
            batch_rows = [batch_rows[k] for k in live_k]
        attn_RC[:, cur - 1] = 1
        out = decoder(input_ids=nxt_B.unsqueeze(-1), attention_mask=attn_RC[:, :cur],
                      position_ids=pos_R.unsqueeze(-1), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        pos_R = pos_R + 1
        logits_BV = head(out.last_hidden_state[:, -1]).float()
    if stats is not None:
        stats.update(decode_mode=mode, decode_steps=step, rows=R)
    results: list[list[Decoded]] = []
    row = 0
    for j, r in enumerate(reqs):
        seqs = []
        for _ in range(r.n):
            seqs.append(Decoded(toks[row], lps[row], reason[row] or "length", pre.prompt_lps[j]))
            row += 1
        results.append(seqs)
    return results


def _hits_stop_string(decode_text: Callable[[list[int]], str], toks: list[int], stop_strings: list[str]) -> bool:
    # The newest token can complete a stop string spanning at most a few earlier tokens.
    longest = max(len(s) for s in stop_strings)
    tail = decode_text(toks[-(longest + 1):])
    return any(s in tail for s in stop_strings)
