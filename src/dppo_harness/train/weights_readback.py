"""Reading trained weights back through the stock SDK, for the LR-scaling probe on the `tinker`
backend (no local engine there to report the update's size).

tinker 0.38.0 exposes no parameter read on the TrainingClient, but it can save weights in an
external (HuggingFace) format (`TrainingClient.save_weights_external`) and hand out signed
download URLs per file (`RestClient.get_external_weights_urls`). This measure saves before and
after the update, downloads the `.safetensors` files and returns ||theta_after - theta_before||
over every tensor. When any step is refused (a server without external weights, an unsigned or
unreachable URL), it returns None and keeps the exact reason in `last_error`; the probe then
records `available: false` with that reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx
import tinker
import torch
from safetensors.torch import load as load_safetensors

DESCRIPTION = (
    "tinker backend: ||theta_after - theta_before|| over all tensors of the external-format weights "
    "(TrainingClient.save_weights_external before and after the update, files fetched from "
    "RestClient.get_external_weights_urls, read with safetensors)"
)


def update_norm_from_tensors(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """L2 norm of the parameter change over the union of tensor names (float64)."""
    if set(before) != set(after):
        raise ValueError(f"tensor names differ: {sorted(set(before) ^ set(after))[:5]}")
    total = 0.0
    for name in sorted(before):
        d = after[name].to(torch.float64) - before[name].to(torch.float64)
        total += float((d * d).sum())
    return math.sqrt(total)


class ExternalWeightsUpdateNorm:
    """`restoration.update_norm.UpdateNormMeasure` through `save_weights_external` + signed URLs."""

    description = DESCRIPTION

    def __init__(
        self,
        rest_client_factory: Callable[[], tinker.RestClient],
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
        saved = client.save_weights_external(name).result(timeout=self.timeout_s)
        urls = self._rest().get_external_weights_urls(saved.path).result(timeout=self.timeout_s).urls
        files = sorted(k for k in urls if k.endswith(".safetensors"))
        if not files:
            raise RuntimeError(
                f"get_external_weights_urls({saved.path}) listed no .safetensors file: {sorted(urls)[:5]}"
            )
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            for k, v in load_safetensors(self._fetch(urls[f])).items():
                tensors[f"{f}:{k}"] = v
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
            after = self.read(client, f"lr-probe-{self._n}-after")
            return update_norm_from_tensors(before, after)
        except Exception as exc:
            self.last_error = f"reading weights after the update failed: {type(exc).__name__}: {exc}"[:500]
            return None


def _http_get(url: str) -> bytes:
    r = httpx.get(url, timeout=300.0, follow_redirects=True)
    r.raise_for_status()
    return r.content
