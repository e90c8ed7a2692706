"""Reading a logged stream back: where it can be resumed, its events after a cursor, and the cursor.

A stream is logged only when asked: `stream_options: {"resumable": true}`, or
`disconnect_policy: "detach"` (a detached run is only any use if it can be read back). Then the
stream runs as a `Run` (runs.py): its SSE events go to the event log, the connection that asked
is the run's first reader, and a client that lost it reconnects with

    GET /v1/chat/completions/{id}/stream      (chat and session turns: id is the chunks' "chatcmpl-...")
    GET /v1/completions/{id}/stream           (text completions: "cmpl-...")

with `Last-Event-ID: N` (what browsers' EventSource send by themselves) or `?starting_after=N`,
and gets every event after N, then the live ones, from any replica sharing the Redis. Every SSE
event's `id:` is its sequence number (0-based, no gaps). The default stream (neither field) takes
the old path: nothing is logged and nothing is added per event.

Starting a logged chat stream is `chat/replies.py`'s `logged_stream`; the resume route is
`openai/routes.py`'s (the paths are OpenAI's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from chatserve.server.errors import bad_request, error_body
from chatserve.server.streams.event_log import EventLogError, EventLogUnavailable
from chatserve.server.streams.runs import RunRegistry
from chatserve.server.streams.sse import dumps

RESUME_HEADER = "X-Chatserve-Resume"  # where a logged stream can be resumed (path of the resume route)
_ROUTE_PREFIX = {"chatcmpl-": "/v1/chat/completions", "cmpl-": "/v1/completions"}
MAX_ID_LEN = 200


def resume_path(run_id: str) -> str:
    base = next(path for prefix, path in _ROUTE_PREFIX.items() if run_id.startswith(prefix))
    return f"{base}/{run_id}/stream"


async def follow_sse(runs: RunRegistry, run_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
    """A run's events after `after` as SSE events (`id:` = the sequence number). A log that fails on
    the way ends the stream with an error event (no id: it is not part of the run)."""
    try:
        async for seq, event in runs.attach(run_id, after):
            yield {"id": str(seq), "data": event["data"]}
    except EventLogUnavailable as exc:
        yield {"data": dumps(error_body(503, str(exc), code="event_log_unavailable"))}
    except EventLogError as exc:
        yield {"data": dumps(error_body(500, f"the stream's events are gone: {exc}", code="event_log_error"))}


def cursor(request: Request) -> tuple[int, str]:
    """The cursor and the name it came by: `Last-Event-ID` or `starting_after` (-1: from the start)."""
    header = request.headers.get("last-event-id")
    query = request.query_params.get("starting_after")
    values = [(v, name) for v, name in ((header, "Last-Event-ID"), (query, "starting_after")) if v is not None]
    if not values:
        return -1, "starting_after"
    parsed = []
    for raw, name in values:
        text = raw.strip()
        if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 12) or int(text) < -1:
            raise bad_request(f"{name} must be an event's sequence number (an integer >= -1), got {raw[:40]!r}",
                              param=name)
        parsed.append((int(text), name))
    if len(parsed) == 2 and parsed[0][0] != parsed[1][0]:
        raise bad_request("Last-Event-ID and starting_after disagree; send one", param="starting_after")
    return parsed[-1]
