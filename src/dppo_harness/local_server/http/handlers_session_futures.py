"""`retrieve_futures`: one long poll per sampling session reporting which of its samples finished.

Served when the client config says `sample_use_retrieve_futures` (fault option
`--fault-sample-use-retrieve-futures`): the SDK then waits on a session poller instead of polling
each sample's `retrieve_future`, and that path carries no queue state. Completions are numbered per
session; a poll returns those after its `prev_cursor`, holding the answer up to LONG_POLL_S while
there is none (`timeout: 0`: answer at once).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from aiohttp import web
from tinker.types.futures_retrieve_request import FuturesRetrieveRequest

from dppo_harness.local_server.http.state import Outcome, state_of
from dppo_harness.local_server.http.work import parse_body

LONG_POLL_S = 5.0  # a real service holds up to ~30 s (the SDK waits 45); shorter keeps the tests short
MAX_KEPT = 4096  # completions kept per session beyond the last acknowledged cursor


@dataclass
class SessionCompletions:
    """The finished samples of one sampling session, in completion order."""

    events: list[tuple[int, str, str]] = field(default_factory=list)  # (cursor, request_id, finished|failed)
    cursor: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, request_id: str, state: str) -> None:
        self.cursor += 1
        self.events.append((self.cursor, request_id, state))
        del self.events[:-MAX_KEPT]
        self.changed.set()
        self.changed = asyncio.Event()

    def after(self, cursor: int) -> list[tuple[int, str, str]]:
        self.events = [e for e in self.events if e[0] > cursor]  # at or before a poll's cursor: seen
        return list(self.events)


def report_completion(
    completions: dict[str, SessionCompletions], sampling_session_id: str, request_id: str, fut: asyncio.Future
) -> None:
    """Done-callback of a sample future: its session's poll learns it finished (or failed)."""
    outcome: Outcome | None = None if fut.cancelled() or fut.exception() is not None else fut.result()
    state = "finished" if outcome is not None and outcome.kind != "error" else "failed"
    completions.setdefault(sampling_session_id, SessionCompletions()).add(request_id, state)


async def retrieve_futures(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, FuturesRetrieveRequest)
    session = state.session_completions.setdefault(req.target.sampling_session_id, SessionCompletions())
    ready = session.after(req.prev_cursor)
    if not ready and req.timeout != 0:
        changed = session.changed
        hold = LONG_POLL_S if req.timeout is None else min(LONG_POLL_S, max(0.0, req.timeout))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), hold)
        ready = session.after(req.prev_cursor)
    return web.json_response(
        {
            "completions": [{"state": s, "request_id": rid} for _, rid, s in ready],
            "cursor": ready[-1][0] if ready else req.prev_cursor,
        }
    )
