"""Restoration preflight: one shared immutable initial state for both arms, proved, not assumed.

Flow (`run_restoration_preflight`):
1. One fresh LoRA client (plan rank + seed) saves its state as the initial checkpoint; a second
   save under the same name must be refused explicitly for the checkpoint to count as immutable.
2. Each trained arm's client is created from that checkpoint with optimizer state; the load
   response's path is the proof of what was loaded.
3. Full per-token logprobs on a fixed tokenized GSM8K batch, on the arms (one arm: against the
   setup client), before any update: bitwise equal or within `LOGPROB_ATOL`.
4. Probe: the setup client (nothing applied since it saved) is the uninterrupted client; a
   create-save-restore client applies the same fixed-gradient update and must agree. The arms'
   clients are never updated here.
5. Optimizer checks at creation and at every restore, from what server responses expose.
6. LR-scaling probe: a fresh state per learning rate (the setup client's update 1 at the planned
   LR, one client from the initial checkpoint per other LR), the same fixed gradient, norm / LR.

Every check records measured numbers and can fail; `RestorationResult.failures` says which did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import tinker

from dppo_harness import constants
from dppo_harness.loss.correctness import lr_scaling_error
from dppo_harness.service.service_wait_clients import name_client

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan

logger = logging.getLogger(__name__)

LOGPROB_ATOL = 1e-6  # brief: initial outputs "bitwise equal or within 1e-6"
LR_SCALING_RTOL = 0.05  # |(norm/lr) / (norm0/lr0) - 1| allowed; Adam's first step is ~lr * sign(g)
DEFAULT_LR_MULTIPLIERS = (0.5, 1.0, 2.0)
# The arm the bounded diagnostic trains (the PPO baseline is only a counterfactual there).
FIXED_BATCH_ITEMS = 4
ADAM_FAMILIES = {"adam": "adamw", "adamw": "adamw"}  # tinker's Adam is torch AdamW; wd=0 makes them equal
PROVENANCE_FILE = "initialization-provenance.json"
FIXED_BATCH_FILE = "restoration-fixed-batch.json"
INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
RESPONSES_FILE = "restoration-server-responses.json"
PROBE_FILE = "restoration-probe.json"
LR_SCALING_FILE = "lr-scaling-probe.json"


class RestorationError(RuntimeError):
    """A restoration step could not run (as opposed to a check that ran and failed)."""


# --------------------------------------------------------------------------------------------
# Pure helpers: hashing, comparisons, provenance shapes
# --------------------------------------------------------------------------------------------


def datum_arrays(datum: tinker.Datum) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input tokens, target tokens, mask) of one datum; the mask is `mask`, else `weights`."""
    tokens_T = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
    inputs = datum.loss_fn_inputs
    if "target_tokens" not in inputs:
        raise ValueError("fixed-batch datum has no 'target_tokens' in loss_fn_inputs")
    targets_T = np.asarray(inputs["target_tokens"].to_numpy(), dtype=np.int64).reshape(-1)
    mask_key = "mask" if "mask" in inputs else "weights" if "weights" in inputs else None
    if mask_key is None:
        raise ValueError("fixed-batch datum has neither 'mask' nor 'weights' in loss_fn_inputs")
    mask_T = np.asarray(inputs[mask_key].to_numpy(), dtype=np.float32).reshape(-1)
    if not (len(tokens_T) == len(targets_T) == len(mask_T)):
        raise ValueError(
            f"fixed-batch datum lengths differ: tokens {len(tokens_T)}, targets {len(targets_T)}, "
            f"{mask_key} {len(mask_T)}"
        )
    return tokens_T, targets_T, mask_T


def _update_array(h: hashlib._Hash, tag: bytes, arr: np.ndarray) -> None:
    # Length-prefixed, little-endian: concatenations of different splits cannot collide.
    data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    h.update(tag + len(arr).to_bytes(8, "little") + data)


def batch_sha256(batch: Sequence[tinker.Datum]) -> str:
    """sha256 over every datum's input token ids (int64), target ids (int64) and mask (float32)."""
    h = hashlib.sha256(b"dppo-harness/fixed-batch/v1")
    h.update(len(batch).to_bytes(8, "little"))
    for datum in batch:
        tokens_T, targets_T, mask_T = datum_arrays(datum)
        _update_array(h, b"T", tokens_T)
        _update_array(h, b"Y", targets_T)
        _update_array(h, b"M", mask_T)
    return h.hexdigest()


def logprobs_sha256(logprobs: Sequence[np.ndarray]) -> str:
    """sha256 over all per-token logprobs at the precision the server returned (no rounding)."""
    h = hashlib.sha256(b"dppo-harness/logprobs/v1")
    h.update(len(logprobs).to_bytes(8, "little"))
    for lp in logprobs:
        arr = np.asarray(lp)
        h.update(str(arr.dtype).encode() + b"|")
        _update_array(h, b"L", arr.reshape(-1))
    return h.hexdigest()


def compare_logprobs(
    a: Sequence[np.ndarray], b: Sequence[np.ndarray], atol: float = LOGPROB_ATOL
) -> dict[str, Any]:
    """Bitwise equality, max |a-b| and whether it is within `atol`. Shape mismatch never passes."""
    if len(a) != len(b):
        return {"bitwise_equal": False, "max_abs_diff": None, "within_tolerance": False,
                "atol": atol, "problem": f"datum count differs: {len(a)} vs {len(b)}"}
    max_abs = 0.0
    bitwise = True
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return {"bitwise_equal": False, "max_abs_diff": None, "within_tolerance": False,
                    "atol": atol, "problem": f"datum {i} shape differs: {x.shape} vs {y.shape}"}
        bitwise = bitwise and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        if x.size:
            d = np.abs(x.astype(np.float64) - y.astype(np.float64))
            if not np.all(np.isfinite(d)):
                return {"bitwise_equal": False, "max_abs_diff": None, "within_tolerance": False,
                        "atol": atol, "problem": f"datum {i} has non-finite logprobs"}
            max_abs = max(max_abs, float(d.max()))
    return {"bitwise_equal": bool(bitwise), "max_abs_diff": max_abs,
            "within_tolerance": bool(bitwise or max_abs <= atol), "atol": atol}


def normalize_family(name: str | None) -> str | None:
    if name is None:
        return None
    return ADAM_FAMILIES.get(name.lower(), name.lower())


def server_optimizer_family(info: Any) -> str | None:
    """Optimizer family from a GetInfoResponse, only if the server actually sent it.

    The SDK model defaults `optimizer_config` to AdamW when the field is absent, so a default
    value is not evidence: `model_fields_set` tells what came over the wire.
    """
    fields_set = getattr(info, "model_fields_set", None)
    if fields_set is None or "optimizer_config" not in fields_set:
        return None
    cfg = getattr(info, "optimizer_config", None)
    family = getattr(cfg, "type", None)
    return str(family) if family else None


