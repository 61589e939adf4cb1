"""One observed restore: a fresh training client from a saved state (weights and optimizer), with the
service's load response (the proof of what was loaded), the client's get_info right after the load,
and the seconds the load took. Every stage that trains a restored client restores through `restore`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import tinker
from pydantic import JsonValue

from dppo_harness.service.observed import create_from_state_with_response
from dppo_harness.train.clients import dump_response


@dataclass(frozen=True)
class Restore:
    name: str  # the client's name in wait lines and releases (an arm's name in the preflight)
    client: tinker.TrainingClient
    source_path: str  # the checkpoint the load asked for
    response: tinker.types.LoadWeightsResponse  # what the service says it loaded
    info: tinker.types.GetInfoResponse  # the client's get_info right after the load
    seconds: float  # client creation and load

    @property
    def loaded_path(self) -> str | None:
        """The path the service's load response names (optional in the SDK's LoadWeightsResponse)."""
        return self.response.path

    def mismatch(self) -> str | None:
        """None when the service says it loaded the path asked for; else one line saying what it said."""
        if self.response.path is None:
            return (
                f"the load of {self.source_path} is not observed: its response has no path "
                "(optional in the SDK's LoadWeightsResponse)"
            )
        if self.response.path != self.source_path:
            return f"the load of {self.source_path} loaded {self.response.path!r}"
        return None

    def record(self) -> dict[str, JsonValue]:
        """The load as a stage that trains this client records it, before its first update."""
        return {
            "initial_checkpoint": self.source_path,
            "loaded_checkpoint_uri": self.loaded_path,
            "load_succeeded": True,
            "load_response": dump_response(self.response),
            "get_info": dump_response(self.info),
            "before_first_update": True,
            "seconds": self.seconds,
        }


def restore(service_client: tinker.ServiceClient, path: str, name: str) -> Restore:
    """A new training client named `name` (in wait lines and releases) from the saved state `path`,
    with optimizer, the load response kept (`observed.create_from_state_with_response`: the SDK's
    own method drops it)."""
    t0 = time.monotonic()
    client, response = create_from_state_with_response(service_client, path, name)
    seconds = time.monotonic() - t0
    return Restore(name, client, path, response, client.get_info(), seconds)
