"""The one module that reaches SDK internals, for what the brief requires and tinker's public API
does not offer: that the SDK is holding sample submits back because the service refused them,
whether a ServiceClient's session is set up (a creation still waiting after that waits on its
model: Spindle places it), and ending a released session's heartbeat.

tinker 0.25 swallows a refused sample submit (HTTP 429, or a billing pause) inside the sampling
client and resubmits it after a backoff, without limit and without a log line or an observer call
(`lib/public_interfaces/sampling_client.py`, `_send_asample_request` / `_sample_async_impl`). The
only trace is the session holder's `_sample_backoff_until`, set to `time.monotonic()` + 1 s (5 s
for large prompts) at each refusal. Reading it (never writing it) lets a wait name a refused submit
as such instead of a silent hang; the service's own text of the refusal is not kept by the SDK.

tinker 0.25's ServiceClient has no close: its session holder sends a heartbeat every few seconds
until it is garbage-collected (`lib/internal_client_holder.py`, `close`, `__del__`), which keeps
the session alive on a service that sweeps idle ones. Once every model of a session is unloaded,
`end_session_heartbeat` calls that holder's own `close()`, as its `__del__` would.

Nothing here replaces or patches the SDK. The layout is the pinned version's, so importing this
module on any other version refuses with one line (`SdkVersionRefused`).
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
    """When (time.monotonic()) the SDK's latest sample-submit backoff ends, or None if no sample
    submit of this client's session was refused yet."""
    holder = getattr(sampling_client, "holder", None)
    value = getattr(holder, "_sample_backoff_until", None)
    return float(value) if isinstance(value, int | float) else None


def session_ready(service_client: tinker.ServiceClient) -> bool:
    """Whether `service_client` has its session: the SDK keeps the session holder only once
    client/config, dynamic_config and create_session were answered (service_client.py
    `_get_session_holder`), so a creation still waiting after that waits on its model."""
    return getattr(service_client, "_session_holder", None) is not None


def end_session_heartbeat(service_client: tinker.ServiceClient) -> bool:
    """Close the session holder of `service_client` if it made one (its heartbeat and config
    refresh stop); False when it never opened a session."""
    holder = getattr(service_client, "_session_holder", None)
    if holder is None:
        return False
    holder.close()
    return True
