"""Runs the engine requests behind one HTTP request and keeps every count honest.

`Generation` is what the chat, completions and session routes share: it starts one engine
request per prompt (each with `n` choices), merges their delta outputs into one stream of
`ChoiceDelta`s, and settles each engine request exactly once when it ends, whether it finished,
was cancelled through the endpoint, or lost its client: metrics observed, tracker updated, and
the abort reason recorded. Nothing here formats JSON; the routes do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from chatserve.engine.async_engine import AsyncLLMEngine, RequestMetrics
from chatserve.outputs import CompletionOutput, RequestOutput
from chatserve.sampling_params import SamplingParams

from chatserve.server.errors import APIError, bad_request
from chatserve.server.metrics import ServerMetrics
from chatserve.server.settings import ServerSettings
from chatserve.server.tracker import RequestTracker, TrackedRequest

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    """Everything a route needs; lives on `app.state.ctx` (no module globals)."""

    engine: AsyncLLMEngine
    sessions: Any  # chatserve.sessions.SessionStore | None
    settings: ServerSettings
    metrics: ServerMetrics
    tracker: RequestTracker
    model_name: str
    background: set[asyncio.Task] = field(default_factory=set)
    accepting: bool = True  # False once shutdown began
    started_at: int = field(default_factory=lambda: int(time.time()))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task that outlives the request that started it (e.g. settling after a disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def drain(self, grace_s: float) -> None:
        """Shutdown: refuse new work, let running requests finish for up to grace_s, then abort the
        rest (their streams end with finish_reason "abort" and [DONE]; session turns are stored)."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.tracker.live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        live = [rec.owner for rec in list(self.tracker.live.values()) if rec.owner is not None]
        if live:
            logger.warning("shutdown: aborting %d request(s) still running after %.1fs", len(live), grace_s)
            await asyncio.gather(*(gen.cancel("engine") for gen in live), return_exceptions=True)
        # Let the streams write their final events and the session turns land.
        deadline = loop.time() + 5.0
        while (self.tracker.live or self.background) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_capacity(self) -> None:
        """Shed load with 503 + Retry-After once the waiting queue is full, instead of queueing forever."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if not self.engine.is_healthy():
            raise APIError(503, "the engine has failed and must be restarted", code="engine_dead")
        limit = self.engine.engine.args.max_num_seqs + self.settings.max_queue_len
        if self.engine.num_live_requests >= limit:
            raise APIError(
                503,
                f"the server is overloaded ({self.engine.num_live_requests} requests in flight, limit {limit}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, param: str = "messages") -> None:
        """OpenAI's wording, with the numbers, for a prompt that cannot fit."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise bad_request("the prompt is empty", param=param)
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for a reply. Please shorten the prompt.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
                "the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )


@dataclass
class ChoiceDelta:
    """New output of one choice since the last delta."""

    index: int  # choice index across all prompts: prompt_index * n + output index
    text: str
    token_ids: list[int]
    logprobs: Any  # SampleLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    """One HTTP request's engine work. Iterate `deltas()` once; `close()` when the client leaves."""

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.params = params
        params.output_kind = "delta"
        self.prompts = prompts
        engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.engine_ids = engine_ids
        try:
            self.record: TrackedRequest = ctx.tracker.start(request_id, engine_ids)
            self.record.owner = self
        except KeyError:
            raise APIError(409, f"a request with id {request_id!r} is already running; use a unique X-Request-Id",
                           param="X-Request-Id", code="duplicate_request_id") from None
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        self.first_output_time: float | None = None
        self._last_time: dict[str, float] = {}
        self._done: set[str] = set()
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._cached: dict[str, int] = {}
        try:
            for eid, ids in zip(engine_ids, prompts):
                self._streams.append(ctx.engine.generate({"prompt_token_ids": ids}, params.clone(), request_id=eid))
        except ValueError as exc:
            self._abandon()
            raise bad_request(str(exc), param="prompt") from None
        except Exception:
            self._abandon()
            raise

    @property
    def finished(self) -> bool:
        return len(self._done) == len(self.engine_ids)

    def _abandon(self) -> None:
        """Construction failed half-way: abort what started, settle the record."""
        for eid in self.engine_ids[: len(self._streams)]:
            self.ctx.spawn(self._settle_after_abort(eid))
        if not self._streams:
            self.ctx.tracker.finish(self.record)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        if len(self._streams) == 1:
            async for out in self._streams[0]:
                yield self._convert(0, out)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self._convert(i, item)
        finally:
            for t in tasks:
                t.cancel()

    def _convert(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        now = time.monotonic()
        eid = out.request_id
        if out.num_cached_tokens and eid not in self._cached:
            self._cached[eid] = out.num_cached_tokens
        new_tokens = sum(len(o.token_ids) for o in out.outputs)
        if new_tokens:
            if self.first_output_time is None:
                self.first_output_time = now
            last = self._last_time.get(eid)
            if last is not None:
                self.ctx.metrics.observe_token_gap(now - last, new_tokens)
            self._last_time[eid] = now
        self.usage.completion_tokens += new_tokens
        n = self.params.n
        deltas = [self._delta(prompt_index * n, o) for o in out.outputs]
        if out.finished:
            self._settle(eid)
        return deltas

    @staticmethod
    def _delta(base: int, o: CompletionOutput) -> ChoiceDelta:
        return ChoiceDelta(base + o.index, o.text, list(o.token_ids), o.logprobs, o.finish_reason, o.stop_reason)

    def _settle(self, eid: str) -> None:
        """An engine request ended (its final output was seen or its abort returned): count it once."""
        if eid in self._done:
            return
        self._done.add(eid)
        m = self.ctx.engine.request_metrics(eid)
        if m is not None:
            self._account(eid, m)
        self._complete_if_done()

    def _complete_if_done(self) -> None:
        if self.finished:
            self.usage.cached_tokens = sum(self._cached.values())
            self.ctx.tracker.finish(self.record)

    def _account(self, eid: str, m: RequestMetrics) -> None:
        if eid in self.record.metrics:
            return
        if m.num_cached_tokens and eid not in self._cached:
            self._cached[eid] = m.num_cached_tokens
        self.record.absorb(eid, m)
        abort_reason = self.record.abort_reason if m.finish_reason == "abort" else None
        self.ctx.metrics.observe_finished(m, m.finish_reason, abort_reason)

    async def _settle_after_abort(self, eid: str) -> None:
        m = await self.ctx.engine.abort(eid)
        if m is None:
            m = self.ctx.engine.request_metrics(eid)
        if m is not None:
            self._account(eid, m)
        self._done.add(eid)
        self._complete_if_done()

    def close(self, reason: str = "client_disconnect") -> None:
        """The consumer is gone before the end: abort what is still running, settle in the background.

        Safe to call from a cancelled task (nothing awaited here) and more than once.
        """
        if self.finished:
            return
        if self.record.abort_reason is None:
            self.record.abort_reason = reason
        for eid in self.engine_ids:
            if eid not in self._done:
                self.ctx.spawn(self._settle_after_abort(eid))

    async def cancel(self, reason: str = "cancel_endpoint") -> None:
        """Abort every engine request now and settle them before returning (cancel endpoint, shutdown)."""
        if self.record.abort_reason is None:
            self.record.abort_reason = reason
        await asyncio.gather(*(self._settle_after_abort(eid) for eid in self.engine_ids if eid not in self._done))


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
