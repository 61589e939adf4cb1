"""The vendored data's pinned hashes (``SHA256SUMS``), light enough for the embedded server's
start, which checks the warm start's training data without importing the data pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

DATA_DIR = Path(__file__).parent / "gsm8k"


class DataIntegrityError(RuntimeError):
    """The GSM8K bytes differ from the pinned sha256 (or the hash list is missing/malformed)."""


def read_sha256sums(path: Path) -> dict[str, str]:
    """Parse a ``sha256sum`` file (``<hex>  <name>`` lines)."""
    if not path.is_file():
        raise DataIntegrityError(f"hash list {path} is missing")
    out: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise DataIntegrityError(f"{path}:{lineno}: malformed sha256sum line {line!r}")
        out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def pinned_sha256(split: Literal["train", "test"], data_dir: Path = DATA_DIR) -> str:
    sums = read_sha256sums(data_dir / "SHA256SUMS")
    name = f"{split}.jsonl"
    if name not in sums:
        raise DataIntegrityError(f"{data_dir / 'SHA256SUMS'} has no entry for {name}")
    return sums[name]
