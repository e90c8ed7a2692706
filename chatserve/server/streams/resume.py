"""Resumable streams for Chat Completions, completions and session turns, and their resume route.

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
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, bad_request, error_body
from chatserve.server.event_log import EventLogError, EventLogUnavailable, event_log_errors
from chatserve.server.generation import Generation
from chatserve.server.protocol import SamplingFields
from chatserve.server.runs import DisconnectPolicy
from chatserve.server.streaming import dumps, sse_response

RESUME_HEADER = "X-Chatserve-Resume"  # where a logged stream can be resumed (path of the resume route)
_ROUTE_PREFIX = {"chatcmpl-": "/v1/chat/completions", "cmpl-": "/v1/completions"}
_MAX_ID_LEN = 200


def stream_policy(ctx: ServerContext, body: SamplingFields) -> DisconnectPolicy | None:
    """The disconnect policy of a logged stream, or None for the default path (a plain stream, or no
    stream). Checked before any engine work: a bad value is a 400 naming `disconnect_policy`."""
    policy = DisconnectPolicy.parse(body.disconnect_policy, param="disconnect_policy", settings=ctx.settings)
    resumable = bool(body.stream_options and body.stream_options.resumable)
    if policy.mode == "detach" and not body.stream:
        raise bad_request("disconnect_policy 'detach' needs stream: true (a detached run is read back by resuming "
                          "its stream)", param="disconnect_policy")
    if body.stream and (resumable or policy.mode == "detach"):
        return policy
    return None


def resume_path(run_id: str) -> str:
    base = next(path for prefix, path in _ROUTE_PREFIX.items() if run_id.startswith(prefix))
    return f"{base}/{run_id}/stream"


def logged_stream(ctx: ServerContext, run_id: str, events: AsyncIterator[dict[str, Any]], *,
                  policy: DisconnectPolicy, gen: Generation, headers: dict[str, str]) -> EventSourceResponse:
    """Run `events` (stream_events' SSE dicts) as a run under `run_id` and answer with its first reader."""

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        async for event in events:
            yield {"data": event["data"]}  # the log numbers events itself

    try:
        ctx.runs.start(run_id, payloads(), policy=policy, on_abort=gen.close)
    except ValueError as exc:
        gen.close("client_disconnect")
        raise APIError(409, str(exc), param="X-Request-Id", code="duplicate_request_id") from None
    return sse_response(follow_sse(ctx, run_id, -1), keepalive_s=ctx.settings.sse_keepalive_s,
                        headers={**headers, RESUME_HEADER: resume_path(run_id)})


async def follow_sse(ctx: ServerContext, run_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
    """A run's events after `after` as SSE events (`id:` = the sequence number). A log that fails on
    the way ends the stream with an error event (no id: it is not part of the run)."""
    try:
        async for seq, event in ctx.runs.attach(run_id, after):
            yield {"id": str(seq), "data": event["data"]}
    except EventLogUnavailable as exc:
        yield {"data": dumps(error_body(503, str(exc), code="event_log_unavailable"))}
    except EventLogError as exc:
        yield {"data": dumps(error_body(500, f"the stream's events are gone: {exc}", code="event_log_error"))}


def _cursor(request: Request) -> tuple[int, str]:
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


async def resume_stream(request: Request) -> Response:
    ctx = get_context(request)
    run_id = request.path_params["stream_id"]
    prefix = "cmpl-" if request.url.path.startswith("/v1/completions/") else "chatcmpl-"
    if not run_id.startswith(prefix) or len(run_id) > _MAX_ID_LEN or not run_id.isprintable():
        raise APIError(404, f"no resumable stream {run_id[:_MAX_ID_LEN]!r} (ids start with {prefix!r})",
                       param="id", code="not_found")
    after, param = _cursor(request)
    with event_log_errors(param):
        info = await ctx.runs.info(run_id)
    if info is None:
        raise APIError(404, f"no resumable stream {run_id!r}: it was not resumable (stream_options.resumable or "
                       f"disconnect_policy 'detach'), or its events expired", param="id", code="not_found")
    if after + 1 < info.first_seq:
        raise bad_request(f"events after {after} are no longer kept (the oldest kept is {info.first_seq})",
                          param=param, code="cursor_expired")
    # NOTE: only an ended log can say a cursor is too far: while the run goes on, the shared log may lag
    # the replica's own mirror (whose ids the client saw) by the batch in flight, so the reader waits.
    if info.ended is not None and after >= info.next_seq:
        raise bad_request(f"{param} {after} is beyond the stream's last event ({info.next_seq - 1})", param=param)
    return sse_response(follow_sse(ctx, run_id, after), keepalive_s=ctx.settings.sse_keepalive_s,
                        headers={"X-Request-Id": run_id.split("-", 1)[1]})


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions/{stream_id}/stream", resume_stream, methods=["GET"]),
        Route("/v1/completions/{stream_id}/stream", resume_stream, methods=["GET"]),
    ]