# Keys under which a server may echo applied AdamW hyperparameters in optim_step metrics.
_ECHO_PREFIXES = ("", "adam/", "optim/", "optimizer/", "adam_", "optim_")
_ECHO_SUFFIXES = ("", ":mean", ":max", ":min", ":sum")
_ECHO_ALIASES = {"learning_rate": ("learning_rate", "lr"), "beta1": ("beta1",),
                 "beta2": ("beta2",), "eps": ("eps", "epsilon"),
                 "weight_decay": ("weight_decay",), "grad_clip_norm": ("grad_clip_norm",)}


def echoed_config(metrics: Mapping[str, float] | None, keys: Sequence[str]) -> dict[str, float]:
    """The requested config keys that an optim_step response's metrics echo back."""
    found: dict[str, float] = {}
    if not metrics:
        return found
    for key in keys:
        for alias in _ECHO_ALIASES.get(key, (key,)):
            for pre in _ECHO_PREFIXES:
                for suf in _ECHO_SUFFIXES:
                    name = f"{pre}{alias}{suf}"
                    if name in metrics and key not in found:
                        found[key] = float(metrics[name])
    return found


def optimizer_check(
    *,
    after_restore: int,
    requested_optimizer: str,
    requested_config: Mapping[str, float],
    info: Any,
    info_ref: str,
    echoed: Mapping[str, float] | None,
    echo_ref: str | None,
    echo_observed_on: str | None,
    rtol: float = 1e-9,
) -> dict[str, Any]:
    """One optimizer check: requested family/config against what server responses expose.

    `verified` is true only when the family AND every requested config value came from a server
    response and match. Anything not exposed stays `source: declared, actual: null`.
    """
    family = server_optimizer_family(info)
    want_family = normalize_family(requested_optimizer)
    mismatches: list[str] = []
    if family is not None and normalize_family(family) != want_family:
        mismatches.append(f"optimizer family: requested {requested_optimizer!r}, server {family!r}")
    actual_cfg: dict[str, float] | None = None
    if echoed:
        actual_cfg = {k: float(echoed[k]) for k in requested_config if k in echoed}
        for k, v in requested_config.items():
            if k in echoed and not math.isclose(float(echoed[k]), float(v), rel_tol=rtol, abs_tol=0.0):
                mismatches.append(f"{k}: requested {v!r}, server applied {echoed[k]!r}")
    config_complete = actual_cfg is not None and set(actual_cfg) == set(requested_config)
    unverified = []
    if family is None:
        unverified.append("optimizer family not exposed by any server response")
    if not config_complete:
        missing = sorted(set(requested_config) - set(actual_cfg or {}))
        unverified.append(f"config keys not exposed by any server response: {missing}")
    return {
        "after_restore": after_restore,
        "before_next_update": True,
        "requested_optimizer": requested_optimizer,
        "requested_config": dict(requested_config),
        "actual_optimizer": family,
        "actual_optimizer_source": "server_response" if family is not None else "declared",
        "actual_config": actual_cfg,
        "actual_config_source": "server_response" if actual_cfg else "declared",
        "actual_config_observed_on": echo_observed_on if actual_cfg else None,
        "source": "server_response" if (family is not None or actual_cfg) else "declared",
        "evidence_ref": info_ref if not actual_cfg else f"{info_ref}; {echo_ref}",
        "matches": not mismatches,
        "mismatches": mismatches,
        "verified": bool(family is not None and config_complete and not mismatches),
        "unverified_reasons": unverified,
    }


def initialization_entry(
    *,
    base_checkpoint: str,
    checkpoint_uri: str,
    checkpoint_immutable: bool | None,
    loaded_checkpoint_uri: str | None,
    load_succeeded: bool,
    evidence_ref: str,
    restore_count: int,
    optimizer_checks: list[dict[str, Any]],
    initial_output: dict[str, Any],
    adapter_sha256: str | None = None,
    checkpoint_immutable_reason: str | None = None,
) -> dict[str, Any]:
    """One arm's `initialization_provenance` entry in the brief's version-1 shape.

    `checkpoint_immutable` is None when the duplicate save proved nothing (no explicit refusal);
    `checkpoint_immutable_reason` says what the duplicate save got either way."""
    init: dict[str, Any] = {
        "base_checkpoint": base_checkpoint,
        "checkpoint_uri": checkpoint_uri,
        "checkpoint_immutable": checkpoint_immutable,
        "checkpoint_scope": "full_initialization",
        "loaded_checkpoint_uri": loaded_checkpoint_uri,
        "load_succeeded": load_succeeded,
        "source": "server_response",
        "evidence_ref": evidence_ref,
        "before_first_update": True,
    }
    if checkpoint_immutable_reason is not None:
        init["checkpoint_immutable_reason"] = checkpoint_immutable_reason
    if adapter_sha256 is not None:
        init["adapter_sha256"] = adapter_sha256
    return {
        "initialization": init,
        "restore_count": restore_count,
        "optimizer_checks": optimizer_checks,
        "initial_output": initial_output,
    }


PROBE_ECHO_REASON = ("the config was echoed only by a probe client's optim_step, not by this arm's own client: "
                     "stays declared")


def own_response_only(check: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer check whose config came from a PROBE client's response, reduced to what the
    arm's own responses exposed (the family from its own get_info); the config stays declared/null."""
    c = dict(check)
    observed = str(c.get("actual_config_observed_on") or "")
    if c.get("actual_config") is None or "probe" not in observed:
        return c
    c.update(actual_config=None, actual_config_source="declared", actual_config_observed_on=None,
             source="server_response" if c.get("actual_optimizer") else "declared", verified=False,
             evidence_ref=str(c.get("evidence_ref", "")).split("; ")[0],
             unverified_reasons=list(c.get("unverified_reasons", [])) + [PROBE_ECHO_REASON])
    return c


def check_provenance(provenance: Mapping[str, Any], arms: Sequence[str]) -> list[str]:
    """Every failure of the group's initialization proof; empty means the group is proved."""
    failures: list[str] = []
    entries = provenance.get("arms", {})
    for arm in arms:
        if arm not in entries:
            failures.append(f"{arm}: no initialization_provenance entry")
    present = [a for a in arms if a in entries]
    for arm in present:
        e = entries[arm]
        init = e["initialization"]
        if not init.get("load_succeeded"):
            failures.append(f"{arm}: checkpoint load did not succeed")
        immutable = init.get("checkpoint_immutable")
        if immutable is None:
            failures.append(f"{arm}: checkpoint_immutable unverified: "
                            + str(init.get("checkpoint_immutable_reason") or "no explicit refusal to overwrite"))
        elif not immutable:
            failures.append(f"{arm}: initial checkpoint not shown immutable"
                            + (f": {init['checkpoint_immutable_reason']}" if init.get("checkpoint_immutable_reason")
                               else ""))
        if init.get("loaded_checkpoint_uri") is None:
            failures.append(f"{arm}: no loaded checkpoint URI in the server's load response")
        elif init["loaded_checkpoint_uri"] != init["checkpoint_uri"]:
            failures.append(
                f"{arm}: server loaded {init['loaded_checkpoint_uri']!r}, "
                f"expected {init['checkpoint_uri']!r}"
            )
        checks = e.get("optimizer_checks", [])
        covered = sorted(c["after_restore"] for c in checks)
        if covered != list(range(e["restore_count"] + 1)):
            failures.append(
                f"{arm}: optimizer checks cover restores {covered}, need 0..{e['restore_count']}"
            )
        for c in checks:
            if c["mismatches"]:
                failures.append(f"{arm}: optimizer mismatch after restore {c['after_restore']}: "
                                + "; ".join(c["mismatches"]))
        if not e["initial_output"].get("available"):
            failures.append(f"{arm}: initial output unavailable")
    # Shared identity: one checkpoint, one loaded URI, one batch, same outputs.
    for key, label in (("checkpoint_uri", "initial checkpoint"),
                       ("loaded_checkpoint_uri", "loaded checkpoint"),
                       ("base_checkpoint", "base checkpoint")):
        values = {entries[a]["initialization"].get(key) for a in present}
        if len(values) > 1:
            failures.append(f"arms do not share one {label}: {sorted(map(str, values))}")
    hashes = {entries[a]["initialization"].get("adapter_sha256") for a in present}
    if len(hashes - {None}) > 1:
        failures.append(f"arms' adapter_sha256 differ: {sorted(hashes - {None})}")
    batches = {entries[a]["initial_output"].get("batch_sha256") for a in present}
    if len(batches) > 1:
        failures.append(f"arms' fixed batches differ: {sorted(map(str, batches))}")
    return failures


# --------------------------------------------------------------------------------------------
# Fixed batch
# --------------------------------------------------------------------------------------------


def make_datum(prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
               completion_weight: float = 1.0) -> tinker.Datum:
    """Datum for `forward(..., "cross_entropy")`: shifted input/targets, `completion_weight` on the
    completion's targets, 0 on the prompt (weight 0 everywhere: a forward-only logprob read)."""
    tokens = list(prompt_tokens) + list(completion_tokens)
    if len(completion_tokens) == 0 or len(tokens) < 2:
        raise ValueError("fixed-batch item needs a non-empty completion")
    weights_T = np.zeros(len(tokens) - 1, dtype=np.float32)
    weights_T[len(prompt_tokens) - 1:] = completion_weight
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(weights_T),
        },
    )


