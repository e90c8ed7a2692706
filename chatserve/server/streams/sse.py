"""Server-sent events on the wire: one JSON data line per event, keepalive comments, event ids on
the streams that can be resumed, and the race between a piece of work and the client's disconnect.

Two framings, one per kind of stream:
- **plain** (what OpenAI sends, and what every client parses, including the ones that split the
  stream at blank lines and read each message as one `data:` line, as vLLM's benchmark client
  does): `data: ...` lines, each message ended by a blank line; keepalives are a comment and a
  blank line, which a decoder that has no event id reads as nothing.
- **numbered** (a logged stream: resumable, detached, background Responses): every event also has
  its `id:` (its sequence number in the event log, what `Last-Event-ID` sends back), so keepalives
  are a comment line with no blank line after it (`Keepalive` says why).

Nothing here knows what the events say (chat chunks, Responses events, a run's log): the
families build their events and hand them to `sse_response`.

A client that stops reading cannot hold a stream: each write (event or keepalive) may wait at most
`--sse-send-timeout-s` for the socket to take it; past that the stream ends as if the client had
disconnected (its generator is closed, so a plain stream's request is aborted and a detached run
goes on under its lease) and the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse, SendTimeoutError

from chatserve.server.json_checks import escape_surrogates, has_surrogates

logger = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 60.0  # ServerSettings.sse_send_timeout_s, for an app without settings

# Characters that str.splitlines() (and so the openai SDK's SSE decoder, and httpx's iter_lines)
# takes for line ends although SSE does not: raw inside a data line they cut one event in two. JSON
# escapes the other ones (< 0x20) itself; these it leaves raw with ensure_ascii=False.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """Compact JSON for one SSE data line: UTF-8 as is, except the line breaks splitlines() sees and a
    lone surrogate (a reply can decode to one), which are written as their escapes."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)
    return escape_surrogates(text) if has_surrogates(text) else text


def data_event(data: Any) -> dict[str, Any]:
    """One plain SSE event: its data line (a string as is, anything else as compact JSON)."""
    return {"data": data if isinstance(data, str) else dumps(data)}


class Keepalive(ServerSentEvent):
    """The keepalive of a numbered stream: one SSE comment line and no blank line after it.

    NOTE: a numbered stream's events carry `id:` lines (it can be resumed from a cursor), and the decoders
    most clients run (the openai SDK's `SSEDecoder`, httpx-sse, everything built on them) keep the
    last event id and dispatch an event at *every* blank line once they have one, with empty
    `data` if nothing came since, which the SDK then json-parses and dies on. sse-starlette's
    default ping is a comment *plus* a blank line, so it broke every stream that lived longer than
    one keepalive interval of a numbered stream. A comment line on its own is skipped by every spec-following parser
    (it adds no field, so the next real event is unchanged) and still keeps proxies and idle
    timeouts from closing the connection. Events are written one `send` each, so a keepalive only
    ever lands between two complete events.
    """

    LINE = b": keepalive\r\n"

    def __init__(self) -> None:
        super().__init__(comment="keepalive")

    def encode(self) -> bytes:
        return self.LINE


class PlainKeepalive(ServerSentEvent):
    """The keepalive of a plain stream: a comment line and a blank line, a message of its own that
    every decoder skips (no field in it) and that a reader splitting at blank lines sees whole."""

    LINE = b": keepalive\r\n\r\n"

    def __init__(self) -> None:
        super().__init__(comment="keepalive")

    def encode(self) -> bytes:
        return self.LINE


def sse_response(events: AsyncIterator[dict[str, Any]], *, keepalive_s: float, headers: dict[str, str],
                 numbered: bool, keepalive: type[ServerSentEvent] | None = None) -> EventSourceResponse:
    """An SSE response that writes a keepalive comment every keepalive_s from start to end, while the
    request waits in the queue, prefills and decodes alike (so proxies keep the connection open).

    `numbered`: the events carry `id:` lines (a logged stream); a plain stream's must not, and a
    plain event that has one is a bug caught here, not a framing a client has to cope with.
    `keepalive`: an API's own keepalive event (Anthropic's `ping`) in place of the comment."""
    if not numbered:
        events = _plain(events)
    factory = keepalive or (Keepalive if numbered else PlainKeepalive)
    return TimedEventSourceResponse(events, ping=keepalive_s, ping_message_factory=factory,
                                    headers={**headers, "Cache-Control": "no-cache"})


class TimedEventSourceResponse(EventSourceResponse):
    """sse-starlette's response with a send timeout (the app's `sse_send_timeout_s` unless given),
    whose expiry ends the stream quietly instead of escaping to the server as an exception."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.send_timeout is None:
            self.send_timeout = _send_timeout_of(scope)
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            client = scope.get("client")
            logger.warning("%s %s: the client %s took no data for %.0f s; the stream is dropped and the connection "
                           "closed", scope.get("method"), scope.get("path"), f"{client[0]}:{client[1]}" if client else "",
                           self.send_timeout)


def _send_timeout_of(scope: Any) -> float:
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    return float(getattr(getattr(ctx, "settings", None), "sse_send_timeout_s", DEFAULT_SEND_TIMEOUT_S))


async def _plain(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    async for event in events:
        if "id" in event:
            raise AssertionError(f"a plain SSE stream got an event with an id: {event!r}")
        yield event


async def wait_for_disconnect(receive: Any) -> None:
    """Returns when the client has gone (after the body was read, receive() only reports that)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_disconnect(coro: Coroutine[Any, Any, Any], receive: Any) -> tuple[bool, Any]:
    """Run coro unless the client disconnects first. Returns (completed, result)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return True, task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to report to
        pass
    return False, None
