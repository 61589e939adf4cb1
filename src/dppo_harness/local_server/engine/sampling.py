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
The draws live in `draws.py`; the cache layers and the static step in `decode_cache.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from dppo_harness.local_server.engine.decode_cache import (
    AnyCacheLayer,
    BufferLayer,
    StaticDecodeStep,
    buffered_cache,
    static_capable,
)
from dppo_harness.local_server.engine.draws import draw
from dppo_harness.local_server.engine.logprobs import chunked_target_logprobs
from dppo_harness.local_server.engine.model import token_logprobs

COMPACT_FRACTION = 0.25  # compact the batch once this fraction of its rows has finished
MODES = ("auto", "dynamic", "static", "graph")
DRAWS = ("gumbel", "multinomial")
PREFILLS = ("batched", "each")
log = logging.getLogger(__name__)
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
    return _Prefill(buffered_cache(cache, cap), last, mask_JL, prompt_lps)


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
    decoder, head = net.get_decoder(), net.get_output_embeddings()
    device = head.weight.device
    V = spec.vocab_size
    R = len(row_req)
    gens = [torch.Generator(device=device).manual_seed(r.seed) for r in reqs]
    stops = [set(r.stop_ids) for r in reqs]
    rows = _DecodedRows([[] for _ in range(R)], [[] for _ in range(R)], [None] * R, steps=0, mode=mode)
    batch_rows = list(range(R))  # original row of each batch position
    while True:
        nxt_B = _draw_tokens(logits_BV, batch_rows, row_req, rows.reason, reqs, gens, spec.draw)
        _record_tokens(rows, batch_rows, nxt_B, logits_BV, reqs, row_req, stops, decode_text)
        rows.steps += 1
        live_k = [k for k, row in enumerate(batch_rows) if rows.reason[row] is None]
        if not live_k:
            break
        dead = len(batch_rows) - len(live_k)
        cur = Lp + rows.steps
        if static is not None:  # fixed shapes: finished rows keep running, their tokens are ignored
            logits_BV = _static_step(static, nxt_B, pos_R, cur - 1, rows)[:, :V]
            pos_R = pos_R + 1
            continue
        if dead and dead >= max(1, int(spec.compact_fraction * len(batch_rows))):
            kidx = torch.tensor(live_k, dtype=torch.int64, device=device)
            # transformers annotates the index with the legacy torch.LongTensor class; an int64 tensor is what it takes.
            cache.reorder_cache(kidx)  # type: ignore[arg-type]
            attn_RC, pos_R, nxt_B = attn_RC[kidx], pos_R[kidx], nxt_B[kidx]
            batch_rows = [batch_rows[k] for k in live_k]
        attn_RC[:, cur - 1] = 1
        logits_BV, cache = _dynamic_step(decoder, head, cache, nxt_B, attn_RC[:, :cur], pos_R, V)
        pos_R = pos_R + 1
    return rows


def _draw_tokens(
    logits_BV: torch.Tensor,
    batch_rows: list[int],
    row_req: list[int],
    reason: list[str | None],
    reqs: Sequence[DecodeRequest],
    gens: list[torch.Generator],
    draw_kind: str,
) -> torch.Tensor:
    """One token per batch position [B]: each request's live rows drawn together from its own
    generator; finished rows feed 0."""
    nxt_B = torch.zeros(len(batch_rows), dtype=torch.int64, device=logits_BV.device)
    b = 0
    while b < len(batch_rows):  # rows of one request are contiguous
        j = row_req[batch_rows[b]]
        e = b
        while e < len(batch_rows) and row_req[batch_rows[e]] == j:
            e += 1
        live = [k for k in range(b, e) if reason[batch_rows[k]] is None]
        if live:
            sel = torch.tensor(live, dtype=torch.int64, device=logits_BV.device) if len(live) < e - b else slice(b, e)
            nxt_B[sel] = draw(logits_BV[sel], reqs[j], gens[j], draw_kind)
        b = e
    return nxt_B


def _record_tokens(
    rows: _DecodedRows,
    batch_rows: list[int],
    nxt_B: torch.Tensor,
    logits_BV: torch.Tensor,
    reqs: Sequence[DecodeRequest],
    row_req: list[int],
    stops: list[set[int]],
    decode_text: Callable[[list[int]], str],
) -> None:
    """Append each live row's drawn token and its logprob; a stop token or string, or the token
    budget, finishes the row."""
    lp_B = torch.log_softmax(logits_BV, dim=-1).gather(-1, nxt_B.unsqueeze(-1)).squeeze(-1)
    nxt_list, lp_list = nxt_B.tolist(), lp_B.tolist()  # the step's one host sync
    for k, row in enumerate(batch_rows):
        if rows.reason[row] is not None:
            continue
        r = reqs[row_req[row]]
        toks = rows.toks[row]
        toks.append(nxt_list[k])
        rows.lps[row].append(lp_list[k])
        if nxt_list[k] in stops[row_req[row]] or (
            r.stop_strings and _hits_stop_string(decode_text, toks, r.stop_strings)
        ):
            rows.reason[row] = "stop"
        elif len(toks) >= r.max_tokens:
            rows.reason[row] = "length"


def _static_step(
    static: StaticDecodeStep, nxt_B: torch.Tensor, pos_R: torch.Tensor, col: int, rows: _DecodedRows
) -> torch.Tensor:
    """Logits [R, V_head] of one fixed-shape step; a CUDA graph that fails to capture falls back to
    the eager static step, which `rows.mode` then records."""
    try:
        return static(nxt_B, pos_R, col)
    except Exception as exc:
        if not static.use_graph or static.graph is not None:
            raise
        log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", exc)
        rows.mode, static.use_graph = "static", False
        return static(nxt_B, pos_R, col)


def _dynamic_step(
    decoder: torch.nn.Module,
    head: torch.nn.Module,
    cache: Cache,
    nxt_B: torch.Tensor,
    attn_BC: torch.Tensor,
    pos_B: torch.Tensor,
    V: int,
) -> tuple[torch.Tensor, Cache]:
    """Float32 logits [B, V] of the eager step that feeds `nxt_B`, and the cache it extended."""
    out = decoder(
        input_ids=nxt_B.unsqueeze(-1),
        attention_mask=attn_BC,
        position_ids=pos_B.unsqueeze(-1),
        past_key_values=cache,
        use_cache=True,
    )
    return head(out.last_hidden_state[:, -1])[:, :V].float(), out.past_key_values


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
