"""result.json's `backend` block as a record, and which model computed a run.

`Backend` declares every key the block carries: `kind`, the requested and served model and the SDK
versions always; where the embedded server's marker was seen, also the service URL, the
`--backend` option, the name the server answers to, its marker and why the kind is `local`. Keys
the producer did not set stay out of the JSON (`to_json` drops unset fields, keeps a set None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from dppo_harness.constants import EMBEDDED_SERVER_MARKER
from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.plans import BackendKind
from dppo_harness.plans.schema_errors import STRICT

EMBEDDED_KEY = "embedded_server"  # the marker's key in capabilities and in get_info().model_data


class Block(BaseModel):
    """A closed, strict block of result.json (no extra key, no coercion, no NaN/inf)."""

    model_config = STRICT


class EmbeddedServer(Block):
    """The embedded server's self-identification: its marker, stand-in, profile and where it was seen."""

    marker: str | None = None
    stand_in: str | None = None  # the model that really computes, e.g. local/tiny-qwen3-gsm8k
    profile: str | None = None  # "default" or "spindle"
    sources: list[str] | None = None  # "header", "capabilities", "model_data"


class Backend(Block):
    """The backend block. Only `kind` is always there; a block read back from a result may lack the rest."""

    kind: BackendKind
    requested_model: str | None = None
    served_model: str | None = None
    sdk_versions: dict[str, str] | None = None
    base_url: str | None = None
    requested_backend: str | None = None  # the --backend option, when the marker made the kind `local`
    answers_to: str | None = None  # the name the embedded server answers to
    embedded_server: EmbeddedServer | None = None
    kind_reason: str | None = None

    def to_json(self) -> JsonObject:
        """The block as written: declaration order, unset fields left out, a set None kept."""
        return self.model_dump(mode="json", exclude_unset=True)


def backend_of(result: Mapping[str, JsonValue]) -> Backend | None:
    """The result's backend block as a record (None before the session recorded it)."""
    block = result.get("backend")
    return Backend.model_validate(block) if block else None


ServedOrigin = Literal["arch", "backend_block", "unnamed", "model_name"]


@dataclass(frozen=True)
class ServedName:
    """Which model computed (`name`, None when nothing names it), where that came from, and what
    get_info's `model_data.model_name` reported."""

    name: str | None
    origin: ServedOrigin
    reported: str | None

    @property
    def source(self) -> str:
        return {
            "arch": f"get_info().model_data.arch (embedded server's stand-in; model_name reports {self.reported!r})",
            "backend_block": f"evidence backend block (embedded server; get_info reports {self.reported!r})",
            "unnamed": f"embedded server exposes no stand-in name (get_info reports {self.reported!r})",
            "model_name": "get_info().model_data.model_name",
        }[self.origin]


def served_model(
    model_data: Mapping[str, JsonValue] | None,
    backend: Backend | None,
    *,
    seen: EmbeddedServer | None = None,
    local: bool = False,
) -> ServedName:
    """The model that computes. On the embedded server (its marker in model_data, `seen` now, in the
    backend block, or `local`) the stand-in, never the name the server answers to: `model_data.arch`,
    else the marker's stand-in or the block's served model. On a real service `model_data.model_name`."""
    md = model_data or {}
    reported = None if md.get("model_name") is None else str(md["model_name"])
    embedded = seen or (backend.embedded_server if backend is not None else None)
    local = local or (backend is not None and backend.kind == "local")
    if local or md.get(EMBEDDED_KEY) == EMBEDDED_SERVER_MARKER or embedded:
        if md.get("arch"):
            return ServedName(str(md["arch"]), "arch", reported)
        name = (embedded.stand_in if embedded is not None else None) or (backend.served_model if backend else None)
        return ServedName(name, "backend_block", reported) if name else ServedName(None, "unnamed", reported)
    return ServedName(reported or None, "model_name", reported)


def stand_in_note(stand_in: str | None, requested_model: str) -> str:
    return (
        f"computed by the embedded server's stand-in model {stand_in or '(unnamed)'}, not {requested_model}; "
        "a rehearsal, not a scientific result"
    )


def report_lines(block: Backend | None) -> list[str]:
    """Markdown lines for report.md naming the stand-in (empty on a real service)."""
    embedded = block.embedded_server if block is not None else None
    if block is None or embedded is None:
        return []
    stand_in = embedded.stand_in or block.served_model
    return [
        "",
        "## Served model (embedded server)",
        "",
        f"- REHEARSAL: {stand_in_note(stand_in, str(block.requested_model))}.",
        f"- The service at `{block.base_url}` carries the embedded-server marker "
        f"(in: {', '.join(embedded.sources or [])}; profile {embedded.profile}); "
        f"it answers to the name `{block.answers_to}`.",
        f"- Limitation: numbers here describe the stand-in {stand_in}, not {block.requested_model}.",
    ]