def reweighted(batch: Sequence[tinker.Datum], scale: float, keep: Callable[[int], bool]) -> list[tinker.Datum]:
    """The batch with weights scaled on kept datums and zeroed elsewhere (a fixed gradient)."""
    out = []
    for i, d in enumerate(batch):
        _, targets_T, mask_T = datum_arrays(d)
        w_T = (mask_T * np.float32(scale)) if keep(i) else np.zeros_like(mask_T)
        out.append(tinker.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(targets_T),
            "weights": tinker.TensorData.from_numpy(w_T.astype(np.float32))}))
    return out


def reference_completion(solution: str, reference: str) -> str:
    """A GSM8K worked solution as an assistant answer: calculator annotations dropped, the
    '#### N' line replaced by the boxed answer the cookbook's grader reads."""
    body = solution.split("####")[0]
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body} \\boxed{{{reference}}}"


def build_fixed_batch(n_items: int = FIXED_BATCH_ITEMS, seed: int = 0,
                      dataset_name: str = "gsm8k") -> tuple[list[tinker.Datum], dict[str, Any]]:
    """The first `n_items` train items of the plan's dataset (GSM8K: cookbook order, `seed`), rendered with the qwen3_5
    renderer (one-shot prefix, cookbook prompt), reference solutions as the assistant targets.

    Weights are 1 on the assistant answer's tokens, 0 on the prompt (the renderer's supervised
    example). Returns the datums and a description (item ids, lengths) for evidence.
    """
    from dppo_harness.data import dataset, tokenizer

    data = dataset.get(dataset_name)
    bundle = tokenizer.make_renderer()
    items = data.load_split("train", seed=seed).items[:n_items]
    if len(items) < n_items:
        raise RestorationError(f"fixed batch needs {n_items} GSM8K train items, got {len(items)}")
    batch, described = [], []
    for item in items:
        messages = data.prompt_messages(item) + [
            {"role": "assistant", "content": reference_completion(item.solution, item.reference)}]
        model_input, weights = bundle.renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if len(w) != len(tokens) or w.sum() == 0:
            raise RestorationError(f"{item.item_id}: renderer gave {len(w)} weights for {len(tokens)} tokens")
        batch.append(tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                "weights": tinker.TensorData.from_numpy(w[1:].copy()),
            }))
        described.append({"item_id": item.item_id, "tokens": len(tokens),
                          "weighted_targets": int(w[1:].sum())})
    return batch, {"items": described, "renderer": bundle.provenance, "seed": seed}


def batch_to_json(batch: Sequence[tinker.Datum]) -> list[dict[str, Any]]:
    rows = []
    for d in batch:
        tokens_T, targets_T, mask_T = datum_arrays(d)
        rows.append({"input_tokens": tokens_T.tolist(), "target_tokens": targets_T.tolist(),
                     "mask": mask_T.tolist()})
    return rows


# --------------------------------------------------------------------------------------------
# Service calls
# --------------------------------------------------------------------------------------------


def full_logprobs(client: tinker.TrainingClient, batch: Sequence[tinker.Datum]) -> list[np.ndarray]:
    """Per-token logprobs of every target token (forward only, no gradient, no update)."""
    out = client.forward(list(batch), "cross_entropy").result()
    if len(out.loss_fn_outputs) != len(batch):
        raise RestorationError(
            f"forward returned {len(out.loss_fn_outputs)} outputs for {len(batch)} datums")
    result = []
    for i, o in enumerate(out.loss_fn_outputs):
        if "logprobs" not in o:
            raise RestorationError(f"forward output {i} has no 'logprobs' (keys {sorted(o)})")
        result.append(np.asarray(o["logprobs"].to_numpy()).reshape(-1))
    return result


def dump_response(obj: Any) -> Any:
    """JSON-able form of an SDK response (pydantic model, dataclass or plain value)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "__dataclass_fields__"):
        return {k: dump_response(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): dump_response(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [dump_response(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj


def create_from_state_observed(
    service_client: tinker.ServiceClient, path: str, name: str | None = None
) -> tuple[tinker.TrainingClient, tinker.types.LoadWeightsResponse | None]:
    """`create_training_client_from_state_with_optimizer`, keeping the server's load response
    (`service.create_from_state_with_response`: the SDK drops it, yet it is the brief's proof of
    what was loaded). `name` names the client in wait lines (e.g. the arm)."""
    from dppo_harness.service.clients import create_from_state_with_response

    return create_from_state_with_response(service_client, path, name)


class UpdateNormMeasure(Protocol):
    """Measures ||theta_after - theta_before|| around `apply_update()` on `client`, or None.

    A measure whose own requests can be refused (e.g. a service without external weights) must
    not run on a client that has more work to do: the SDK numbers each client's requests, and one
    refused at submit leaves a gap the server waits on before running that client's next request.
    `safe_on_a_working_client` says the measure's requests cannot be refused that way."""

    description: str

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], Any]) -> float | None: ...


