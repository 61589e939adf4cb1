"""``FrozenBatch``: one rollout batch, immutable and hashed, reusable only after ``assert_intact``.

Storage is packed over sequences (suffix ``_S``), over full token sequences (``_K``: prompt +
response, ``T_s + 1`` tokens each) and over datum positions (``_N``: ``T_s`` positions each, aligned
with ``target_tokens`` as in ``docs/design.md``). Every array is read-only; a sha256 per field
and one over all fields plus metadata are fixed at creation and recomputed by ``assert_intact``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import tinker

from dppo_harness.json_types import JsonObject, JsonValue

FORMAT_VERSION = 1
FLOAT_DTYPE = np.dtype(np.float32)  # what the cookbook's datums carry
FIELDS: tuple[str, ...] = (
    "tokens_K",  # int64, full sequences concatenated
    "sampler_logprobs_N",  # float32, per target position (0.0 on prompt positions)
    "advantages_N",  # float32, sequence advantage on response positions, 0.0 on prompt
    "loss_mask_N",  # float32, 1.0 on sampled response tokens
    "lengths_S",  # int64, T_s = datum length of sequence s
    "prompt_lengths_S",  # int64
    "rewards_S",  # float64
    "group_ids_S",  # int64
    "item_ids_S",  # unicode, the GSM8K item id of each sequence
)
REQUIRED_METADATA = ("sampler_checkpoint", "created_at", "dtype")


def rl_datum(
    tokens_K: Sequence[int] | np.ndarray, logprobs: np.ndarray, advantages: np.ndarray, mask: np.ndarray
) -> tinker.Datum:
    """One full token sequence and its per-target-position inputs as a cookbook-layout datum
    (float32, as the SDK stores them)."""
    tokens, td = np.asarray(tokens_K, dtype=np.int64), tinker.TensorData.from_numpy
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": td(tokens[1:]),
            **{
                k: td(np.array(v, dtype=FLOAT_DTYPE))
                for k, v in (("logprobs", logprobs), ("advantages", advantages), ("mask", mask))
            },
        },
    )


class SequenceView(TypedDict):
    """Read-only slices of one stored sequence in datum layout (``T_s`` positions, tokens ``T_s + 1``)."""

    tokens: np.ndarray  # int64 [T_s + 1]: prompt + response
    logprobs: np.ndarray  # float32 [T_s]: sampler log-prob per target position
    advantages: np.ndarray  # float32 [T_s]
    mask: np.ndarray  # float32 [T_s]: 1.0 on sampled response tokens


class FrozenBatchError(RuntimeError):
    """A frozen batch changed after freezing, failed to load, or was asked for something invalid."""


def _field_sha256(name: str, arr: np.ndarray) -> str:
    h = hashlib.sha256()
    # dtype and shape are hashed too, so the same bytes reinterpreted do not pass.
    h.update(f"{name}|{arr.dtype.str}|{list(arr.shape)}|".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def canonical_json(obj: JsonValue) -> str:
    """The one JSON form hashed by the harness: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _overall_sha256(field_hashes: Mapping[str, str], metadata_json: str) -> str:
    return hashlib.sha256(
        canonical_json({"fields": dict(field_hashes), "metadata": json.loads(metadata_json)}).encode()
    ).hexdigest()


def split_complete_groups(group_of_seq: Sequence[int], n_minibatches: int) -> list[tuple[list[int], list[int]]]:
    """(group ids, sequence indices) of `n_minibatches` minibatches of equally many complete
    groups, groups in first-appearance order. The one home of this rule (frozen batches and the
    training core both split with it); ValueError when it does not split evenly."""
    groups = list(dict.fromkeys(int(g) for g in group_of_seq))
    if n_minibatches < 1 or not groups or len(groups) % n_minibatches:
        raise ValueError(f"cannot split {len(groups)} groups into {n_minibatches} minibatches of complete groups")
    per = len(groups) // n_minibatches
    out = []
    for k in range(n_minibatches):
        chosen = groups[k * per : (k + 1) * per]
        members = set(chosen)
        out.append((chosen, [s for s, g in enumerate(group_of_seq) if int(g) in members]))
    return out


