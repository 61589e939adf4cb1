"""The one batched KV-cache decode loop of the embedded server, for every model it runs (the tiny
presets and `--model-path` Hugging Face checkpoints).

Every sample of every request in a batch goes through `generate`:
1. prefill the distinct prompts once (`DecodeSpec.prefill`): "batched" = one left-padded batch
   (attention mask + position ids), then each prompt's cache is copied to its samples' rows
   (`Cache.reorder_cache` with repeated indices); "each" = every prompt alone (batch 1, no
   padding), its KV copied left-padded into the rows;
2. attention layers move their KV into preallocated buffers (`BufferLayer`), so a step writes one
   position instead of concatenating the whole cache; Qwen3.5's linear-attention layers keep
   transformers' fixed-size conv and recurrent states (`LinearAttentionLayer`, updated in place);
3. decode all rows together; the output head runs on the last position only; finished rows stay
   in the batch until `DecodeSpec.compact_fraction` of it has finished, then the batch is
   compacted.

Decode modes (`generate(..., mode=)`): "dynamic" runs the steps above eagerly. "static" gives
every step the same shapes and no host values: attention covers the whole preallocated cache
under a boolean mask, the new KV is written at a position held in a device tensor, the
linear-attention states are updated in place, finished rows stay in the batch. "graph" is
"static" with the step captured once as a CUDA graph and replayed (the decode of a 2B model is
bound by CPU dispatch otherwise, see gpu-anchor.md). "auto" = "graph" on CUDA when the cache
allows a static step (pure attention, or Qwen3.5's hybrid of full and linear attention; not
sliding windows), else "dynamic"; a failed capture falls back to "static" and says so in the
returned stats.

Draws (`DecodeSpec.draw`): temperature 0 is argmax. "gumbel": `argmax(logits / T - log E)` with
`E ~ Exp(1)` drawn from the request's own `torch.Generator` (seeded with the request seed, on
the model's device): an exact draw from softmax(logits / T) (after top_k / top_p) in one
elementwise pass instead of softmax + multinomial over the vocabulary. "multinomial": what
`torch.multinomial(softmax, 1)` with the same generator draws (the presets' draw, kept so that
their seeded outputs stay bitwise what they were). Either keeps the seed's meaning: the same
request alone, or with the same concurrent batch, gives the same tokens. Per-token logprobs are
the untempered log-softmax of the drawn token (the trainer's distribution).
The draws live in `draws.py`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dppo_harness.local_server.engine.draws import draw
from dppo_harness.local_server.engine.logprobs import chunked_target_logprobs
from dppo_harness.local_server.engine.model import token_logprobs

COMPACT_FRACTION = 0.25  # compact the batch once this fraction of its rows has finished
MODES = ("auto", "dynamic", "static", "graph")
DRAWS = ("gumbel", "multinomial")
PREFILLS = ("batched", "each")
log = logging.getLogger(__name__)
AnyCacheLayer = CacheLayerMixin | LinearAttentionCacheLayerMixin  # what a transformers `Cache` holds
DecodeStats = dict[str, int | str]  # decode_mode, decode_steps, rows (`generate`)


@dataclass(frozen=True)
class DecodeSpec:
    """What differs between the models the one loop decodes.

    vocab_size: logits columns that can be drawn (the presets' restricted vocabulary drops its
        input-only unk row; a full-vocabulary checkpoint: every row of the output head).
    draw: "gumbel" or "multinomial" (module docstring).
    prefill: "batched" or "each" (module docstring; "each" needs a pure-attention cache and
        computes the whole prompt's logits, which the presets' small vocabulary affords).
    compact_fraction: compact the batch once this fraction of its rows has finished (0: as soon
        as one has).
    """

    vocab_size: int
    draw: str = "gumbel"
    prefill: str = "batched"
    compact_fraction: float = COMPACT_FRACTION

    def __post_init__(self) -> None:
        if self.draw not in DRAWS or self.prefill not in PREFILLS or not 0.0 <= self.compact_fraction < 1.0:
            raise ValueError(f"bad decode spec {self}")


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

    def select(self, idx: torch.Tensor) -> None:
        self.kbuf, self.vbuf = self.kbuf[idx], self.vbuf[idx]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx.to(self.kbuf.device))


GQA_DECODE_ATTENTION = "dppo_gqa_decode"


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Single-query attention over a grouped KV cache without repeating K/V per query head (sdpa
    with a mask repeats the whole cache per step); any other shape goes to transformers' sdpa.
    Query head h reads KV head h // (H / Hkv), as transformers' repeat_kv does."""
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
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
    from transformers import AttentionInterface  # loads transformers.modeling_utils (docstring)

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

    # keys / values are the buffers themselves: read-only here, where the mixin declares attributes.
    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        return self.kbuf

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        return self.vbuf

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:  # pragma: no cover - prefilled
        raise RuntimeError("static layer is prefilled")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.kbuf.index_copy_(2, self.write_col, key_states)
        self.vbuf.index_copy_(2, self.write_col, value_states)
        return self.kbuf, self.vbuf

    def get_mask_sizes(self, query_length: int, *args: object) -> tuple[int, int]:
        return self.kbuf.shape[2], 0

    def get_seq_length(self, *args: object) -> int:
        return self.kbuf.shape[2]

    def get_max_cache_shape(self, *args: object) -> int:
        return self.kbuf.shape[2]


