"""Checkpoints of the engine's LoRA models: save_state / save_for_sampler (atomic directory
writes), load_state, create_model_from_state, and the tinker:// path they answer to."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from dppo_harness.local_server.engine import model
from dppo_harness.local_server.engine.trainer import TrainModel, make_optimizer
from dppo_harness.local_server.errors import UserError

_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")


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


class CheckpointsMixin:
    """The checkpoint half of `Engine` (mixed into it): adapters (and optimizer state) under
    `run_dir/checkpoints/<model>/<kind>/<name>`, written atomically, verified by sha256 and by the
    base model's hash on load. `Engine` sets the attributes below and provides `_get`,
    `_create_model`, `unload_model`, `_drop_retained` and the sampler cache."""

    run_dir: Path
    served_model_name: str
    base_sha256: str
    _sampler_cache: OrderedDict[tuple[str, str], transformers.PreTrainedModel]
    _sampler_cache_lock: threading.Lock

    if TYPE_CHECKING:

        def _get(self, model_id: str) -> TrainModel: ...

        def _drop_retained(self, model_id: str) -> None: ...

        def _create_model(
            self, base_model: str, lora_rank: int, seed: int | None, targets: tuple[str, ...], model_id: str | None
        ) -> str: ...

        def unload_model(self, model_id: str) -> None: ...

    def _ckpt_dir(self, model_id: str, kind: str, name: str) -> Path:
        safe_id = model_id.replace("/", "_")
        return self.run_dir / "checkpoints" / safe_id / kind / name

    def _parse_path(self, path: str) -> tuple[str, str, str]:
        m = re.match(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$", path or "")
        if not m:
            raise UserError(f"malformed checkpoint path {path!r}; expected tinker://<model_id>/weights/<name>")
        return m.group(1), m.group(2), m.group(3)

    def _meta(self, tm: TrainModel, kind: str, name: str) -> dict:
        return {
            "kind": kind,
            "name": name,
            "model_id": tm.model_id,
            "requested_base_model": tm.requested_base_model,
            "served_model": self.served_model_name,
            "lora_rank": tm.lora_rank,
            "lora_seed": tm.seed,
            "optimizer_steps": tm.steps,
            "lora_targets": list(tm.targets),
            "base_sha256": self.base_sha256,
            "created_unix": time.time(),
        }

    def save_state(self, model_id: str, name: str, overwrite: bool = False) -> str:
        tm = self._get(model_id)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UserError(f"checkpoint name {name!r} must match {_NAME_RE.pattern}")
        with tm.lock:
            adapter = {n: q.detach().to("cpu", copy=True) for n, q in tm.params}
            files = {
                "adapter.pt": model.tensor_bytes(adapter),
                "optimizer.pt": model.tensor_bytes(tm.optimizer.state_dict()),
            }
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

    def checkpoint_meta(self, path: str) -> dict:
        """What a checkpoint on disk says about itself (a restarted server still knows it)."""
        return self._read_ckpt(path)[1]

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
            tm.optimizer = make_optimizer(tm.params)
            if with_optimizer:
                tm.optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))
                tm.steps = int(meta.get("optimizer_steps", 0))
            else:
                tm.steps = 0

    def create_model_from_state(self, path: str, with_optimizer: bool, *, model_id: str | None = None) -> str:
        _, meta = self._read_ckpt(path)
        targets = tuple(meta.get("lora_targets") or model.LORA_TARGETS)
        mid = self._create_model(
            meta["requested_base_model"], int(meta["lora_rank"]), int(meta["lora_seed"]), targets, model_id
        )
        try:
            self.load_state(mid, path, with_optimizer)
        except Exception:
            self.unload_model(mid)
            raise
        return mid