class LocalCheckpointReader:
    """Reads adapter tensors of checkpoints the embedded server wrote under its run_dir.

    Local backend only: this is an in-process route around the SDK (the Tinker API exposes no
    parameters). Layout: <run_dir>/checkpoints/<model_id>/<weights|sampler_weights>/<name>/adapter.pt.
    """

    description = ("local backend only: ||theta_after - theta_before|| over all LoRA parameters, read from "
                   "save_state checkpoints the embedded server wrote under its run_dir")

    def __init__(self, run_dir: Any):
        from pathlib import Path

        self.run_dir = Path(run_dir)

    def adapter(self, path: str) -> dict[str, Any]:
        import torch

        m = re.match(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$", path or "")
        if not m:
            raise RestorationError(f"not a checkpoint path: {path!r}")
        d = self.run_dir / "checkpoints" / m.group(1).replace("/", "_") / m.group(2) / m.group(3)
        f = d / "adapter.pt"
        if not f.is_file():
            raise RestorationError(f"checkpoint {path!r} has no adapter file at {f}")
        return torch.load(f, map_location="cpu", weights_only=True)

    def adapter_sha256(self, path: str) -> str:
        """sha256 over names, dtypes, shapes and raw bytes of the adapter, sorted by name."""
        from dppo_harness.local_server.engine.model import state_sha256

        return state_sha256(self.adapter(path))

    def update_norm(self, before: str, after: str) -> float:
        import torch

        a, b = self.adapter(before), self.adapter(after)
        if sorted(a) != sorted(b):
            raise RestorationError("checkpoints have different parameter names")
        sq = sum(float(torch.sum((b[k].double() - a[k].double()) ** 2)) for k in a)
        return math.sqrt(sq)


class CheckpointUpdateNorm:
    """UpdateNormMeasure via save_state before and after the update (local backend)."""

    safe_on_a_working_client = True  # save_state only: a request every backend serves

    def __init__(self, reader: LocalCheckpointReader, tag: str):
        self.reader, self.tag, self.description = reader, tag, reader.description
        self._n = 0

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], Any]) -> float | None:
        self._n += 1
        before = client.save_state(f"{self.tag}-norm{self._n}-before").result().path
        apply_update()
        after = client.save_state(f"{self.tag}-norm{self._n}-after").result().path
        return self.reader.update_norm(before, after)


@dataclass
class _Recorder:
    """Server responses kept for evidence, each under a stable reference id."""

    responses: dict[str, Any] = field(default_factory=dict)

    def keep(self, ref: str, obj: Any) -> str:
        self.responses[ref] = dump_response(obj)
        return f"{RESPONSES_FILE}#{ref}"


@dataclass
class RestorationResult:
    initial_checkpoint: str
    loaded_paths: dict[str, str]
    clients: dict[str, tinker.TrainingClient]
    fixed_batch: list[tinker.Datum]
    batch_sha256: str
    output_sha256: dict[str, str]
    provenance: dict
    passed: bool
    failures: list[str]
    lr_scaling: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0
    loaded: dict[str, LoadedArm] = field(default_factory=dict)  # each loaded arm: client, load response, get_info

    def failure_message(self) -> str:
        return "restoration preflight failed:\n  - " + "\n  - ".join(self.failures)


def restoration_arms(spec: ExperimentSpec) -> list[dict[str, Any]]:
    """The (single) initialization group's arms with optimizer and config, from the validated spec."""
    rp = spec.restoration_preflight
    if not rp.applicable:
        raise RestorationError("plan has no applicable restoration_preflight")
    if len(rp.groups) != 1:
        raise RestorationError(f"restoration_preflight needs exactly one group, got {len(rp.groups)}")
    arms = rp.groups[0].arms
    if len(arms) < 2:
        raise RestorationError("restoration_preflight group needs at least two arms")
    return [a.model_dump(exclude_none=True) for a in arms]


def _adam(cfg: Mapping[str, float], lr: float | None = None) -> tinker.AdamParams:
    kw = {k: float(v) for k, v in cfg.items() if k in tinker.AdamParams.model_fields}
    if lr is not None:
        kw["learning_rate"] = float(lr)
    return tinker.AdamParams(**kw)


def _step(client: tinker.TrainingClient, batch: Sequence[tinker.Datum], adam: tinker.AdamParams):
    """One fixed-gradient update: cross-entropy on fixed weights, then optim_step."""
    fb = client.forward_backward(list(batch), "cross_entropy")
    opt = client.optim_step(adam)
    return fb.result(), opt.result()


# A refusal to overwrite names the existing checkpoint; other failures of the duplicate save
# (timeouts, 5xx, capacity, connection errors) say nothing about immutability.
OVERWRITE_REFUSAL_RE = re.compile(r"already exists|exists already|overwrit|immutable", re.IGNORECASE)


