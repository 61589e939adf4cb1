"""How tests prove a server or a harness run left nothing running."""

from __future__ import annotations

import os
from pathlib import Path


def live_child_pids() -> set[int]:
    """PIDs of this process's live (non-zombie) children, from /proc: how tests prove a server
    or a harness run left nothing running."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry.name))
    return found
