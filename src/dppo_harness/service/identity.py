"""Served-model identity: the embedded server's marker, each training client's record, the session's label.

Which model computed is what get_info says (`evidence.backend.ServedModel`); the embedded server
reports its own stand-in's name there. Its marker (a response header and a capabilities key) is
read before any client exists, so the launch scope and the evidence's backend block can say which
server and profile ran. The SDK's types drop unknown keys, so the raw JSON is read (`service.rest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TypedDict

from pydantic import JsonValue

from dppo_harness.constants import EMBEDDED_SERVER_HEADER, EMBEDDED_SERVER_MARKER
from dppo_harness.evidence.backend import (
    EMBEDDED_KEY,
    Backend,
    EmbeddedServer,
    backend_of,
    served_name,
)
from dppo_harness.json_types import JsonObject
from dppo_harness.service.rest import CAPABILITIES_PATH, ServiceRest, header

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence.bundle import EvidenceBundle
    from dppo_harness.service.connectivity import ConnectivityReport  # connectivity reads the marker here


def detect_marker(
    headers: Mapping[str, str] | None = None, capabilities: Mapping[str, JsonValue] | None = None
) -> EmbeddedServer | None:
    """The embedded-server marker from its header or capabilities (the evidence's record of it), or
    None (a real service)."""
    sources: list[str] = []
    stand_in = profile = None
    if headers is not None and header(headers, EMBEDDED_SERVER_HEADER) == EMBEDDED_SERVER_MARKER:
        sources.append("header")
    caps = (capabilities or {}).get(EMBEDDED_KEY)
    if isinstance(caps, Mapping) and caps.get("marker") == EMBEDDED_SERVER_MARKER:
        sources.append("capabilities")
        stand_in, profile = _text(caps.get("stand_in")), _text(caps.get("profile"))
    if not sources:
        return None
    return EmbeddedServer(marker=EMBEDDED_SERVER_MARKER, stand_in=stand_in, profile=profile, sources=sources)


def _text(value: JsonValue) -> str | None:
    """A name the embedded server sent (a non-empty string), else None."""
    return value if isinstance(value, str) and value else None


class Substitution(TypedDict):
    """A model deviation: the plan's model (`original`) replaced by `effective`, and why."""

    field: str
    original: str
    effective: str
    reason: str


# ----------------------------------------------------------------------------- model choice


_SIZE_RE = re.compile(r"^(?P<family>.+?)-(?P<size>\d+(?:\.\d+)?)(?P<unit>[BbMm])(?:-(?P<suffix>.*))?$")


def _parse(name: str) -> tuple[str, float, str] | None:
    m = _SIZE_RE.match(name)
    if not m:
        return None
    size = float(m["size"]) * (1.0 if m["unit"] in "Bb" else 1e-3)
    return m["family"], size, (m["suffix"] or "")


def choose_model(requested: str, served: list[str]) -> str | None:
    """The requested model if served, else the closest served model of the same family (None: none).

    Family = the name before the size (`Qwen/Qwen3.5` of `Qwen/Qwen3.5-0.8B`); closest = smallest
    |log size ratio|, same variant suffix preferred, ties to the smaller model.
    """
    want = _parse(requested)
    if requested in served or want is None:
        return requested if requested in served else None
    cands = []
    for n in served:
        p = _parse(n)
        if p and p[0] == want[0] and p[1] > 0 and want[1] > 0:
            cands.append(((p[2] != want[2]), abs(math.log(p[1] / want[1])), p[1], n))
    return min(cands)[3] if cands else None


@dataclass
class ClientIdentity:
    """One training client's identity record (what goes into evidence)."""

    label: str
    model_id: str
    get_info: JsonValue  # raw JSON of get_info (complete model_data), or the SDK's dump if raw failed
    capabilities: JsonValue  # raw JSON of get_server_capabilities (the embedded server's marker is in it)
    served_model: str | None
    served_model_source: str
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> JsonObject:
        out: JsonObject = asdict(self)
        out["get_server_capabilities"] = out.pop("capabilities")
        return out


# ----------------------------------------------------------------------------- evidence

SERVED_SOURCE = "get_info().model_data.model_name"


class TrainingClientRecorder:
    """Records each training client's complete get_info and capabilities before it trains. A failed
    raw read is recorded with the SDK's own get_info dump, never raised: the record must not break the run."""

    def __init__(self, bundle: EvidenceBundle, timeout_s: float = 10.0):
        self.bundle, self.timeout_s = bundle, timeout_s
        self.records: list[ClientIdentity] = []
        self._written: dict[str, str] = {}  # identity key -> file holding it
        self._flushed = False

    def __call__(self, client: tinker.TrainingClient, label: str, rest: ServiceRest) -> ClientIdentity:
        sdk_info = client.get_info()
        model_id = str(sdk_info.model_id)
        errors: list[str] = []
        info_json: JsonValue = sdk_info.model_dump(mode="json")
        try:
            raw = rest.get_info(model_id, self.timeout_s)
            if raw.status == 200 and isinstance(raw.json, dict):
                info_json = raw.json
            else:
                errors.append(f"raw get_info answered HTTP {raw.status}; the SDK's parsed get_info is recorded")
        except Exception as exc:  # a record must not break the run it describes
            errors.append(f"raw get_info failed ({type(exc).__name__}); the SDK's parsed get_info is recorded")
        caps: JsonValue = None
        try:
            cr = rest.get(CAPABILITIES_PATH, self.timeout_s)
            caps = cr.json if cr.status == 200 else {"http_status": cr.status}
        except Exception as exc:
            errors.append(f"raw get_server_capabilities failed ({type(exc).__name__})")
        served = served_name(info_json if isinstance(info_json, Mapping) else None)
        rec = ClientIdentity(label, model_id, info_json, caps, served, SERVED_SOURCE, errors)
        block = backend_of(self.bundle.result)
        if block is not None and served is not None and block.served_model != served:
            # the session's served model is what the service said at client creation
            self.bundle.set_backend(block.model_copy(update={"served_model": served}))
        self.records.append(rec)
        # A file now for the first client and for any client whose identity differs from all earlier
        # ones; the rest (same identity, other model_id) go into the index written by flush().
        key = _identity_key(rec)
        if key not in self._written:
            safe_label = re.sub(r"[^A-Za-z0-9._-]", "-", label)[:40]
            name_ = f"client-identity-{len(self._written) + 1:02d}-{safe_label}.json"
            self.bundle.register_json(name_, "manifest", rec.as_dict())
            self._written[key] = name_
        return rec

    def flush(self, name: str = "client-identities.json") -> None:
        """Every training client's complete get_info, in creation order (once, at session end)."""
        if not self.records or self._flushed:
            return
        self._flushed = True
        self.bundle.register_json(
            name,
            "manifest",
            {
                "clients": [
                    {
                        **{k: v for k, v in r.as_dict().items() if k != "get_server_capabilities"},
                        "capabilities_and_identity_file": self._written[_identity_key(r)],
                    }
                    for r in self.records
                ],
                "note": "get_server_capabilities of each client is in the named file (identical for all clients "
                "sharing it: the file is written per distinct get_info + capabilities)",
            },
        )


def record_session_identity(
    bundle: EvidenceBundle, report: ConnectivityReport, option_backend: str, sdk_versions: Mapping[str, str]
) -> None:
    """Before any training client: the connectivity report, a model choice, and on the embedded
    server (its marker) the backend block of kind `local`, whatever `--backend` said, which labels
    every summary a rehearsal and says which server and profile ran."""
    bundle.register_json("connectivity-preflight.json", "manifest", report.as_evidence())
    if report.substitution:
        bundle.add_deviation(**report.substitution)
    marker = report.marker
    if marker is None:
        return
    block = backend_of(bundle.result)
    stand_in = marker.stand_in or (block.served_model if block is not None else None)
    # The model the experiment is about (a rehearsal plan's derived-from spec names it), as the
    # session recorded it; the connectivity check asked for the plan's own base_model.
    planned = str((block.requested_model if block is not None else None) or report.requested_model)
    bundle.set_backend(
        Backend(
            kind="local",
            requested_model=planned,
            served_model=str(stand_in),
            sdk_versions=dict(sdk_versions),
            base_url=report.base_url,
            requested_backend=option_backend,
            answers_to=report.model,
            embedded_server=marker,
            kind_reason="the service carries the embedded-server marker: a rehearsal on a stand-in model",
        )
    )


def _identity_key(rec: ClientIdentity) -> str:
    """What must be equal for two clients to share an identity file (everything but the model id)."""
    info = dict(rec.get_info) if isinstance(rec.get_info, Mapping) else {"raw": rec.get_info}
    info.pop("model_id", None)
    blob = json.dumps(
        [info, rec.capabilities, rec.served_model],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()
