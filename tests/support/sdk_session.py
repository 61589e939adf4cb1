"""Ending a plain SDK ServiceClient's session in tests (importable as `sdk_session`).

tinker 0.25 has no ServiceClient.close: a session's holder sends heartbeats until it is collected.
Tests that drive the stock SDK directly end it here, as the harness's release does after its
unloads (`service.sdk_internals.end_session_heartbeat`)."""

from __future__ import annotations

from typing import Any


def end_session(service_client: Any) -> None:
    """Stop the heartbeat of the session `service_client` opened (none opened: nothing to do)."""
    from dppo_harness.service import sdk_internals

    sdk_internals.end_session_heartbeat(service_client)
