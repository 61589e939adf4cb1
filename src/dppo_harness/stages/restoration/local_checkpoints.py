"""Local-backend checkpoint arithmetic: the LoRA tensors of a checkpoint the embedded server wrote,
their hash and the distance between two.

An in-process route around the SDK (the Tinker API exposes no parameters): it reads the files under
the embedded server's run_dir, so it imports torch and the server's model module at top level.
`update_norm.LocalCheckpointReader` loads it on its first read, which keeps those imports off the
preflight on every other backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dppo_harness.local_server.checkpoint_files import adapter_file
from dppo_harness.local_server.engine.model import state_sha256
from dppo_harness.train.clients import RestorationError


@dataclass(frozen=True)
class LocalAdapterFiles:
    """The adapter tensors of the checkpoints under one embedded server's `run_dir`."""

    run_dir: Path

    def adapter(self, path: str) -> dict[str, torch.Tensor]:
        """The checkpoint's LoRA tensors by name (`checkpoint_files.adapter_file` says where they are)."""
        f = adapter_file(self.run_dir, path)
        if f is None:
            raise RestorationError(f"not a checkpoint path: {path!r}")
        if not f.is_file():
            raise RestorationError(f"checkpoint {path!r} has no adapter file at {f}")
        return torch.load(f, map_location="cpu", weights_only=True)

    def adapter_sha256(self, path: str) -> str:
        """sha256 over names, dtypes, shapes and raw bytes of the adapter, sorted by name."""
        return state_sha256(self.adapter(path))

    def update_norm(self, before: str, after: str) -> float:
        """||theta_after - theta_before|| over all LoRA parameters, in float64."""
        a, b = self.adapter(before), self.adapter(after)
        if sorted(a) != sorted(b):
            raise RestorationError("checkpoints have different parameter names")
        sq = sum(float(torch.sum((b[k].double() - a[k].double()) ** 2)) for k in a)
        return math.sqrt(sq)
