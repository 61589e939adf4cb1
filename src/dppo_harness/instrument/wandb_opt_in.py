"""W&B is opt-in: whether this run asked for it (`--wandb-project`, then `WANDB_PROJECT`) and whether
it can work here; light enough for the plugin's option parsing (no SDK, no cookbook)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

WANDB_ENV = "WANDB_PROJECT"
OPTIONAL_TRACKERS = ("wandb", "neptune_scale", "trackio")  # what the cookbook's ml_log imports when installed


@dataclass(frozen=True)
class WandbRequest:
    project: str | None  # None: not asked for
    source: str  # "--wandb-project", "WANDB_PROJECT" or "not requested"


def wandb_request(option: str | None, env: Mapping[str, str] | None = None) -> WandbRequest:
    """W&B is used only when asked: the option first, then WANDB_PROJECT."""
    env = os.environ if env is None else env
    if option:
        return WandbRequest(option, "--wandb-project")
    if env.get(WANDB_ENV):
        return WandbRequest(env[WANDB_ENV], WANDB_ENV)
    return WandbRequest(None, "not requested")


def wandb_problem(request: WandbRequest) -> str | None:
    """Why an asked-for W&B cannot work here (one line), else None."""
    if request.project and importlib.util.find_spec("wandb") is None:
        return (
            f"{request.source} asks for W&B project {request.project!r}, but wandb is not installed (pip install wandb)"
        )
    return None
