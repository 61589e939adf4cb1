"""Update-norm measures: ||theta_after - theta_before|| around one update, where a backend allows it.

The contract: `UpdateNormMeasure` is what the restore and LR-scaling probes call; on the local
backend `CheckpointUpdateNorm` measures it from save_state checkpoints that `LocalCheckpointReader`
reads under the embedded server's run_dir (which also hashes adapters as loaded) through
`local_checkpoints`. The Tinker API exposes no parameters, so other backends bring their own measure
or none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import tinker

if TYPE_CHECKING:
    import torch

    from dppo_harness.stages.restoration.local_checkpoints import LocalAdapterFiles


class UpdateNormMeasure(Protocol):
    """Measures ||theta_after - theta_before|| around `apply_update()` on `client`, or None.

    A measure whose own requests can be refused (e.g. a service without external weights) must
    not run on a client that has more work to do: the SDK numbers each client's requests, and one
    refused at submit leaves a gap the server waits on before running that client's next request.
    `safe_on_a_working_client` says the measure's requests cannot be refused that way."""

    description: str

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None: ...


class LocalCheckpointReader:
    """Reads adapter tensors of checkpoints the embedded server wrote under its run_dir.

    Local backend only: this is an in-process route around the SDK (the Tinker API exposes no
    parameters). The reading and the arithmetic are `local_checkpoints.LocalAdapterFiles`'s, loaded
    on the first read, so that importing this module or constructing a reader on another backend
    loads neither the embedded server's model module (transformers) nor torch on its own account.
    """

    description = (
        "local backend only: ||theta_after - theta_before|| over all LoRA parameters, read from "
        "save_state checkpoints the embedded server wrote under its run_dir"
    )

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    @cached_property
    def _files(self) -> LocalAdapterFiles:
        # Local backend only: torch and the embedded server's model module load on the first read.
        from dppo_harness.stages.restoration.local_checkpoints import LocalAdapterFiles

        return LocalAdapterFiles(self.run_dir)

    def adapter(self, path: str) -> dict[str, torch.Tensor]:
        return self._files.adapter(path)

    def adapter_sha256(self, path: str) -> str:
        """sha256 over names, dtypes, shapes and raw bytes of the adapter, sorted by name."""
        return self._files.adapter_sha256(path)

    def update_norm(self, before: str, after: str) -> float:
        return self._files.update_norm(before, after)


class CheckpointUpdateNorm:
    """UpdateNormMeasure via save_state before and after the update (local backend)."""

    safe_on_a_working_client = True  # save_state only: a request every backend serves

    def __init__(self, reader: LocalCheckpointReader, tag: str):
        self.reader, self.tag, self.description = reader, tag, reader.description
        self._n = 0

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None:
        self._n += 1
        before = client.save_state(f"{self.tag}-norm{self._n}-before").result().path
        apply_update()
        after = client.save_state(f"{self.tag}-norm{self._n}-after").result().path
        return self.reader.update_norm(before, after)


def planned_lr_on_setup_client(update_norm: UpdateNormMeasure | None, multipliers: Sequence[float]) -> bool:
    """Whether the planned LR's scaling probe is the setup client's update 1 (no client of its own):
    only with a measure that cannot leave that client waiting on a refused request (it still has
    the restore probe to run); otherwise every LR gets its own client."""
    return (
        update_norm is not None
        and any(float(m) == 1.0 for m in multipliers)
        and bool(getattr(update_norm, "safe_on_a_working_client", False))
    )
