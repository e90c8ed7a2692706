"""The serving engine: many concurrent async streams over one synchronous `LLMEngine`.

`AsyncLLMEngine` is the facade the server uses; the job is split three ways:

* `EngineLoop` (engine_loop.py) owns the `LLMEngine`: one asyncio task applies queued commands
  between steps and runs each step on a dedicated worker thread, so steps never overlap and the
  event loop stays free for HTTP.
* `RequestRecord` / `RequestLedger` (request_record.py) own each request from admission to its
  last output; a request's end is recorded in one place whatever ended it.
* engine_messages.py holds the typed commands (`AddRequest`, `AbortRequest`, `CallInEngine`,
  `Shutdown`) and events (`OutputsReady`, `RequestAborted`, `RequestFailed`, `EngineDied`).

NOTE: the `LLMEngine` is not thread-safe: every public method here must be called from the
event-loop thread that drives the engine (the loop applies commands there, between steps).

Life of a request: `generate()` validates eagerly (the input processor's rules, once, plus the
duplicate id) and queues an `AddRequest`; the loop adds it at the next step boundary (not checking
it again); outputs flow through the record's queue; the iterator stops after the output with
`finished=True`. `abort()` (or leaving the `async for` early) queues an `AbortRequest`; the loop
applies it after the step in flight, so the final output (finish_reason "abort") arrives at most
one step later. If a step raises, every live stream raises `EngineDeadError` and the engine
refuses new work (`is_healthy()` is False).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.engine.engine_loop import MAX_IDLE_STEPS, EngineLoop
from chatserve.engine.engine_messages import AbortRequest, AddRequest, CallInEngine, EngineDeadError, RequestAborted
from chatserve.engine.input_processor import InputProcessor
from chatserve.engine.kv_event_publisher import KVEventsConfig
from chatserve.engine.llm_engine import EngineArgs, LLMEngine, PromptType
from chatserve.engine.request_record import METRICS_HISTORY, RequestLedger, RequestMetrics, RequestRecord, RequestStage
from chatserve.outputs import RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams
from chatserve.structured.compiler import GrammarCompilerBusy, GrammarCompileTimeout

T = TypeVar("T")

# Kept under their old names for readers of this module (a test waits for the loop's idle point).
_MAX_IDLE_STEPS = MAX_IDLE_STEPS
_METRICS_HISTORY = METRICS_HISTORY


class AsyncLLMEngine:
    """Async front of `LLMEngine`: `generate()` streams, `abort()` cancels, one loop owns the model.

    Owns the composition: the `LLMEngine`, its `EngineLoop` (commands, steps, the worker thread)
    and the `RequestLedger` (every live request's record and the recent metrics); it checks what a
    caller asks before anything is queued and answers what the server reads of the engine.

    Construct it anywhere (loading the model takes seconds, synchronously); the loop starts lazily
    on the running event loop at the first `generate()` (or `await start()`). If the event loop that
    drove it ends (e.g. `asyncio.run` returns), the loop task finishes the step in flight, aborts
    what was live and stops; a later event loop may use the engine again.
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        # NOTE: a step never blocks waiting for a grammar here: the compile's done-callback wakes the loop.
        engine.grammar_wait_s = 0.0
        self._requests = RequestLedger()
        executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatserve-engine")
        # NOTE: the loop calls `self._step` afresh each step (not a bound copy), so a test can wrap it.
        self._loop = EngineLoop(engine, self._requests, executor, step=lambda: self._step())
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        # NOTE: the engine is built on the same worker thread that will run every step. All
        # torch work then happens on one thread with one OpenMP team; building on one thread and
        # stepping on another left two teams competing for the cores (decode 36 -> 21 tok/s, 2 cores).
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatserve-engine")
        engine = executor.submit(LLMEngine, args).result()
        return cls(engine, executor)

    # ---- introspection -----------------------------------------------------------------------
    # NOTE: what the server needs of the engine, so nothing reaches through `.engine`. Settled at
    # load and never changed, so reading them from the event loop while a step runs is safe.
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The served model name (EngineArgs.served_model_name, else the model's folder name)."""
        return self.engine.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.args.max_num_seqs

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def input_processor(self) -> InputProcessor:
        """Render, tokenize and validate here, then hand the ProcessedPrompt to `generate()`: it is not checked again."""
        return self.engine.input_processor

    @property
    def block_size(self) -> int:
        """Tokens per KV block (what a KV-aware router hashes prompts by)."""
        return self.engine.args.block_size

    @property
    def kv_events_config(self) -> KVEventsConfig | None:
        """Where this engine publishes KV events (None: off)."""
        return self.engine.kv_events_config

    def is_healthy(self) -> bool:
        return self._loop.dead is None

    @property
    def is_running(self) -> bool:
        return self._loop.is_running

    @property
    def num_live_requests(self) -> int:
        return len(self._requests.live)

    @property
    def recent_metrics(self) -> collections.deque[RequestMetrics]:
        """The last `METRICS_HISTORY` finished requests' metrics, oldest first."""
        return self._requests.recent_metrics

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """A live request's metrics, or a recently finished one's (the last `METRICS_HISTORY` kept)."""
        return self._requests.metrics(request_id)

    def loop_state(self) -> dict[str, Any]:
        """Where the engine loop is, for debugging stalls: stepping, idle, or gone."""
        return self._loop.state()

    def stats(self) -> dict[str, Any]:
        """The LLMEngine's counters as of the last step boundary (a snapshot the loop takes), plus ours.

        Keys include num_running, num_waiting, num_total_blocks, num_free_blocks, num_cached_blocks,
        num_locked_blocks, prefix_cache_*, num_preemptions, num_steps; ours: num_live_requests,
        num_requests_ended (however they ended: each request once) and is_healthy.
        """
        snap = dict(self._loop.stats_snapshot)
        snap["num_live_requests"] = len(self._requests.live)
        snap["num_requests_ended"] = self._requests.num_ended
        snap["is_healthy"] = self.is_healthy()
        return snap

    async def check_structured_outputs(self, params: SamplingParams, timeout_s: float | None = None) -> None:
        """Compile (cached) the request's grammar on the compiler's threads, without blocking the event
        loop or a step; raises StructuredOutputError (a ValueError naming the field, e.g.
        "structured_outputs.json: invalid JSON schema: ...") so the server can answer 400 first.

        With `timeout_s`: a compile that ran that long is GrammarCompileTimeout (a ValueError: the
        grammar is too big), one still queued behind other requests' compiles after that long is
        GrammarCompilerBusy. A caller that stops waiting (timeout, or its task is cancelled: the
        client left) releases its hold, and a compile nobody waits for is cancelled if it has not
        started (compiler.py)."""
        spec = params.structured_outputs
        if spec is None:
            return
        ticket = self.engine.structured.acquire(spec)
        loop = asyncio.get_running_loop()
        try:
            started = _bridge(ticket.started, loop)
            try:
                began = await asyncio.wait_for(started, timeout_s)
            except asyncio.TimeoutError:
                raise GrammarCompilerBusy(spec.kind, timeout_s or 0.0) from None
            left = None if timeout_s is None else max(timeout_s - (time.monotonic() - began), 0.0)
            try:
                await asyncio.wait_for(_bridge(ticket.result, loop), left)
            except asyncio.TimeoutError:
                raise GrammarCompileTimeout(spec.kind, timeout_s or 0.0) from None
        finally:
            ticket.release()

    async def release_kv_lease(self, session_id: str) -> bool:
        """End a session's KV lease (between steps); False if it held none."""
        return await self._call_between_steps(functools.partial(self.engine.release_kv_lease, session_id))

    async def session_cache_report(
        self, session_id: str, history_token_ids: list[int], cache_salt: str | None = None
    ) -> dict[str, Any]:
        """What the prefix cache holds of a session (see `LLMEngine.session_cache_report`), read between steps."""
        return await self._call_between_steps(
            functools.partial(self.engine.session_cache_report, session_id, history_token_ids, cache_salt))

    async def check_integrity(self) -> None:
        """Check the KV-cache invariants between steps; raises AssertionError if one is broken."""
        await self._call_between_steps(self.engine.check_integrity)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._check_accepting()
        self._loop.ensure_running()

    def _check_accepting(self) -> None:
        if self._loop.dead is not None:
            raise EngineDeadError(self._loop.dead.cause)
        if self._loop.closing:
            raise RuntimeError("the engine has been shut down; create a new AsyncLLMEngine")

    async def shutdown(self) -> None:
        """Abort every live request (their streams end with finish_reason "abort"), stop the loop and
        the worker thread. Idempotent; the engine accepts no work afterwards."""
        if self._loop.is_running:
            await self._loop.stop()  # it applies what is queued, then returns between steps
        self._loop.closing = True
        if self._loop.dead is None:
            self._loop.apply_commands()  # a final abort or integrity check queued in the meantime
            self._loop.abort_all()
        self.engine.close()
        self._loop.executor.shutdown(wait=True)

    def _step(self) -> list[RequestOutput]:
        """The one call that runs on the worker thread: a step, then the stats snapshot `stats()` reads."""
        return self._loop.step_on_worker()

    # ---- requests ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        session: SessionKV | None = None,
        cache_salt: str | None = None,
        cache_leases: Iterable[CacheLease | tuple[int, float]] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Start a request and return an async iterator of its outputs (shaped by `output_kind`).

        Prefix-cache options (docs/prefix-cache.md, "Salts and prefix leases"):

        * ``cache_salt``: a non-empty string (vLLM's ``cache_salt``, against prefix-cache timing side
          channels): the request shares KV blocks only with requests of the same salt, in the radix
          tree, the disk and Redis tiers and the KV events. None: shares with every unsalted request.
        * ``cache_leases``: up to 4 ``CacheLease(position, ttl_s)`` (or ``(position, ttl_s)`` pairs):
          when the request ends, the prefix of its prompt up to token ``position`` (whole KV blocks;
          past the prompt: all of it) stays leased for ``ttl_s`` seconds, keyed by its block-hash
          chain and salt; each later request whose prompt matches it renews it. Leases are soft (kept
          while anything unleased can be evicted instead) and capped by ``--max-prefix-leased-blocks``
          (the least recently renewed lease is dropped first, counted). Anthropic's ``cache_control``
          breakpoint = one lease at the breakpoint's token position, ttl 300 or 3600; OpenAI's
          ``prompt_cache_key`` = one lease at ``len(prompt)`` with the retention's TTL.

        Both are checked here (a PromptError with ``param`` "cache_salt" / "cache_leases").

        A regular method, not an `async def`, on purpose: everything that can be refused is checked
        here, before any work, so the caller gets the ValueError (a PromptError for the prompt: too
        long, empty, bad token ids; or a duplicate live request_id) or EngineDeadError at the call,
        not on first iteration. A ProcessedPrompt (from `input_processor.process`) is not checked
        again. Must be called from within the running event loop that drives this engine.

        Leaving the `async for` early (break, `aclose()`, cancellation) aborts the request. An
        iterator that is never iterated still runs its request to the end (and buffers its outputs).
        """
        self._check_accepting()
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._requests.live:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id per request")
        params = sampling_params if sampling_params is not None else SamplingParams()
        salt, leases = self.engine.check_cache_options(cache_salt, cache_leases)
        processed = self.engine.input_processor.process(prompt, truncate_prompt_tokens=params.truncate_prompt_tokens)
        self.engine.input_processor.check_params(params)
        self._loop.ensure_running()
        stats = RequestStats(num_prompt_tokens=processed.num_tokens)
        if session is not None:
            stats.session_history_tokens = session.history_tokens
        record = RequestRecord(request_id=request_id, prompt=processed, params=params, metrics=RequestMetrics(request_id, stats),
                               session=session, cache_salt=salt, cache_leases=leases)
        self._requests.admit(record)
        self._loop.submit(AddRequest(record))
        return self._iterate(record)

    async def _iterate(self, record: RequestRecord) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                item = await record.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # NOTE: runs on break / aclose() / cancellation / garbage collection of the generator.
            if not record.ended:
                self._abort_nowait(record)

    async def abort(self, request_id: str) -> RequestMetrics | None:
        """Finish a request with finish_reason "abort". Idempotent; unknown or finished ids are a no-op.

        Returns once the abort is applied: its stream then holds its final output, and the id may be
        reused. That happens at the next step boundary: at most one step after this call. Returns the
        request's metrics (`aborted_in_state`, `blocks_freed`, ...), or None if it was not live.
        """
        record = self._requests.live.get(request_id)
        if record is None:
            return None
        self._abort_nowait(record)
        await record.done.wait()
        return record.metrics

    def _abort_nowait(self, record: RequestRecord) -> None:
        if record.ended or self._loop.dead is not None:
            return
        if record.metrics.abort_step is None:
            record.metrics.abort_step = self.engine.num_steps
        if record.stage is RequestStage.ACCEPTED:
            # Not in the LLMEngine yet (its AddRequest is still queued): it ends here; the loop skips the add.
            self._requests.apply(RequestAborted(record, record.abort_output(), "waiting", 0, self.engine.num_steps))
            return
        if not record.abort_queued:
            record.abort_queued = True
            # Also tell the step in flight (it runs on the worker thread): a prefill of only
            # aborted requests stops at its next layer rather than finishing for nobody.
            self.engine.request_abort_soon(record.request_id)
            self._loop.submit(AbortRequest(record))

    async def _call_between_steps(self, fn: Callable[[], T]) -> T:
        """Run fn on the event-loop thread at the next step boundary (or now, if no loop runs)."""
        if self._loop.dead is not None:
            raise EngineDeadError(self._loop.dead.cause)  # the LLMEngine's state is unknown: do not touch it
        if not self.is_running:
            return fn()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._loop.submit(CallInEngine(fn, future))
        return await future


__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestMetrics"]


def _bridge(future: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """An asyncio future of its own that follows a concurrent one (which may be shared with other
    waiters: cancelling this one never cancels it, as asyncio.wrap_future would)."""
    out = loop.create_future()

    def copy(src: Any) -> None:
        if out.done():
            return
        if src.cancelled():
            out.cancel()
        elif src.exception() is not None:
            out.set_exception(src.exception())
        else:
            out.set_result(src.result())

    def done(src: Any) -> None:
        try:
            loop.call_soon_threadsafe(copy, src)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    future.add_done_callback(done)
    return out
