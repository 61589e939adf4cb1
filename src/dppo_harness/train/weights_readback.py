"""Reading trained weights back through the stock SDK, for the LR-scaling probe on the `tinker`
backend (no local engine there to report the update's size).

tinker 0.25.0 exposes no parameter read on the TrainingClient, but it can save the sampler weights
(`TrainingClient.save_weights_for_sampler`) and hand out a signed download URL of a checkpoint's
archive (`RestClient.get_checkpoint_archive_url_from_tinker_path`). This measure saves before and
after the update, downloads both archives, reads their `.safetensors` members and returns
||theta_after - theta_before|| over every tensor. When any step is refused (Spindle answers the
archive request 405: its checkpoints are read with `modal volume get`, not through the API; an
unsigned or unreachable URL), it returns None and keeps the exact reason in `last_error`; the probe
then records `available: false` with that reason.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import tarfile
from collections.abc import Callable
from typing import Protocol

import httpx
import tinker
import torch
from safetensors.torch import load as load_safetensors


class ArchiveUrls(Protocol):
    """The part of the SDK's RestClient this measure uses."""

    def get_checkpoint_archive_url_from_tinker_path(
        self, tinker_path: str
    ) -> concurrent.futures.Future[tinker.types.CheckpointArchiveUrlResponse]: ...


class ExternalWeightsUpdateNorm:
    """`stages.restoration.UpdateNormMeasure` through saved sampler weights and their archive URLs."""

    description = (
        "tinker backend: ||theta_after - theta_before|| over all tensors of the sampler weights "
        "(TrainingClient.save_weights_for_sampler before and after the update, archives fetched from "
        "RestClient.get_checkpoint_archive_url_from_tinker_path, their .safetensors members read with safetensors)"
    )

    def __init__(
        self,
        rest_client_factory: Callable[[], ArchiveUrls],
        *,
        fetch: Callable[[str], bytes] | None = None,
        timeout_s: float = 300.0,
    ):
        self._rest = rest_client_factory
        self._fetch = fetch or _http_get
        self.timeout_s = timeout_s
        self.last_error: str | None = None
        self._n = 0

    def read(self, client: tinker.TrainingClient, name: str) -> dict[str, torch.Tensor]:
        saved = client.save_weights_for_sampler(name).result(timeout=self.timeout_s)
        archive = self._rest().get_checkpoint_archive_url_from_tinker_path(saved.path).result(timeout=self.timeout_s)
        tensors: dict[str, torch.Tensor] = {}
        with tarfile.open(fileobj=io.BytesIO(self._fetch(archive.url)), mode="r:*") as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if member.isfile() and member.name.endswith(".safetensors"):
                    extracted = tar.extractfile(member)
                    if extracted is not None:
                        for k, v in load_safetensors(extracted.read()).items():
                            tensors[f"{member.name}:{k}"] = v
        if not tensors:
            raise RuntimeError(f"the archive of {saved.path} holds no .safetensors file")
        return tensors

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None:
        self._n += 1
        try:
            before = self.read(client, f"lr-probe-{self._n}-before")
        except Exception as exc:
            self.last_error = f"reading weights before the update failed: {type(exc).__name__}: {exc}"[:500]
            return None  # no update on a client whose weights cannot be read
        apply_update()
        try:
            return update_norm_from_tensors(before, self.read(client, f"lr-probe-{self._n}-after"))
        except Exception as exc:
            self.last_error = f"reading weights after the update failed: {type(exc).__name__}: {exc}"[:500]
            return None


def update_norm_from_tensors(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The float64 L2 norm of the parameter change over every tensor (the same names on both sides)."""
    if set(before) != set(after):
        raise ValueError(f"tensor names differ: {sorted(set(before) ^ set(after))[:5]}")
    return math.sqrt(sum(float(((after[k].double() - before[k].double()) ** 2).sum()) for k in sorted(before)))


def _http_get(url: str) -> bytes:
    r = httpx.get(url, timeout=300.0, follow_redirects=True)
    r.raise_for_status()
    return r.content