class StaticDecodeStep:
    """One decode step over fixed buffers: ids/positions/mask/column are copied into static
    tensors, then the step runs eagerly or as a replayed CUDA graph (captured on first use).
    Attention layers (`BufferLayer`) become `StaticKVLayer`s over the same buffers; linear-attention
    layers keep their transformers `LinearAttentionLayer`, whose conv and recurrent states the
    model updates in place (`copy_`), so their addresses stay fixed for the graph."""

    def __init__(self, net: transformers.PreTrainedModel, cache: Cache, attn_RC: torch.Tensor, use_graph: bool):
        self.decoder, self.head = net.get_decoder(), net.get_output_embeddings()
        dev = attn_RC.device
        R = attn_RC.shape[0]
        self.write_col = torch.zeros(1, dtype=torch.int64, device=dev)
        layers: list[AnyCacheLayer] = [
            StaticKVLayer(lay.kbuf, lay.vbuf, self.write_col) if isinstance(lay, BufferLayer) else lay
            for lay in cache.layers
        ]
        self.cache = Cache(layers=layers)
        self.mask_R11C = attn_RC.bool()[:, None, None, :].clone()
        self.ids_R1 = torch.zeros((R, 1), dtype=torch.int64, device=dev)
        self.pos_R1 = torch.zeros((R, 1), dtype=torch.int64, device=dev)
        self.use_graph = use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_RV: torch.Tensor | None = None

    def _states(self) -> list[torch.Tensor]:
        """The linear-attention states a step advances (a KV write to the same column is idempotent)."""
        return [
            t
            for lay in self.cache.layers
            if isinstance(lay, LinearAttentionLayer)
            for t in (lay.conv_states, lay.recurrent_states)
            if t is not None
        ]

    def _forward(self) -> torch.Tensor:
        cfg = self.decoder.config
        prev, cfg._attn_implementation = cfg._attn_implementation, register_gqa_decode_attention()
        try:
            # A 4D mask is used as given (masking_utils); linear-attention layers take none once
            # their cache has a previous state.
            out = self.decoder(
                input_ids=self.ids_R1,
                attention_mask=self.mask_R11C,
                position_ids=self.pos_R1,
                past_key_values=self.cache,
                use_cache=True,
            )
        finally:
            cfg._attn_implementation = prev
        return self.head(out.last_hidden_state[:, -1]).float()

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The captured step and the logits tensor its replays write."""
        saved = [t.clone() for t in self._states()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels picked / autotuned before capture
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self._states(), saved):  # undo the warm-up's linear-attention steps
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # trainer threads may run meanwhile
            logits_RV = self._forward()  # recorded, not run
        return graph, logits_RV

    def __call__(self, ids_R: torch.Tensor, pos_R: torch.Tensor, col: int) -> torch.Tensor:
        self.ids_R1.copy_(ids_R.unsqueeze(-1))
        self.pos_R1.copy_(pos_R.unsqueeze(-1))
        self.write_col.fill_(col)
        self.mask_R11C[:, 0, 0, col] = True
        if not self.use_graph:
            return self._forward()
        if self.graph is None or self.logits_RV is None:
            self.graph, self.logits_RV = self._capture()
        self.graph.replay()
        return self.logits_RV


def _buffered(cache: Cache, cap: int) -> Cache:
    """Attention layers move into preallocated buffers of `cap` positions; linear-attention layers
    stay as they are (fixed-size states). Any other layer kind (sliding windows) leaves the whole
    cache as it is."""
    if not all(type(layer) in (DynamicLayer, LinearAttentionLayer) for layer in cache.layers):
        return cache
    layers: list[AnyCacheLayer] = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer):  # a LinearAttentionLayer
            layers.append(layer)
            continue
        k, v = layer.keys, layer.values
        if k is None or v is None:
            raise ValueError("an attention layer of the prefilled cache holds no KV")
        kb = k.new_zeros((k.shape[0], k.shape[1], cap, k.shape[3]))
        vb = v.new_zeros((v.shape[0], v.shape[1], cap, v.shape[3]))
        kb[:, :, : k.shape[2]] = k
        vb[:, :, : v.shape[2]] = v
        layers.append(BufferLayer(kb, vb, k.shape[2]))
    return Cache(layers=layers)


@dataclass
class _Prefill:
    cache_R: Cache  # one row per sample, attention layers buffered to the batch's capacity
    last_logits_JV: torch.Tensor  # float32, drawable columns only
    mask_JL: torch.Tensor  # left-padded prompts
    prompt_lps: list[list[float | None] | None]


def _prefill_batched(
    net: transformers.PreTrainedModel, reqs: Sequence[DecodeRequest], spec: DecodeSpec, rows_idx: torch.Tensor, cap: int
) -> _Prefill:
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    if spec.vocab_size != head.weight.shape[0]:
        raise ValueError("batched prefill computes prompt logprobs over the whole output head")
    device = head.weight.device
    J, Lp = len(reqs), max(len(r.prompt) for r in reqs)
    ids_JL = torch.zeros((J, Lp), dtype=torch.int64)
    mask_JL = torch.zeros((J, Lp), dtype=torch.int64)
    for j, r in enumerate(reqs):
        ids_JL[j, Lp - len(r.prompt) :] = torch.tensor(r.prompt, dtype=torch.int64)
        mask_JL[j, Lp - len(r.prompt) :] = 1
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
    cache = out.past_key_values
    cache.reorder_cache(rows_idx)  # each prompt's cache -> one row per sample
    return _Prefill(_buffered(cache, cap), last, mask_JL, prompt_lps)


def _prefill_each(
    net: transformers.PreTrainedModel, reqs: Sequence[DecodeRequest], spec: DecodeSpec, rows_idx: torch.Tensor, cap: int
) -> _Prefill:
    """Every prompt alone (batch 1, no padding); its KV is copied into its samples' rows of
    zeroed buffers, right-aligned at the longest prompt's end."""
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    device, V = head.weight.device, spec.vocab_size
    J, Lp = len(reqs), max(len(r.prompt) for r in reqs)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    last: list[torch.Tensor] = []
    prompt_lps: list[list[float | None] | None] = []
    for r in reqs:
        ids_1L = torch.tensor([r.prompt], dtype=torch.int64, device=device)
        out = decoder(input_ids=ids_1L, use_cache=True)
        if not all(type(layer) is DynamicLayer for layer in out.past_key_values.layers):
            raise ValueError("prefill 'each' needs a pure-attention cache")
        logits_1LV = head(out.last_hidden_state)
        if r.want_prompt_lp:
            lp = token_logprobs(logits_1LV[:, :-1].float(), ids_1L[:, 1:], V)[0]
            prompt_lps.append([None] + lp.tolist())
        else:
            prompt_lps.append(None)
        last.append(logits_1LV[0, -1, :V].float())
        kv.append([(layer.keys, layer.values) for layer in out.past_key_values.layers])
    counts = torch.bincount(rows_idx.cpu(), minlength=J).tolist()
    R = int(rows_idx.shape[0])
    mask_JL = torch.zeros((J, Lp), dtype=torch.int64, device=device)
    for j, r in enumerate(reqs):
        mask_JL[j, Lp - len(r.prompt) :] = 1
    layers: list[AnyCacheLayer] = []
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


