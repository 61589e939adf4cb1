"""The decode loop's KV caches and its fixed-shape decode step.

Attention layers over preallocated buffers (`BufferLayer`, one position written per step), the
single-query grouped attention, and the static decode step that a CUDA graph captures
(`StaticDecodeStep`).

`sampling.py` runs the loop over these; its docstring says when each is used.
"""

from __future__ import annotations

import functools

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

AnyCacheLayer = CacheLayerMixin | LinearAttentionCacheLayerMixin  # what a transformers `Cache` holds


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


def buffered_cache(cache: Cache, cap: int) -> Cache:
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


def static_capable(net: transformers.PreTrainedModel, cache: Cache) -> bool:
    """Whether a decode step over this cache can keep fixed shapes (`StaticDecodeStep`)."""
    return all(type(lay) in (BufferLayer, LinearAttentionLayer) for lay in cache.layers) and not getattr(
        net.get_decoder(), "has_sliding_layers", False
    )
