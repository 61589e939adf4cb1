"""Optimizer checks: the requested optimizer family and config against what server responses expose.

The contract: `optimizer_check` marks a check `verified` only when the family (a `get_info` that
sent `optimizer_config`) and every requested config value (echoed in `optim_step` metrics) came
from a server response and match; anything not exposed stays `source: declared, actual: null`.
`own_response_only` reduces a check whose config came from a probe client's response to what
the arm's own responses exposed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import tinker

ADAM_FAMILIES = {"adam": "adamw", "adamw": "adamw"}  # tinker's Adam is torch AdamW; wd=0 makes them equal


class OptimizerCheck(TypedDict):
    """One optimizer check, key for key as the evidence records it (`optimizer_check`)."""

    after_restore: int
    before_next_update: bool
    requested_optimizer: str
    requested_config: dict[str, float]
    actual_optimizer: str | None
    actual_optimizer_source: str
    actual_config: dict[str, float] | None
    actual_config_source: str
    actual_config_observed_on: str | None
    source: str
    evidence_ref: str
    matches: bool
    mismatches: list[str]
    verified: bool
    unverified_reasons: list[str]


def normalize_family(name: str | None) -> str | None:
    if name is None:
        return None
    return ADAM_FAMILIES.get(name.lower(), name.lower())


def server_optimizer_family(info: tinker.types.GetInfoResponse | Mapping[str, Any] | None) -> str | None:
    """Optimizer family from a get_info answer, only if the server actually sent it: from a raw
    get_info (JSON as sent) only. tinker 0.25's GetInfoResponse has no `optimizer_config` field
    (it drops the key; `sdk_internals` refuses another SDK version), so an SDK response carries none."""
    cfg = info.get("optimizer_config") if isinstance(info, Mapping) else None
    family = cfg.get("type") if isinstance(cfg, Mapping) else None
    return str(family) if family else None


def echoed_config(metrics: Mapping[str, float] | None, keys: Sequence[str]) -> dict[str, float]:
    """The requested config keys that an optim_step response's metrics echo back, as the embedded
    server names them (`optim/<key>`; Spindle and tinker 0.25's own types echo none)."""
    return {k: float(metrics[f"optim/{k}"]) for k in keys if metrics and f"optim/{k}" in metrics}


def optimizer_check(
    *,
    after_restore: int,
    requested_optimizer: str,
    requested_config: Mapping[str, float],
    info: tinker.types.GetInfoResponse | Mapping[str, Any] | None,
    info_ref: str,
    echoed: Mapping[str, float] | None,
    echo_ref: str | None,
    echo_observed_on: str | None,
    rtol: float = 1e-9,
) -> OptimizerCheck:
    """One optimizer check (the module's contract: `verified` only from server responses that match)."""
    family = server_optimizer_family(info)
    want_family = normalize_family(requested_optimizer)
    mismatches: list[str] = []
    if family is not None and normalize_family(family) != want_family:
        mismatches.append(f"optimizer family: requested {requested_optimizer!r}, server {family!r}")
    actual_cfg: dict[str, float] | None = None
    if echoed:
        actual_cfg = {k: float(echoed[k]) for k in requested_config if k in echoed}
        for k, v in requested_config.items():
            if k in echoed and not math.isclose(float(echoed[k]), float(v), rel_tol=rtol, abs_tol=0.0):
                mismatches.append(f"{k}: requested {v!r}, server applied {echoed[k]!r}")
    config_complete = actual_cfg is not None and set(actual_cfg) == set(requested_config)
    unverified: list[str] = []
    if family is None:
        unverified.append("optimizer family not exposed by any server response")
    if not config_complete:
        missing = sorted(set(requested_config) - set(actual_cfg or {}))
        unverified.append(f"config keys not exposed by any server response: {missing}")
    return {
        "after_restore": after_restore,
        "before_next_update": True,
        "requested_optimizer": requested_optimizer,
        "requested_config": dict(requested_config),
        "actual_optimizer": family,
        "actual_optimizer_source": "server_response" if family is not None else "declared",
        "actual_config": actual_cfg,
        "actual_config_source": "server_response" if actual_cfg else "declared",
        "actual_config_observed_on": echo_observed_on if actual_cfg else None,
        "source": "server_response" if (family is not None or actual_cfg) else "declared",
        "evidence_ref": info_ref if not actual_cfg else f"{info_ref}; {echo_ref}",
        "matches": not mismatches,
        "mismatches": mismatches,
        "verified": bool(family is not None and config_complete and not mismatches),
        "unverified_reasons": unverified,
    }


PROBE_ECHO_REASON = (
    "the config was echoed only by a probe client's optim_step, not by this arm's own client: stays declared"
)


def own_response_only(check: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer check whose config came from a PROBE client's response, reduced to what the
    arm's own responses exposed (the family from its own get_info); the config stays declared/null.
    `check` is a recorded one, read back from a run state: it may carry keys beside OptimizerCheck's."""
    c = dict(check)
    observed = str(c.get("actual_config_observed_on") or "")
    if c.get("actual_config") is None or "probe" not in observed:
        return c
    source = "server_response" if c.get("actual_optimizer") else "declared"
    evidence_ref = str(c.get("evidence_ref", "")).split("; ")[0]
    unverified_reasons = list(c.get("unverified_reasons", [])) + [PROBE_ECHO_REASON]
    c.update(
        actual_config=None,
        actual_config_source="declared",
        actual_config_observed_on=None,
        source=source,
        verified=False,
        evidence_ref=evidence_ref,
        unverified_reasons=unverified_reasons,
    )
    return c
