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


def checkpoint_dir(run_dir: Path, path: str) -> Path | None:
    """The directory of checkpoint `path` under `run_dir` (it may not exist); None when `path` is
    not a tinker:// checkpoint path."""
    m = CHECKPOINT_PATH_RE.match(path or "")
    return None if m is None else run_dir / "checkpoints" / m.group(1).replace("/", "_") / m.group(2) / m.group(3)


def adapter_file(run_dir: Path, path: str) -> Path | None:
    d = checkpoint_dir(run_dir, path)
    return None if d is None else d / ADAPTER_FILE
