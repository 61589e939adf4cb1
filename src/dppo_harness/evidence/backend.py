"""result.json's `backend` block as a record, and which model computed a run.

`Backend` declares every key the block carries: `kind`, the requested and served model and the SDK
versions always; where the embedded server's marker was seen, also the service URL, the
`--backend` option, the name the server answers to, its marker and why the kind is `local`. Keys
the producer did not set stay out of the JSON (`to_json` drops unset fields, keeps a set None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.plans import BackendKind, Plan
from dppo_harness.plans.models import STRICT

EMBEDDED_KEY = "embedded_server"  # the marker's key in get_server_capabilities
SERVED_MODEL_UNAVAILABLE = "unavailable"  # the effective config's served_model when the service named no model


class Block(BaseModel):
    """A closed, strict block of result.json (no extra key, no coercion, no NaN/inf)."""

    model_config = STRICT


class EmbeddedServer(Block):
    """The embedded server's self-identification: its marker, stand-in, profile and where it was seen."""

    marker: str | None = None
    stand_in: str | None = None  # the model it computes with, as get_info names it: e.g. local/tiny-qwen3-gsm8k
    profile: str | None = None  # "default" or "spindle"
    sources: list[str] | None = None  # "header", "capabilities"


class Backend(Block):
    """The backend block. Only `kind` is always there; a block read back from a result may lack the rest."""

    kind: BackendKind
    requested_model: str | None = None
    served_model: str | None = None
    sdk_versions: dict[str, str] | None = None
    base_url: str | None = None
    requested_backend: str | None = None  # the --backend option, when the marker made the kind `local`
    answers_to: str | None = None  # the model name the session asked for (the embedded server takes it as an alias)
    embedded_server: EmbeddedServer | None = None
    kind_reason: str | None = None

    def to_json(self) -> JsonObject:
        """The block as written: declaration order, unset fields left out, a set None kept."""
        return self.model_dump(mode="json", exclude_unset=True)


def backend_of(result: Mapping[str, JsonValue]) -> Backend | None:
    """The result's backend block as a record (None before the session recorded it)."""
    block = result.get("backend")
    return Backend.model_validate(block) if block else None


@dataclass(frozen=True)
class ServedModel:
    """The one served-model rule: `served` is what the service says computes (get_info's
    `model_data.model_name`, None when it names none), `planned` the model the plan is about
    (`Plan.planned_model`). A run is a rehearsal when they differ; a service that names no model
    cannot show the planned one computed, so it is a rehearsal too."""

    planned: str
    served: str | None

    @property
    def rehearsal(self) -> bool:
        return self.served != self.planned


def served_name(get_info: Mapping[str, JsonValue] | None) -> str | None:
    """What computes, as a dumped get_info response (the SDK's or the raw JSON) names it."""
    data = (get_info or {}).get("model_data")
    name = data.get("model_name") if isinstance(data, Mapping) else None
    return str(name) if name else None


def session_served(result: Mapping[str, JsonValue], planned: str) -> ServedModel:
    """The session's served model: the backend block's `served_model`, which from the first training
    client on is what get_info named (`service.observed.TrainingClientRecorder`)."""
    block = backend_of(result)
    return ServedModel(planned, block.served_model if block is not None else None)


def backend_deviations(plan: Plan, backend: Backend) -> list[dict[str, str]]:
    """Deviations that come from where the plan runs, not from the plan itself."""
    served = backend.served_model or SERVED_MODEL_UNAVAILABLE
    if backend.kind == "local":
        return [
            {
                "field": "model",
                "original": plan.planned_model,
                "effective": f"{served} (embedded local CPU server on loopback, answering to the name {plan.base_model})",
                # what the run chose (the harness does not test whether a service is reachable)
                "reason": "the local backend was selected (--backend local, or TINKER_BASE_URL unset): the embedded CPU "
                "server's stand-in computes; this run is a local rehearsal of the harness, not a measurement "
                "of the planned model",
            }
        ]
    if served != plan.base_model and not served.startswith(SERVED_MODEL_UNAVAILABLE):
        return [
            {
                "field": "model",
                "original": plan.base_model,
                "effective": served,
                "reason": "the service reported a different model at client creation",
            }
        ]
    return []
