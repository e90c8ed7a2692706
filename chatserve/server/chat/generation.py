"""Runs the engine requests behind one HTTP request and keeps every count honest.

`Generation` is what the chat, completions and session routes share: it starts one engine
request per prompt (each with `n` choices), merges their delta outputs into one stream of
`ChoiceDelta`s, and settles each engine request exactly once when it ends, whether it finished,
was cancelled through the endpoint, or lost its client: metrics observed, tracker updated, and
the abort reason recorded. Nothing here formats JSON (`chunks` does) or writes to the client
(`replies` does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.engine.async_engine import RequestMetrics
from chatserve.engine.input_processor import ProcessedPrompt
from chatserve.outputs import CompletionOutput, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams
from chatserve.server.chat.cache_usage import usage_extension
from chatserve.server.chat.choices import ChoiceDelta, Usage
from chatserve.server.context import ServerContext
from chatserve.server.errors import APIError, bad_request
from chatserve.server.tracker import TrackedRequest


class Generation:
    """One HTTP request's engine work. Iterate `deltas()` once; `close()` when the client leaves."""

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        *,
        session: SessionKV | None = None,
        cache_salt: str | None = None,
        cache_leases: list[CacheLease] | None = None,
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
        # prompt index -> its prompt logprobs (SamplingParams.prompt_logprobs), as the engine sends them once
        self.prompt_logprobs: dict[int, Any] = {}
        self.usage = Usage(prompt_tokens=sum(p.num_tokens for p in prompts),
                           reasoning_tokens=0 if params.reasoning is not None else None)
        self._reasoning_tokens: dict[tuple[str, int], int] = {}  # (engine id, choice) -> its reasoning tokens so far
        self._last_time: dict[str, float] = {}
        self._done: set[str] = set()
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._cached: dict[str, int] = {}
        self._stats: dict[str, RequestStats] = {}  # each engine request's record (for usage.chatserve)
        try:
            # Only the prefix-cache options a request sets are passed (engines built for tests take the plain call).
            options: dict[str, Any] = {}
            if session is not None:
                options["session"] = session
            if cache_salt is not None:
                options["cache_salt"] = cache_salt
            if cache_leases:
                options["cache_leases"] = cache_leases
            for eid, prompt in zip(engine_ids, prompts):
                # A ProcessedPrompt is not validated again: the route's input_processor.process did it.
                self._streams.append(ctx.engine.generate(prompt, params.clone(), request_id=eid, **options))
        except ValueError as exc:  # e.g. an engine id still live from an earlier request
            self._abandon()
            raise bad_request(str(exc), param="prompt") from None
        except Exception:
            self._abandon()
            raise

    @property
    def cached_tokens_so_far(self) -> int:
        """Prompt tokens the prefix cache served, as far as the engine has said (each request says it with its first output)."""
        return sum(self._cached.values())

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
        self._stats.setdefault(eid, out.stats)
        new_tokens = sum(len(o.token_ids) for o in out.outputs)
        if new_tokens:
            last = self._last_time.get(eid)
            if last is not None:
                self.ctx.metrics.observe_token_gap(now - last, new_tokens)
            self._last_time[eid] = now
        self.usage.completion_tokens += new_tokens
        if self.usage.reasoning_tokens is not None:
            for o in out.outputs:
                self._reasoning_tokens[(eid, o.index)] = o.num_reasoning_tokens
            self.usage.reasoning_tokens = sum(self._reasoning_tokens.values())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, out.prompt_logprobs)
        n = self.params.n
        deltas = [self._delta(prompt_index * n, o) for o in out.outputs]
        if out.finished:
            self._settle(eid)
        return deltas

    @staticmethod
    def _delta(base: int, o: CompletionOutput) -> ChoiceDelta:
        return ChoiceDelta(base + o.index, o.text, list(o.token_ids), o.logprobs, o.finish_reason, o.stop_reason,
                           getattr(o, "error", None), o.reasoning)

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
            self.usage.chatserve = usage_extension([self._stats.get(eid) for eid in self.engine_ids])
            self.ctx.tracker.finish(self.record)

    def _account(self, eid: str, m: RequestMetrics) -> None:
        if eid in self.record.metrics:
            return
        if m.num_cached_tokens and eid not in self._cached:
            self._cached[eid] = m.num_cached_tokens
        self._stats.setdefault(eid, m.stats)
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
