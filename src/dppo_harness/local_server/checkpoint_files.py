"""Where the embedded server keeps a checkpoint's files, from its tinker:// path (no torch import).

A checkpoint `tinker://<model_id>/<weights|sampler_weights>/<name>` lives under
`<run_dir>/checkpoints/<model_id with "/" as "_">/<kind>/<name>/`, its LoRA tensors in `adapter.pt`.
Callers outside the server (the restoration preflight's local update-norm measure) read adapters
through `adapter_file` instead of knowing that layout.
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINT_PATH_RE = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")
ADAPTER_FILE = "adapter.pt"


def checkpoint_dir(run_dir: Path, model_id: str, kind: str, name: str) -> Path:
    """The directory of checkpoint `name` of `kind` (weights / sampler_weights) of `model_id`."""
    return run_dir / "checkpoints" / model_id.replace("/", "_") / kind / name


def adapter_file(run_dir: Path, path: str) -> Path | None:
    """The adapter file of checkpoint `path` under `run_dir` (it may not exist); None when `path`
    is not a tinker:// checkpoint path."""
    m = CHECKPOINT_PATH_RE.match(path or "")
    if not m:
        return None
    return checkpoint_dir(run_dir, m.group(1), m.group(2), m.group(3)) / ADAPTER_FILE