def static_capable(net: transformers.PreTrainedModel, cache: Cache) -> bool:
    """Whether a decode step over this cache can keep fixed shapes (`StaticDecodeStep`)."""
    return all(type(lay) in (BufferLayer, LinearAttentionLayer) for lay in cache.layers) and not getattr(
        net.get_decoder(), "has_sliding_layers", False
    )


def resolve_mode(mode: str, net: transformers.PreTrainedModel, cache: Cache) -> str:
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
    static_ok = isinstance(cache, Cache) and static_capable(net, cache)
    on_cuda = net.get_output_embeddings().weight.device.type == "cuda"
    if mode == "auto":
        return "graph" if (static_ok and on_cuda) else "dynamic"
    if mode in ("static", "graph") and not static_ok:
        return "dynamic"  # sliding-window caches have no static step
    if mode == "graph" and not on_cuda:
        return "static"
    return mode


@dataclass
class _DecodedRows:
    """What the decode loop produced, one entry per sample row (rows of one request contiguous)."""

    toks: list[list[int]]
    lps: list[list[float]]
    reason: list[str | None]  # "stop", "length"; None: never finished (counted as "length")
    steps: int
    mode: str  # the decode mode that ran ("static" when a graph capture failed)


def generate(
    net: transformers.PreTrainedModel,
    reqs: Sequence[DecodeRequest],
    decode_text: Callable[[list[int]], str],
    spec: DecodeSpec,
    mode: str = "auto",
    stats: DecodeStats | None = None,
) -> list[list[Decoded]]:
    """All samples of all `reqs` (token ids are the model's rows) through the one batched decode
    loop (module docstring). `decode_text` turns model ids into text for stop strings. `stats`, if
    given, receives the decode mode used, the step count and the row count."""
    device = net.get_output_embeddings().weight.device
    row_req = [j for j, r in enumerate(reqs) for _ in range(r.n)]
    R = len(row_req)
    Lp = max(len(r.prompt) for r in reqs)
    cap = Lp + max(r.max_tokens for r in reqs)
    rows_idx = torch.tensor(row_req, dtype=torch.int64, device=device)
    pre = (_prefill_each if spec.prefill == "each" else _prefill_batched)(net, reqs, spec, rows_idx, cap)
    attn_RC = torch.zeros((R, cap), dtype=torch.int64, device=device)
    attn_RC[:, :Lp] = pre.mask_JL[rows_idx]
    mode = resolve_mode(mode, net, pre.cache_R)
    static = StaticDecodeStep(net, pre.cache_R, attn_RC, mode == "graph") if mode in ("static", "graph") else None
    pos_R = torch.tensor([len(reqs[j].prompt) for j in row_req], dtype=torch.int64, device=device)
    rows = _decode_rows(
        net,
        reqs,
        decode_text,
        spec,
        row_req,
        Lp,
        pre.cache_R,
        attn_RC,
        pos_R,
        pre.last_logits_JV[rows_idx],
        static,
        mode,
    )
    if stats is not None:
        stats.update(decode_mode=rows.mode, decode_steps=rows.steps, rows=R)
    return _decoded_by_request(reqs, rows, pre.prompt_lps)


