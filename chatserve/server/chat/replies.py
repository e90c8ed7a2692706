"""How a `Generation`'s output reaches the client: as SSE chunk events, or collected into one body;
and, when the request asked for it, as a logged run that outlives its connection.

Both ways end the engine work when the client goes: a stream's generator is closed by the
server on disconnect (its `finally` aborts), and a non-streaming request watches `receive()` for
`http.disconnect` while it collects. Either way the request is aborted within a step and the
abort reason ("client_disconnect") is recorded for the metrics and the cancel endpoint. A logged
stream (`stream_policy` says when) runs under the run registry instead (streams/runs.py), and its
disconnect policy says what a lost connection means.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request

from chatserve.engine.async_engine import EngineDeadError
from chatserve.server.chat.choices import Accumulator
from chatserve.server.chat.chunks import ReplyFormat
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.context import ServerContext
from chatserve.server.errors import APIError, bad_request, error_body
from chatserve.server.streams.resume import RESUME_HEADER, follow_sse, resume_path
from chatserve.server.streams.runs import DisconnectPolicy
from chatserve.server.streams.sse import data_event, run_or_disconnect, sse_response

# on_end(completed): runs once when a stream ends; raising APIError (completed only) replaces [DONE].
OnEnd = Callable[[bool], Awaitable[None]]


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
    completed = False
    try:
        for choice in fmt.opening_choices(len(acc.choices)):
            yield data_event(fmt.chunk([choice], include_usage))
        try:
            async for deltas in gen.deltas():
                for d in deltas:
                    acc.add(d)
                    if d.finish_reason == "error":  # e.g. a grammar that failed mid-generation: this request only
                        yield data_event(generation_error(d.error).body())
                        return
                    for choice in fmt.delta_choices(d):
                        yield data_event(fmt.chunk([choice], include_usage))
        except EngineDeadError as exc:
            yield data_event(error_body(503, str(exc), code="engine_dead"))
            return
        completed = True
        if on_end is not None:
            try:
                await on_end(True)
            except APIError as exc:
                yield data_event(exc.body())
                return
        if include_usage:
            yield data_event(fmt.chunk([], True, gen.usage))
        yield data_event("[DONE]")
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


def logged_stream(ctx: ServerContext, run_id: str, events: AsyncIterator[dict[str, Any]], *,
                  policy: DisconnectPolicy, gen: Generation, headers: dict[str, str]) -> EventSourceResponse:
    """Run `events` (stream_events' SSE dicts) as a run under `run_id` and answer with its first reader."""

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        async for event in events:
            yield event  # plain events: the log numbers them itself

    try:
        ctx.runs.start(run_id, payloads(), policy=policy, on_abort=gen.close)
    except ValueError as exc:
        gen.close("client_disconnect")
        raise APIError(409, str(exc), param="X-Request-Id", code="duplicate_request_id") from None
    return sse_response(follow_sse(ctx.runs, run_id, -1), keepalive_s=ctx.settings.sse_keepalive_s,
                        headers={**headers, RESUME_HEADER: resume_path(run_id)}, numbered=True)
