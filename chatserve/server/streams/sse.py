"""How a `Generation`'s output reaches the client: as SSE events, or collected into one body.

Both ways end the engine work when the client goes: a stream's generator is closed by the
server on disconnect (its `finally` aborts), and a non-streaming request watches `receive()` for
`http.disconnect` while it collects. Either way the request is aborted within a step and the
abort reason ("client_disconnect") is recorded for the metrics and the cancel endpoint.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request

from chatserve.engine.async_engine import EngineDeadError
from chatserve.server.choices import Accumulator
from chatserve.server.chunks import ReplyFormat
from chatserve.server.errors import APIError, error_body
from chatserve.server.generation import Generation

# on_end(completed): runs once when a stream ends; raising APIError (completed only) replaces [DONE].
OnEnd = Callable[[bool], Awaitable[None]]


# Characters that str.splitlines() (and so the openai SDK's SSE decoder, and httpx's iter_lines)
# takes for line ends although SSE does not: raw inside a data line they cut one event in two. JSON
# escapes the other ones (< 0x20) itself; these it leaves raw with ensure_ascii=False.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """Compact JSON for one SSE data line: UTF-8 as is, except the line breaks splitlines() sees."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)


class SSECounter:
    """Numbers the SSE events of one stream (the `id:` field) 0, 1, 2, ...: the numbering of the event
    log too, so a resumable stream's ids (its log's sequence numbers) and a plain stream's agree."""

    def __init__(self) -> None:
        self.n = -1

    def event(self, data: Any) -> dict[str, Any]:
        self.n += 1
        return {"id": str(self.n), "data": data if isinstance(data, str) else dumps(data)}


class Keepalive(ServerSentEvent):
    """A keepalive: one SSE comment line and no blank line after it.

    NOTE: the events carry `id:` lines (a stream can be resumed from a cursor), and the decoders
    most clients run (the openai SDK's `SSEDecoder`, httpx-sse, everything built on them) keep the
    last event id and dispatch an event at *every* blank line once they have one, with empty
    `data` if nothing came since, which the SDK then json-parses and dies on. sse-starlette's
    default ping is a comment *plus* a blank line, so it broke every stream that lived longer than
    one keepalive interval. A comment line on its own is skipped by every spec-following parser
    (it adds no field, so the next real event is unchanged) and still keeps proxies and idle
    timeouts from closing the connection. Events are written one `send` each, so a keepalive only
    ever lands between two complete events.
    """

    LINE = b": keepalive\r\n"

    def __init__(self) -> None:
        super().__init__(comment="keepalive")

    def encode(self) -> bytes:
        return self.LINE


def sse_response(events: AsyncIterator[dict[str, Any]], *, keepalive_s: float,
                 headers: dict[str, str]) -> EventSourceResponse:
    """An SSE response that writes a keepalive comment every keepalive_s from start to end, while the
    request waits in the queue, prefills and decodes alike (so proxies keep the connection open)."""
    return EventSourceResponse(events, ping=keepalive_s, ping_message_factory=Keepalive,
                               headers={**headers, "Cache-Control": "no-cache"})


async def stream_events(
    gen: Generation,
    acc: Accumulator,
    fmt: ReplyFormat,
    *,
    include_usage: bool,
    on_end: OnEnd | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's chunk sequence: opening chunks, one per delta choice, the usage chunk if asked, [DONE].

    A dead engine ends the stream with an error event (no [DONE]). `on_end(True)` runs before the
    usage chunk; an APIError it raises becomes the last event instead of [DONE]. If the stream
    ends any other way (disconnect, dead engine), `on_end(False)` runs in the background.
    """
    sse = SSECounter()
    completed = False
    try:
        for choice in fmt.opening_choices(len(acc.choices)):
            yield sse.event(fmt.chunk([choice], include_usage))
        try:
            async for deltas in gen.deltas():
                for d in deltas:
                    acc.add(d)
                    if d.finish_reason == "error":  # e.g. a grammar that failed mid-generation: this request only
                        yield sse.event(generation_error(d.error).body())
                        return
                    for choice in fmt.delta_choices(d):
                        yield sse.event(fmt.chunk([choice], include_usage))
        except EngineDeadError as exc:
            yield sse.event(error_body(503, str(exc), code="engine_dead"))
            return
        completed = True
        if on_end is not None:
            try:
                await on_end(True)
            except APIError as exc:
                yield sse.event(exc.body())
                return
        if include_usage:
            yield sse.event(fmt.chunk([], True, gen.usage))
        yield sse.event("[DONE]")
    finally:
        if not gen.finished:
            gen.close("client_disconnect")
        if not completed and on_end is not None:
            gen.ctx.spawn(on_end(False))


async def collect_reply(request: Request, gen: Generation, acc: Accumulator) -> None:
    """Collect the whole reply unless the client leaves first (then abort, and answer nobody)."""

    async def collect() -> None:
        async for deltas in gen.deltas():
            for d in deltas:
                acc.add(d)

    try:
        completed, _ = await run_or_disconnect(collect(), request.receive)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    finally:
        if not gen.finished:
            gen.close("client_disconnect")
    if not completed:
        raise APIError(499, "client closed the request")
    error = acc.first_error()
    if error is not None:
        raise generation_error(error)


def generation_error(reason: str | None) -> APIError:
    """A request the engine ended with finish_reason "error" (the engine itself goes on serving the others)."""
    return APIError(500, f"generation failed: {reason or 'unknown error'}", code="generation_error")


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
