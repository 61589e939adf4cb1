"""The one module that reaches SDK internals (never patching them), for what tinker 0.25's public API lacks.

- A refused sample submit (HTTP 429 or a billing pause) is retried inside the sampling client without
  limit, log line or observer call (`lib/public_interfaces/sampling_client.py`, `_send_asample_request`);
  its only trace is the holder's `_sample_backoff_until` (now + 1 s, 5 s for large prompts), so a wait
  can name a refused submit instead of a silent hang (the service's text of it is not kept).
- Whether a ServiceClient's session is set up: a creation still waiting after that waits on its model.
- The ServiceClient has no close: its holder heartbeats until garbage-collected, keeping the session
  alive on a service that sweeps idle ones (`lib/internal_client_holder.py`), so a released session's
  heartbeat is ended with the holder's own `close()`, as its `__del__` would.

The layout is the pinned version's: on any other version importing this refuses (`SdkVersionRefused`).
"""

from __future__ import annotations

import tinker

from dppo_harness.service.wait.policy import ServiceConfigError

PINNED_SDK = "0.25.0"


class SdkVersionRefused(ServiceConfigError):
    """The installed SDK is not the version whose internals this module reads."""


if tinker.__version__ != PINNED_SDK:
    raise SdkVersionRefused(
        f"dppo_harness.service.sdk_internals reads tinker {PINNED_SDK}'s sampling backoff; the installed tinker is "
        f"{tinker.__version__}: install the pinned SDK (pip install -e .)"
    )


def sample_backoff_until(sampling_client: tinker.SamplingClient) -> float | None:
    """When (time.monotonic()) the latest sample-submit backoff ends; None before any refusal."""
    holder = getattr(sampling_client, "holder", None)
    value = getattr(holder, "_sample_backoff_until", None)
    return float(value) if isinstance(value, int | float) else None


def session_ready(service_client: tinker.ServiceClient) -> bool:
    """Whether the session is set up: the SDK keeps its holder only then (`_get_session_holder`)."""
    return getattr(service_client, "_session_holder", None) is not None


def end_session_heartbeat(service_client: tinker.ServiceClient) -> None:
    """Close the session holder (heartbeat, config refresh), if a session was opened."""
    holder = getattr(service_client, "_session_holder", None)
    if holder is not None:
        holder.close()