@dataclass(frozen=True)
class Minibatch:
    index: int
    group_ids: tuple[int, ...]
    sequence_indices: tuple[int, ...]
    loss_tokens: int  # sum of loss_mask over its datums

    def record(self) -> JsonObject:
        return {
            "index": self.index,
            "group_ids": list(self.group_ids),
            "n_sequences": len(self.sequence_indices),
            "sequence_indices": list(self.sequence_indices),
            "loss_tokens": self.loss_tokens,
        }


class FrozenBatch:
    """Immutable rollout batch. Build with :meth:`from_datums` (`rollouts.freeze`) or :meth:`from_bytes`."""

    __slots__ = ("_arrays", "_field_hashes", "_metadata_json", "_offsets_K", "_offsets_N", "_sha256")
    _arrays: dict[str, np.ndarray]
    _field_hashes: dict[str, str]
    _metadata_json: str
    _offsets_K: np.ndarray
    _offsets_N: np.ndarray
    _sha256: str

    def __init__(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, JsonValue]):
        missing = [f for f in FIELDS if f not in arrays]
        extra = [f for f in arrays if f not in FIELDS]
        if missing or extra:
            raise FrozenBatchError(f"frozen batch fields: missing {missing}, unexpected {extra}")
        for key in REQUIRED_METADATA:
            if not metadata.get(key):
                raise FrozenBatchError(f"frozen batch metadata needs a non-empty {key!r}")
        own: dict[str, np.ndarray] = {}
        for name in FIELDS:
            arr = np.array(arrays[name], copy=True)  # private copy: callers cannot alias it
            arr.setflags(write=False)
            own[name] = arr
        _validate(own)
        object.__setattr__(self, "_arrays", own)
        object.__setattr__(self, "_metadata_json", canonical_json(dict(metadata)))
        hashes = {name: _field_sha256(name, own[name]) for name in FIELDS}
        object.__setattr__(self, "_field_hashes", hashes)
        object.__setattr__(self, "_sha256", _overall_sha256(hashes, self._metadata_json))
        lengths = own["lengths_S"]
        object.__setattr__(self, "_offsets_N", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        object.__setattr__(self, "_offsets_K", np.concatenate([[0], np.cumsum(lengths + 1)]).astype(np.int64))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("FrozenBatch is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("FrozenBatch is immutable")

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_datums(
        cls,
        datums: Sequence[tinker.Datum],
        *,
        rewards_S: Sequence[float],
        group_ids_S: Sequence[int],
        item_ids_S: Sequence[str],
        sampler_checkpoint: str,
        sampler_version: str | None = None,
        extra_metadata: Mapping[str, JsonValue] | None = None,
    ) -> FrozenBatch:
        """Freeze cookbook-layout datums (``target_tokens``, ``logprobs``, ``advantages``, ``mask``)."""
        if not (len(datums) == len(rewards_S) == len(group_ids_S) == len(item_ids_S)):
            raise FrozenBatchError("datums, rewards, group ids and item ids must have one entry per sequence")
        tokens, lps, advs, masks, lengths, prompt_lengths = [], [], [], [], [], []
        for i, d in enumerate(datums):
            inputs = d.model_input.to_ints()
            target = np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy(), dtype=np.int64)
            lp = d.loss_fn_inputs["logprobs"].to_numpy()
            adv = d.loss_fn_inputs["advantages"].to_numpy()
            mask = d.loss_fn_inputs["mask"].to_numpy()
            T = len(inputs)
            if not (len(target) == len(lp) == len(adv) == len(mask) == T) or T == 0:
                raise FrozenBatchError(f"datum {i}: misaligned lengths")
            if inputs[1:] != target[:-1].tolist():
                raise FrozenBatchError(f"datum {i}: targets are not the inputs shifted by one")
            tokens.append(np.asarray(inputs + [int(target[-1])], dtype=np.int64))
            lps.append(lp.astype(FLOAT_DTYPE))
            advs.append(adv.astype(FLOAT_DTYPE))
            masks.append(mask.astype(FLOAT_DTYPE))
            lengths.append(T)
            response = np.flatnonzero(mask)
            # prompt length in tokens: positions before the first loss position, plus the first token
            prompt_lengths.append(int(response[0]) + 1 if response.size else T + 1)
        meta: JsonObject = {
            "format_version": FORMAT_VERSION,
            "sampler_checkpoint": sampler_checkpoint,
            "sampler_version": sampler_version,
            "dtype": FLOAT_DTYPE.name,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"),
            **dict(extra_metadata or {}),
        }
        arrays: dict[str, np.ndarray] = {
            "tokens_K": np.concatenate(tokens),
            "sampler_logprobs_N": np.concatenate(lps),
            "advantages_N": np.concatenate(advs),
            "loss_mask_N": np.concatenate(masks),
            "lengths_S": np.asarray(lengths, dtype=np.int64),
            "prompt_lengths_S": np.asarray(prompt_lengths, dtype=np.int64),
            "rewards_S": np.asarray(rewards_S, dtype=np.float64),
            "group_ids_S": np.asarray(group_ids_S, dtype=np.int64),
            "item_ids_S": np.asarray(list(item_ids_S), dtype=np.str_),
        }
        return cls(arrays, meta)

    # --- access --------------------------------------------------------------------------

    def field(self, name: str) -> np.ndarray:
        """Read-only view of one stored field."""
        return self._arrays[name]

    @property
    def metadata(self) -> JsonObject:
        loaded: JsonObject = json.loads(self._metadata_json)
        return loaded

    @property
    def sha256(self) -> str:
        return self._sha256

    @property
    def n_sequences(self) -> int:
        return int(self._arrays["lengths_S"].size)

    @property
    def group_ids(self) -> list[int]:
        """Distinct group ids in first-appearance order."""
        return list(dict.fromkeys(int(g) for g in self._arrays["group_ids_S"]))

    def sequence(self, s: int) -> SequenceView:
        """Per-sequence read-only slices in datum layout."""
        a, b = int(self._offsets_N[s]), int(self._offsets_N[s + 1])
        ka, kb = int(self._offsets_K[s]), int(self._offsets_K[s + 1])
        return {
            "tokens": self._arrays["tokens_K"][ka:kb],
            "logprobs": self._arrays["sampler_logprobs_N"][a:b],
            "advantages": self._arrays["advantages_N"][a:b],
            "mask": self._arrays["loss_mask_N"][a:b],
        }

    # --- integrity -----------------------------------------------------------------------

    def assert_intact(self) -> str:
        """Recompute every hash; raise ``FrozenBatchError`` naming the changed fields. Returns sha256."""
        changed = [n for n in FIELDS if _field_sha256(n, self._arrays[n]) != self._field_hashes[n]]
        writable = [n for n in FIELDS if self._arrays[n].flags.writeable]
        overall = _overall_sha256(self._field_hashes, self._metadata_json)
        if changed or overall != self._sha256:
            raise FrozenBatchError(
                f"frozen batch {self._sha256[:12]} changed after freezing: fields {changed or ['<hash table>']}"
            )
        if writable:
            raise FrozenBatchError(f"frozen batch arrays were made writable: {writable}")
        return self._sha256

    # --- use -----------------------------------------------------------------------------

    def to_datums(self, indices: Iterable[int] | None = None) -> list[tinker.Datum]:
        """Datums in the architecture's layout for the given sequences (all by default).
        Checks integrity first: every reuse goes through here."""
        self.assert_intact()
        idx = range(self.n_sequences) if indices is None else list(indices)
        out = []
        for s in idx:
            if not 0 <= s < self.n_sequences:
                raise FrozenBatchError(f"sequence index {s} out of range [0, {self.n_sequences})")
            seq = self.sequence(s)
            out.append(rl_datum(seq["tokens"], seq["logprobs"], seq["advantages"], seq["mask"]))
        return out

    def split_minibatches(self, n_minibatches: int) -> list[Minibatch]:
        """Split into ``n_minibatches`` of complete, equally many groups, in group order."""
        self.assert_intact()
        try:
            split = split_complete_groups(self._arrays["group_ids_S"].tolist(), n_minibatches)
        except ValueError as exc:
            raise FrozenBatchError(str(exc)) from None
        mask_N = self._arrays["loss_mask_N"]
        out = []
        for k, (chosen, seqs) in enumerate(split):
            loss_tokens = int(sum(mask_N[self._offsets_N[s] : self._offsets_N[s + 1]].sum() for s in seqs))
            out.append(Minibatch(k, tuple(chosen), tuple(seqs), loss_tokens))
        return out

    # --- persistence ---------------------------------------------------------------------

    def to_bytes(self) -> tuple[bytes, bytes]:
        """``(npz_bytes, manifest_json_bytes)`` for ``EvidenceBundle.register_bytes``."""
        self.assert_intact()
        buf = io.BytesIO()
        np.savez_compressed(buf, allow_pickle=False, **self._arrays)
        npz = buf.getvalue()
        manifest: JsonObject = {
            "format_version": FORMAT_VERSION,
            "sha256": self._sha256,
            "fields": {
                n: {
                    "sha256": self._field_hashes[n],
                    "dtype": self._arrays[n].dtype.str,
                    "shape": list(self._arrays[n].shape),
                }
                for n in FIELDS
            },
            "metadata": self.metadata,
            "n_sequences": self.n_sequences,
            "n_groups": len(self.group_ids),
            "loss_tokens": int(self._arrays["loss_mask_N"].sum()),
            "npz_sha256": hashlib.sha256(npz).hexdigest(),
        }
        return npz, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, npz_bytes: bytes, manifest_bytes: bytes) -> FrozenBatch:
        """Load and verify against the manifest: any differing hash raises."""
        manifest = json.loads(manifest_bytes)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise FrozenBatchError(f"unsupported frozen batch format {manifest.get('format_version')!r}")
        if "npz_sha256" in manifest and hashlib.sha256(npz_bytes).hexdigest() != manifest["npz_sha256"]:
            raise FrozenBatchError("frozen batch npz bytes differ from the manifest's npz_sha256")
        with np.load(io.BytesIO(npz_bytes), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        fb = cls(arrays, manifest["metadata"])
        bad = [n for n in FIELDS if fb._field_hashes[n] != manifest["fields"][n]["sha256"]]
        if bad or fb.sha256 != manifest["sha256"]:
            raise FrozenBatchError(f"loaded frozen batch differs from its manifest: fields {bad or ['<metadata>']}")
        return fb


def _validate(a: Mapping[str, np.ndarray]) -> None:
    S = a["lengths_S"].size
    for name in ("prompt_lengths_S", "rewards_S", "group_ids_S", "item_ids_S"):
        if a[name].shape != (S,):
            raise FrozenBatchError(f"{name} has shape {a[name].shape}, expected ({S},)")
    N = int(a["lengths_S"].sum())
    for name in ("sampler_logprobs_N", "advantages_N", "loss_mask_N"):
        if a[name].shape != (N,):
            raise FrozenBatchError(f"{name} has shape {a[name].shape}, expected ({N},)")
    if a["tokens_K"].shape != (N + S,):
        raise FrozenBatchError(f"tokens_K has shape {a['tokens_K'].shape}, expected ({N + S},)")
    if (a["lengths_S"] < 1).any():
        raise FrozenBatchError("every sequence needs at least one datum position")
    if not np.isin(a["loss_mask_N"], (0.0, 1.0)).all():
        raise FrozenBatchError("loss_mask_N must be 0.0/1.0")
    for name in ("sampler_logprobs_N", "advantages_N", "rewards_S"):
        if not np.isfinite(a[name]).all():
            raise FrozenBatchError(f"{name} has non-finite values")
    if a["item_ids_S"].dtype.kind != "U":
        raise FrozenBatchError("item_ids_S must be a unicode array")