def _decode_rows(
    net: transformers.PreTrainedModel,
    reqs: Sequence[DecodeRequest],
    decode_text: Callable[[list[int]], str],
    spec: DecodeSpec,
    row_req: list[int],
    Lp: int,
    cache: Cache,
    attn_RC: torch.Tensor,
    pos_R: torch.Tensor,
    logits_BV: torch.Tensor,
    static: StaticDecodeStep | None,
    mode: str,
) -> _DecodedRows:
    """The decode loop over every row from the prefill's last logits until every row finished."""
    head = net.get_output_embeddings()
    decoder = net.get_decoder()
    device = head.weight.device
    V = spec.vocab_size
    R = len(row_req)
    gens = [torch.Generator(device=device).manual_seed(r.seed) for r in reqs]
    stops = [set(r.stop_ids) for r in reqs]
    toks: list[list[int]] = [[] for _ in range(R)]
    lps: list[list[float]] = [[] for _ in range(R)]
    reason: list[str | None] = [None] * R
    batch_rows = list(range(R))  # original row of each batch position
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
                nxt_B[sel] = draw(logits_BV[sel], reqs[j], gens[j], spec.draw)
            b = e
        lp_B = torch.log_softmax(logits_BV, dim=-1).gather(-1, nxt_B.unsqueeze(-1)).squeeze(-1)
        nxt_list, lp_list = nxt_B.tolist(), lp_B.tolist()  # the step's one host sync
        for k, row in enumerate(batch_rows):
            if reason[row] is not None:
                continue
            r = reqs[row_req[row]]
            toks[row].append(nxt_list[k])
            lps[row].append(lp_list[k])
            if nxt_list[k] in stops[row_req[row]] or (
                r.stop_strings and _hits_stop_string(decode_text, toks[row], r.stop_strings)
            ):
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
                logits_BV = static(nxt_B, pos_R, cur - 1)[:, :V]
            except Exception as exc:
                if not static.use_graph or static.graph is not None:
                    raise
                log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", exc)
                mode, static.use_graph = "static", False
                logits_BV = static(nxt_B, pos_R, cur - 1)[:, :V]
            pos_R = pos_R + 1
            continue
        if dead and dead >= max(1, int(spec.compact_fraction * len(batch_rows))):
            kidx = torch.tensor(live_k, dtype=torch.int64, device=device)
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
        cache = out.past_key_values
        pos_R = pos_R + 1
        logits_BV = head(out.last_hidden_state[:, -1])[:, :V].float()
    return _DecodedRows(toks, lps, reason, step, mode)


def _decoded_by_request(
    reqs: Sequence[DecodeRequest], rows: _DecodedRows, prompt_lps: list[list[float | None] | None]
) -> list[list[Decoded]]:
    results: list[list[Decoded]] = []
    row = 0
    for j, r in enumerate(reqs):
        seqs = []
        for _ in range(r.n):
            seqs.append(Decoded(rows.toks[row], rows.lps[row], rows.reason[row] or "length", prompt_lps[j]))
            row += 1
        results.append(seqs)
    return results


def _hits_stop_string(decode_text: Callable[[list[int]], str], toks: list[int], stop_strings: list[str]) -> bool:
    # The newest token can complete a stop string spanning at most a few earlier tokens.
    longest = max(len(s) for s in stop_strings)
    tail = decode_text(toks[-(longest + 1) :])
    return any(s in tail for s in stop_strings)
