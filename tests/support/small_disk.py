"""A real small disk for the tests of a full or nearly full evidence directory: a tmpfs of a given
size mounted under the test's tmp_path (root only; the test is skipped where mounting is refused)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """`where` (created) as a tmpfs of `size` (mount(8)'s form: 64k, 1m, 64m) until the block ends."""
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root and mount(8) for a real small disk")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