def duplicate_save_outcome(exc: BaseException | None) -> tuple[bool | None, str]:
    """(checkpoint_immutable, reason) from the second save_state under the same name.

    True only on the service's explicit refusal to overwrite: HTTP 409, or a failed request / 400
    that is not a server-side failure and whose text says the checkpoint exists or may not be
    overwritten. A second save that succeeded is False (the name is not immutable). Anything else
    (timeout, 5xx, capacity, connection, other errors) is None: unverified, with the reason.
    """
    from dppo_harness.service.clients import error_text, is_capacity_error

    if exc is None:
        return False, "the service accepted a second save_state under the same name without overwrite"
    text = error_text(exc)
    what = f"{type(exc).__name__}: {text}"[:300]
    refused = False
    if isinstance(exc, tinker.ConflictError):
        refused = True
    elif is_capacity_error(exc):
        refused = False
    elif isinstance(exc, tinker.RequestFailedError):
        refused = exc.category != tinker.types.RequestErrorCategory.Server and bool(OVERWRITE_REFUSAL_RE.search(text))
    elif isinstance(exc, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        refused = bool(OVERWRITE_REFUSAL_RE.search(text))
    if refused:
        return True, f"the service refused to overwrite the saved name ({what})"
    return None, (f"the duplicate save_state ended in {what}, not an explicit refusal to overwrite: "
                  "immutability unverified")


@dataclass(frozen=True)
class InitialCheckpoint:
    client: tinker.TrainingClient  # the fresh setup client that saved it (released with its ServiceClient)
    path: str
    immutable: bool | None  # None: the duplicate save proved nothing either way
    immutable_reason: str = ""
    info: Any = None  # the setup client's get_info at creation, before any update


@dataclass(frozen=True)
class LoadedArm:
    client: tinker.TrainingClient
    loaded_path: str | None  # the server's load response path (the proof), None if not observed
    load_ref: str
    load_succeeded: bool
    source_path: str = ""  # the checkpoint the load asked for
    response: Any = None  # the LoadWeightsResponse as the SDK parsed it (None: not observed)
    info: Any = None  # the client's get_info right after the load
    seconds: float = 0.0  # wall time of the load (client creation included)

    def restore_record(self) -> dict[str, Any]:
        """The load as a stage that trains this client records it (its own restore, not a new one)."""
        return {"initial_checkpoint": self.source_path, "loaded_checkpoint_uri": self.loaded_path,
                "load_succeeded": self.load_succeeded, "load_response": dump_response(self.response),
                "get_info": dump_response(self.info), "before_first_update": True,
                "evidence_ref": self.load_ref, "seconds": self.seconds}


def _register_fixed_batch(bundle: EvidenceBundle, fixed_batch: Sequence[tinker.Datum], description: Any) -> str:
    b_sha = batch_sha256(fixed_batch)
    bundle.register_json(FIXED_BATCH_FILE, "tensors", {
        "batch_sha256": b_sha,
        "hash": "sha256 over each datum's int64 input ids, int64 target ids and float32 mask (weights), "
                "length-prefixed; see restoration.batch_sha256",
        "description": description, "datums": batch_to_json(fixed_batch)})
    return b_sha


def _fresh_checkpoint(probe_sc: tinker.ServiceClient, base_model: str, rank: int, label: str, seed: int, tag: str,
                      rec: _Recorder, call: Callable[[Callable[[], Any]], Any]) -> InitialCheckpoint:
    """Step 1: a fresh LoRA client saves the immutable initial checkpoint."""
    # Setup client on the probe ServiceClient: released with it; its checkpoint stays.
    client = call(lambda: probe_sc.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result())
    name_client(client, f"setup client ({label}, seed {seed})")
    from dppo_harness.service.clients import describe_client

    describe_client(probe_sc, client, f"setup ({label}, seed {seed}): saves the initial checkpoint"
                    + ("; then the uninterrupted restore probe and the base-LR scaling probe" if label == "shared" else ""))
    info = client.get_info()
    rec.keep(f"create_{label}.get_info", info)
    name = f"{tag}-initial-{label}-seed{seed}"
    saved = client.save_state(name).result()
    rec.keep(f"save_{label}", saved)
    # Immutability: the server must explicitly refuse to replace the name without overwrite=True.
    try:
        again = client.save_state(name).result()
    except Exception as exc:
        immutable, reason = duplicate_save_outcome(exc)
        rec.keep(f"save_{label}_again_refused" if immutable else f"save_{label}_again_failed",
                 {"error": f"{type(exc).__name__}: {exc}", "checkpoint_immutable": immutable, "reason": reason})
    else:
        immutable, reason = duplicate_save_outcome(None)
        rec.keep(f"save_{label}_again", again)
    return InitialCheckpoint(client, saved.path, immutable, reason, info)


def _load_arm(service_client: tinker.ServiceClient, arm: str, path: str, rec: _Recorder,
              call: Callable[[Callable[[], Any]], Any]) -> LoadedArm:
    """Step 2: the arm's client from the checkpoint with optimizer; the load response kept. A
    response without `path` (optional in the SDK's LoadWeightsResponse) leaves the URI unproved."""
    from dppo_harness.service.clients import describe_client

    t0 = time.monotonic()
    client, resp = call(lambda: create_from_state_observed(service_client, path, arm))
    seconds = time.monotonic() - t0
    describe_client(service_client, client, f"arm {arm}: loaded from the initial checkpoint with optimizer")
    load_ref = rec.keep(f"load_{arm}", resp if resp is not None else {"response": None})
    info = client.get_info()
    rec.keep(f"load_{arm}.get_info", info)
    return LoadedArm(client, resp.path if resp is not None and resp.path else None, load_ref, resp is not None,
                     source_path=path, response=resp, info=info, seconds=seconds)


def _adapter_hashes(reader: LocalCheckpointReader | None, arms: Mapping[str, LoadedArm],
                    source_of: Mapping[str, str], tag: str, rec: _Recorder) -> tuple[dict[str, str | None], str, list[str]]:
    """Adapter hashes as loaded (local backend: read back from a save of each arm; not an update)."""
    hashes: dict[str, str | None] = dict.fromkeys(arms)
    if reader is None:
        return hashes, "not measurable over the Tinker API on this backend", []
    note = ("local_hash: sha256 of the LoRA tensors in a save_state of each arm taken right "
            "after its load, read from the embedded server's run_dir")
    failures = []
    for a, arm in arms.items():
        snap = arm.client.save_state(f"{tag}-{a}-as-loaded").result()
        rec.keep(f"save_{a}_as_loaded", snap)
        hashes[a] = reader.adapter_sha256(snap.path)
        src_sha = reader.adapter_sha256(source_of[a])
        if hashes[a] != src_sha:
            failures.append(f"{a}: adapter as loaded ({hashes[a][:12]}) differs from its checkpoint's ({src_sha[:12]})")
    return hashes, note, failures


SOURCE_OUTPUT_KEY = "initial_checkpoint_source"


def _initial_outputs(bundle: EvidenceBundle, arms: Mapping[str, LoadedArm], fixed_batch: Sequence[tinker.Datum],
                     b_sha: str, atol: float, source: Sequence[np.ndarray] | None = None,
                     ) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """Step 3: full logprobs of every arm on the fixed batch before any update, compared. With a
    single arm, `source` (the setup client's logprobs, taken before its first update) is what it
    is compared with, so the check can still fail."""
    names = list(arms)
    logprobs = {a: full_logprobs(arms[a].client, fixed_batch) for a in names}
    out_sha = {a: logprobs_sha256(lp) for a, lp in logprobs.items()}
    pairs = [(names[0], other, logprobs[other]) for other in names[1:]]
    if len(names) == 1 and source is not None:
        pairs = [(names[0], SOURCE_OUTPUT_KEY, source)]
    cmp, failures = {}, []
    for first, other, lp in pairs:
        c = compare_logprobs(logprobs[first], lp, atol)
        cmp[f"{first}_vs_{other}"] = c
        if not c["within_tolerance"]:
            failures.append(f"initial logprobs differ between {first} and {other}: max |diff| "
                            f"{c['max_abs_diff']} > {atol}" + (f" ({c['problem']})" if "problem" in c else ""))
    stored = dict(logprobs)
    if len(names) == 1 and source is not None:
        stored[SOURCE_OUTPUT_KEY] = list(source)
    bundle.register_json(INITIAL_OUTPUT_FILE, "tensors", {
        "batch_sha256": b_sha, "dtype": {a: str(lp[0].dtype) for a, lp in stored.items()},
        "output_sha256": out_sha, "comparison": cmp,
        "hash": "sha256 over every datum's per-token logprobs at the returned precision; see "
                "restoration.logprobs_sha256",
        "logprobs": {a: [x.tolist() for x in lp] for a, lp in stored.items()}})
    return out_sha, cmp, failures


def _provenance_entries(arms_cfg: Sequence[Mapping[str, Any]], base_model: str, sources: Mapping[str, InitialCheckpoint],
                        source_label: Mapping[str, str], loaded: Mapping[str, LoadedArm], probe: Mapping[str, Any],
                        b_sha: str, out_sha: Mapping[str, str], adapter_sha: Mapping[str, str | None]) -> dict[str, Any]:
    """Step 5: each arm's initialization entry with optimizer checks at creation (0) and restore (1)."""
    echo = probe.get("echoed_config") or None
    entries: dict[str, Any] = {}
    for arm in arms_cfg:
        a = arm["name"]
        if a not in loaded:
            continue
        common = dict(requested_optimizer=arm["optimizer"], requested_config=arm["optimizer_config"],
                      echoed=echo, echo_ref=probe.get("echo_ref"), echo_observed_on=probe.get("echo_observed_on"))
        checks = [
            optimizer_check(after_restore=0, info=sources[a].info,
                            info_ref=f"{RESPONSES_FILE}#create_{source_label[a]}.get_info", **common),
            optimizer_check(after_restore=1, info=loaded[a].info,
                            info_ref=f"{RESPONSES_FILE}#load_{a}.get_info", **common),
        ]
        entries[a] = initialization_entry(
            base_checkpoint=base_model,
            checkpoint_uri=sources[a].path,
            checkpoint_immutable=sources[a].immutable,
            checkpoint_immutable_reason=sources[a].immutable_reason or None,
            loaded_checkpoint_uri=loaded[a].loaded_path,
            load_succeeded=loaded[a].load_succeeded,
            evidence_ref=loaded[a].load_ref,
            restore_count=1,
            optimizer_checks=checks,
            initial_output={"available": True, "batch_sha256": b_sha, "output_sha256": out_sha[a],
                            "evidence_ref": INITIAL_OUTPUT_FILE, "before_first_update": True},
            adapter_sha256=adapter_sha[a],
        )
    return entries


def run_restoration_preflight(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    base_model: str = constants.BASE_MODEL,
    fixed_batch: Sequence[tinker.Datum] | None = None,
    fixed_batch_description: Any = None,
    atol: float = LOGPROB_ATOL,
    lr_multipliers: Sequence[float] = DEFAULT_LR_MULTIPLIERS,
    lr_rtol: float = LR_SCALING_RTOL,
    checkpoint_reader: LocalCheckpointReader | None = None,
    update_norm: UpdateNormMeasure | None = None,
    update_norm_unavailable_reason: str = (
        "the Tinker API exposes neither parameters nor an update-norm metric (optim_step reports "
        "the gradient norm only), so update norms cannot be measured on this backend"),
    probe_service_client: tinker.ServiceClient | None = None,
    arm_seed_overrides: Mapping[str, int] | None = None,
    probe_restore_with_optimizer: bool = True,
    call: Callable[[Callable[[], Any]], Any] | None = None,
    run_tag: str | None = None,
    trained_arms: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RestorationResult:
    """Run the restoration preflight for the initialization group of the plan's spec (a
    diagnostic's: its original plan's); see module docstring.

    - `trained_arms`: the arms that will train in this session (None: all). Only they get a client
      (loaded from the initial checkpoint) and an `initialization_provenance` entry; an untrained arm
      is never created and is left out of the optimizer-restoration groups as the brief asks (listed
      under `excluded_arms` with the reason). A single trained arm's initial output is compared with
      the setup client's, taken before that client's first update.

    - `checkpoint_reader` (local backend): measures adapter_sha256 of each arm as loaded and the
      LR-scaling update norms from server-written checkpoints. Without it (and without
      `update_norm`) the LR probe is recorded unavailable with the reason.
    - `probe_service_client`: where the setup (fresh) client and the probe clients live, so the
      caller can release them (close that ServiceClient) before the arms train; the arms live on
      `service_client`. Defaults to `service_client`.
    - `arm_seed_overrides`: give an arm its own fresh client with another seed (a deliberately
      mismatched initial state, for failure-path tests).
    - `probe_restore_with_optimizer=False`: the probe restores weights only (failure-path tests:
      the restored-vs-uninterrupted check must then fail).
    - `call`: wraps every client-creating call (e.g. `service.call_with_capacity_retry`).
    - `progress`: one line at every step (which of the six, how far along), so the preflight is never silent.
    """
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] restoration {msg} ({time.monotonic() - t0:.0f}s)")

    call = call or (lambda fn: fn())
    probe_sc = probe_service_client or service_client
    spec_plan = plan.spec_plan
    run = spec_plan.run
    assert run is not None  # every experiment spec has its RunConfig from load
    arms = restoration_arms(spec_plan.experiment)
    all_arm_names = [a["name"] for a in arms]
    if trained_arms is not None:
        unknown = sorted(set(trained_arms) - set(all_arm_names))
        if unknown or not trained_arms:
            raise RestorationError(f"trained_arms {list(trained_arms)}: not arms of the initialization group "
                                   f"{all_arm_names}")
    arm_names = [a for a in all_arm_names if trained_arms is None or a in set(trained_arms)]
    rank = run.lora_rank
    seeds = {a.name: a.seed for a in run.arms}
    if len({seeds.get(a) for a in arm_names}) > 1:
        raise RestorationError(f"arms in one initialization group have different seeds: {seeds}")
    seed = seeds.get(arm_names[0], 0)
    tag = run_tag or bundle.run_id or uuid.uuid4().hex[:12]
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", str(tag))[:64]
    rec = _Recorder()
    failures: list[str] = []

    if fixed_batch is None:
        fixed_batch, fixed_batch_description = build_fixed_batch(seed=seed, dataset_name=run.dataset)
    fixed_batch = list(fixed_batch)
    if len(fixed_batch) < 2:
        raise RestorationError("fixed batch needs at least 2 datums (two distinct fixed gradients)")
    b_sha = _register_fixed_batch(bundle, fixed_batch, fixed_batch_description)

    # 1. Fresh LoRA client(s) and the immutable initial checkpoint(s).
    say(f"1/6: fresh LoRA rank-{rank} client on {base_model} and the shared initial checkpoint")
    arm_seed = {a: (arm_seed_overrides or {}).get(a, seed) for a in arm_names}
    by_seed = {seed: _fresh_checkpoint(probe_sc, base_model, rank, "shared", seed, tag, rec, call)}
    for a, s in arm_seed.items():
        if s not in by_seed:
            by_seed[s] = _fresh_checkpoint(probe_sc, base_model, rank, a, s, tag, rec, call)
    sources = {a: by_seed[arm_seed[a]] for a in arm_names}
    source_label = {a: "shared" if arm_seed[a] == seed else a for a in arm_names}
    initial_checkpoint = by_seed[seed].path
    bundle.add_checkpoint("initial", 0, initial_checkpoint)
    # The setup client's own output, before its first update: what one loaded arm is compared with.
    source_lp = full_logprobs(by_seed[seed].client, fixed_batch) if len(arm_names) == 1 else None

    # 2. Arms from the checkpoint with optimizer; keep the load responses.
    loaded = {}
    for i, a in enumerate(arm_names, start=1):
        say(f"2/6: loading arm {a} ({i}/{len(arm_names)}) from {sources[a].path} with optimizer")
        loaded[a] = _load_arm(service_client, a, sources[a].path, rec, call)
    adapter_sha, adapter_note, adapter_failures = _adapter_hashes(
        checkpoint_reader, loaded, {a: sources[a].path for a in arm_names}, tag, rec)
    failures += adapter_failures

    # 3. Initial outputs on the fixed batch, before any update.
    say(f"3/6: initial logprobs of {len(arm_names)} arms on the fixed batch ({len(fixed_batch)} datums)")
    out_sha, cmp, output_failures = _initial_outputs(
        bundle, loaded, fixed_batch, b_sha, atol,
        source=source_lp if arm_seed[arm_names[0]] == seed else None)
    failures += output_failures

    # 4. Probe: the setup client (uninterrupted) vs a create-save-restore client, same two
    # fixed-gradient updates; update 1 is also the LR-scaling probe at the planned LR.
    opt_cfg = dict(arms[0]["optimizer_config"])
    if update_norm is None and checkpoint_reader is not None:
        update_norm = CheckpointUpdateNorm(checkpoint_reader, f"{tag}-lr")
    base_lr = float(opt_cfg["learning_rate"])
    lr_in_plan = planned_lr_on_setup_client(update_norm, lr_multipliers)
    say("4/6: create-save-restore probe (uninterrupted setup client vs restored client, 2 fixed-gradient updates)")
    probe = _restore_probe(probe_sc, by_seed[seed].client, initial_checkpoint, fixed_batch, opt_cfg, tag, rec,
                           atol, call, restore_optimizer=probe_restore_with_optimizer,
                           update_norm=update_norm if lr_in_plan else None, say=say)
    failures.extend(probe["failures"])

    # 5. Optimizer checks and the provenance entries.
    say("5/6: optimizer checks and initialization provenance")
    prov_body = {"version": 1, "arms": _provenance_entries(arms, base_model, sources, source_label, loaded, probe,
                                                           b_sha, out_sha, adapter_sha)}
    failures.extend(check_provenance(prov_body, arm_names))
    excluded = {a: ("never trains in this session: no client created for it, excluded from the "
                    "optimizer-restoration groups") for a in all_arm_names if a not in arm_names}

    # 6. LR-scaling probe (the planned LR was measured on the setup client in step 4).
    say(f"6/6: LR-scaling probe ({len(lr_multipliers)} learning rates, a fresh state each"
        + ("; the planned one is the probe's update 1 on the setup client)" if lr_in_plan and update_norm else ")"))
    lr_block = lr_scaling_probe(probe_sc, initial_checkpoint, fixed_batch, opt_cfg, lr_multipliers,
                                lr_rtol, update_norm, update_norm_unavailable_reason, call,
                                measured={base_lr: probe["base_lr_update_norm"]} if lr_in_plan and update_norm else None,
                                say=say)
    if lr_block["available"] and not lr_block["passed"]:
        failures.append(f"LR scaling: {lr_block['problem']}")

    passed = not failures
    provenance = {
        **prov_body,
        **({"excluded_arms": excluded} if excluded else {}),
        "group": {"arms": arm_names, "initial_checkpoint": initial_checkpoint,
                  "initial_output_comparison": cmp, "adapter_sha256_method": adapter_note,
                  "restore_probe": PROBE_FILE, "server_responses": RESPONSES_FILE},
        "passed": passed, "failures": list(failures),
    }
    say(f"{'passed' if passed else 'FAILED'}" + (f": {len(failures)} problem(s)" if failures else ""))
    bundle.register_json(RESPONSES_FILE, "log", rec.responses)
    bundle.register_json(PROBE_FILE, "metrics", probe)
    bundle.register_json(LR_SCALING_FILE, "metrics", lr_block)
    bundle.register_json(PROVENANCE_FILE, "manifest", provenance)
    wall = time.monotonic() - t0
    posted = prov_body
    if trained_arms is not None:
        # Each posted check keeps only what the arm's OWN responses exposed.
        posted = {"version": 1, "arms": {a: dict(e, optimizer_checks=[own_response_only(c) for c in e["optimizer_checks"]])
                                         for a, e in prov_body["arms"].items()},
                  "excluded_arms": excluded}
    bundle.update_result(initialization_provenance=posted,
                         metrics={"preflight/restoration_wall_seconds": wall,
                                  "preflight/restoration_passed": 1.0 if passed else 0.0})
    return RestorationResult(
        initial_checkpoint=initial_checkpoint, loaded_paths={a: arm.loaded_path for a, arm in loaded.items()
                                                             if arm.loaded_path},
        clients={a: arm.client for a, arm in loaded.items()}, loaded=dict(loaded),
        fixed_batch=fixed_batch, batch_sha256=b_sha, output_sha256=out_sha, provenance=provenance,
        passed=passed, failures=failures, lr_scaling=lr_block, probe=probe, wall_seconds=wall)


def planned_lr_on_setup_client(update_norm: UpdateNormMeasure | None, multipliers: Sequence[float]) -> bool:
    """Whether the planned LR's scaling probe is the setup client's update 1 (no client of its own):
    only with a measure that cannot leave that client waiting on a refused request (it still has
    the restore probe to run); otherwise every LR gets its own client."""
    return (update_norm is not None and any(float(m) == 1.0 for m in multipliers)
            and bool(getattr(update_norm, "safe_on_a_working_client", False)))


def probe_gradient(batch: Sequence[tinker.Datum]) -> list[tinker.Datum]:
    """The fixed gradient of the restore probe's update 1 and of every LR-scaling probe."""
    return reweighted(batch, 1.0, lambda i: i % 2 == 0)


def _restore_probe(service_client, uninterrupted, initial_checkpoint, batch, opt_cfg, tag, rec, atol, call,
                   restore_optimizer: bool = True, update_norm: UpdateNormMeasure | None = None,
                   say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Uninterrupted vs create-save-restore probe clients must agree after the same update.

    `uninterrupted` is the setup client that saved the initial checkpoint and has applied nothing
    since (the same state a fresh client from that checkpoint has). Two different fixed gradients
    (even / odd datums) are used so that a restore that dropped the Adam moments would give a
    different second update (with one repeated gradient a fresh Adam and a continued one take the
    same bias-corrected step, and the check could not fail). With `update_norm`, update 1 is also
    the LR-scaling probe at the planned LR (`base_lr_update_norm`).
    """
    failures: list[str] = []
    adam = _adam(opt_cfg)
    g1 = probe_gradient(batch)
    g2 = reweighted(batch, 1.0, lambda i: i % 2 == 1)
    say("4/6: probe update 1 on the uninterrupted client")
    norm1: float | None = None
    if update_norm is None:
        _, opt1 = _step(uninterrupted, g1, adam)
    else:
        done: dict[str, Any] = {}
        norm1 = update_norm(uninterrupted, lambda: done.setdefault("step", _step(uninterrupted, g1, adam)))
        _, opt1 = done["step"] if "step" in done else _step(uninterrupted, g1, adam)  # weights unread: no norm
    echo_ref = rec.keep("probe_optim_step_1", opt1)
    mid = uninterrupted.save_state(f"{tag}-probe-after-update1").result()
    rec.keep("probe_save_mid", mid)
    if restore_optimizer:
        restored, resp = call(lambda: create_from_state_observed(service_client, mid.path))
    else:  # failure-path tests only: a restore that drops the Adam moments must be caught
        restored = call(lambda: service_client.create_training_client_from_state(mid.path).result())
        resp = tinker.types.LoadWeightsResponse(path=mid.path)
    from dppo_harness.service.clients import describe_client

    describe_client(service_client, restored, "restore probe: created from the uninterrupted probe's mid save")
    rec.keep("probe_load_mid", resp if resp is not None else {"response": None})
    rec.keep("probe_load_mid.get_info", restored.get_info())
    say("4/6: probe update 2 on both clients, then logprobs compared")
    before = full_logprobs(uninterrupted, batch)
    _, opt2_u = _step(uninterrupted, g2, adam)
    _, opt2_r = _step(restored, g2, adam)
    rec.keep("probe_optim_step_2_uninterrupted", opt2_u)
    rec.keep("probe_optim_step_2_restored", opt2_r)
    after_u = full_logprobs(uninterrupted, batch)
    after_r = full_logprobs(restored, batch)
    cmp = compare_logprobs(after_u, after_r, atol)
    effect = compare_logprobs(before, after_u, atol)
    if resp is None or resp.path != mid.path:
        failures.append(f"probe restore: server load response path {getattr(resp, 'path', None)!r} "
                        f"!= saved {mid.path!r}")
    if not cmp["within_tolerance"]:
        failures.append(f"restored probe update differs from uninterrupted: max |diff| "
                        f"{cmp['max_abs_diff']} > {atol}")
    if effect["within_tolerance"]:
        failures.append(f"probe update changed logprobs by only {effect['max_abs_diff']} <= {atol}: "
                        "the restore comparison cannot tell a lost update from a matching one")
    keys = list(opt_cfg)
    echoed = echoed_config(opt1.metrics, keys)
    return {
        "initial_checkpoint": initial_checkpoint, "mid_checkpoint": mid.path,
        "loaded_checkpoint_uri": getattr(resp, "path", None),
        "updates": ["cross_entropy on even datums + optim_step", "cross_entropy on odd datums + optim_step"],
        "adam_params": adam.model_dump(), "restored_vs_uninterrupted": cmp,
        "second_update_effect": effect,
        "optim_metrics": {"update1": dict(opt1.metrics or {}),
                          "update2_uninterrupted": dict(opt2_u.metrics or {}),
                          "update2_restored": dict(opt2_r.metrics or {})},
        "echoed_config": echoed, "echo_ref": echo_ref,
        "echo_observed_on": "probe client (the setup client that saved the initial checkpoint, nothing applied "
                            "since) (optim_step response metrics)",
        "uninterrupted_client": "the setup client that saved the initial checkpoint (no update before update 1)",
        "base_lr_update_norm": norm1,
        "failures": failures,
    }


def lr_scaling_probe(
    service_client, initial_checkpoint, batch, opt_cfg, multipliers, rtol,
    update_norm: UpdateNormMeasure | None, unavailable_reason: str, call=None,
    measured: Mapping[float, float | None] | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """A fresh state from the initial checkpoint per LR, the same fixed gradient, update norms.

    `measured`: LRs already probed from a fresh state (the restore probe's update 1 on the setup
    client, at the planned LR); None there means that measure failed, and no further client is
    created. Every other LR gets its own client created from the initial checkpoint with optimizer.
    Adam's first step is lr * m_hat / (sqrt(v_hat) + eps) ~ lr * sign(g), so update_norm / lr
    should be the same at every LR; the relative change against the first probe is checked.
    """
    base_lr = float(opt_cfg["learning_rate"])
    lrs = [base_lr * float(m) for m in multipliers]
    if update_norm is None:
        return {"available": False, "reason": unavailable_reason, "learning_rates": lrs,
                "lr_scaling": [], "passed": None}
    measured = dict(measured or {})

    def unavailable() -> dict[str, Any]:
        why = getattr(update_norm, "last_error", None) or "no measurement"
        return {"available": False, "reason": f"{update_norm.description}: {why}",
                "learning_rates": lrs, "lr_scaling": [], "passed": None}

    if any(v is None for v in measured.values()):
        return unavailable()
    from dppo_harness.service.clients import describe_client

    g = probe_gradient(batch)
    norms: dict[float, float] = {lr: float(v) for lr, v in measured.items() if v is not None}
    for i, lr in enumerate(lrs, start=1):
        if lr in norms:
            say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}: measured by the restore probe's update 1")
            continue
        say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}")
        client, _ = (call or (lambda fn: fn()))(
            lambda: create_from_state_observed(service_client, initial_checkpoint))
        describe_client(service_client, client, f"LR-scaling probe at lr {lr:g} (fresh from the initial checkpoint)")
        adam = _adam(opt_cfg, lr)
        norm = update_norm(client, lambda c=client, a=adam: _step(c, g, a))
        if norm is None:
            return unavailable()
        norms[lr] = float(norm)
    probes: list[dict[str, float]] = [{"learning_rate": lr, "update_norm": norms[lr]} for lr in lrs]
    errors = lr_scaling_error(probes)
    worst = max(errors)
    passed = bool(all(p["update_norm"] > 0 for p in probes) and worst <= rtol)
    problem = None
    if not passed:
        problem = (f"update_norm/LR changes by {worst:.3g} relative to the first probe (> {rtol})"
                   if worst > rtol else "an update norm is zero: the update did not move parameters")
    reset = ("a fresh state from the initial checkpoint per probe: the setup client that saved it (nothing applied "
             "before; the restore probe's update 1) at the planned LR, a client created from it with optimizer at "
             "every other LR") if measured else "a client created from the initial checkpoint with optimizer per probe"
    return {"available": True, "measure": update_norm.description, "reset": reset,
            "gradient": "cross_entropy on the even fixed-batch datums (the restore probe's update 1)",
            "lr_scaling": probes, "relative_error": [e if math.isfinite(e) else None for e in errors],
            "rtol": rtol, "passed": passed,
            "problem": problem}


def attach_lr_scaling(correctness_block: Mapping[str, Any], lr_block: Mapping[str, Any]) -> dict[str, Any]:
    """The correctness_preflight block with every path's `lr_scaling` filled from the LR probe.

    Where the backend could not measure update norms, each planned LR gets an entry with
    `update_norm: null`, `available: false` and the reason (never invented, never an empty list),
    and `lr_scaling_status` says why.
    """
    out = json.loads(json.dumps(correctness_block))
    status = {"available": bool(lr_block.get("available")),
              "evidence_ref": LR_SCALING_FILE}
    if lr_block.get("available"):
        status.update(passed=lr_block.get("passed"), rtol=lr_block.get("rtol"),
                      relative_error=lr_block.get("relative_error"), measure=lr_block.get("measure"),
                      reset=lr_block.get("reset"))
    else:
        status["reason"] = lr_block.get("reason")
    for path in out.get("paths", []):
        if lr_block.get("available"):
            path["lr_scaling"] = [dict(p) for p in lr_block.get("lr_scaling", [])]
        else:  # the brief's block, one entry per planned LR: unmeasured, with the exact reason (never [])
            path["lr_scaling"] = [{"learning_rate": float(lr), "update_norm": None, "available": False,
                                   "reason": str(lr_block.get("reason") or "not measured")}
                                  for lr in (lr_block.get("learning_rates") or [])] or [
                {"learning_rate": None, "update_norm": None, "available": False,
                 "reason": str(lr_block.get("reason") or "not measured")}]
        path["lr_scaling_status"] = status
    return out
