"""The serving engine: many concurrent async streams over one synchronous `LLMEngine`.

One background asyncio task (the *loop*) owns the `LLMEngine`. While there is
work it runs `engine.step()` in a dedicated single-thread executor, so steps
never overlap and the event loop stays free for HTTP; then it hands each
`RequestOutput` to its request's `asyncio.Queue`. When idle it waits on an
`asyncio.Event` (no spinning, no polling).

NOTE: the `LLMEngine` is not thread-safe. Every call that changes it
(`add_request`, `abort_request`, `check_integrity`) is queued and applied by the
loop *between* steps, on the event-loop thread, never while a step is in flight.
Only `step()` itself runs in the worker thread. Consequently every public method
here must be called from the event-loop thread that drives the engine.

Life of a request: `generate()` validates eagerly (the input processor's rules,
once, plus the duplicate id) and queues the add of its `ProcessedPrompt`; the
loop adds it at the next step boundary (not checking it again); outputs flow
through the queue; the iterator stops after the output with `finished=True`.
`abort()` (or leaving the `async for` early) queues an abort; the loop applies it
after the step in flight, so the final output (finish_reason "abort") arrives at
most one step later. If a step raises, every live stream raises
`EngineDeadError` and the engine refuses new work (`is_healthy()` is False).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.engine.input_processor import InputProcessor, ProcessedPrompt
from chatserve.engine.kv_event_publisher import KVEventsConfig
from chatserve.engine.llm_engine import EngineArgs, LLMEngine, PromptType
from chatserve.outputs import CompletionOutput, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams
from chatserve.structured.compiler import GrammarCompilerBusy, GrammarCompileTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")

# After this many consecutive steps that scheduled nothing, the loop stops stepping and waits for a
# new request or abort (which is the only thing that can change the scheduler's mind). Reaching it
# means a request can never be scheduled (e.g. it outgrew the KV pool); it is logged, not spun on.
_MAX_IDLE_STEPS = 2
# Finished requests whose metrics are kept for inspection (`recent_metrics`).
_METRICS_HISTORY = 1024


class EngineDeadError(RuntimeError):
    """The engine loop failed (a model step raised); the engine accepts no more work.

    The original exception is in `cause` (and `__cause__`). Restart the process to recover.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the engine loop died: {type(cause).__name__}: {cause}; restart the server to recover")
        self.cause = cause
        self.__cause__ = cause


@dataclass
class RequestMetrics:
    """One request's life as the async side saw it: its `RequestStats` (timings and counters,
    filled by the engine) plus what only the async side knows: how it ended and, for an abort,
    when and where it landed. The timing names read through to `stats`, so there is one copy.
    """

    request_id: str
    stats: RequestStats  # arrival_time is when generate() accepted it
    finish_reason: str | None = None
    # LLMEngine.num_steps when an abort was asked for and when the final output was handed over:
    # finish_step - abort_step <= 1 (an abort waits at most for the step in flight).
    abort_step: int | None = None
    finish_step: int | None = None
    # Set when an abort lands: where the request stood ("waiting", "prefilling", "decoding") and how
    # many KV blocks it gave back (see LLMEngine.describe_request). None if it finished on its own.
    aborted_in_state: str | None = None
    blocks_freed: int = 0

    @property
    def arrival_time(self) -> float:
        return self.stats.arrival_time

    @property
    def first_scheduled_time(self) -> float | None:
        return self.stats.first_scheduled_time

    @property
    def first_token_time(self) -> float | None:
        return self.stats.first_token_time

    @property
    def finish_time(self) -> float | None:
        return self.stats.finish_time

    @property
    def num_prompt_tokens(self) -> int:
        return self.stats.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.stats.num_cached_tokens

    @property
    def num_generated_tokens(self) -> int:
        return self.stats.num_generated_tokens

    @property
    def queue_time(self) -> float | None:
        return self.stats.queue_time

    @property
    def time_to_first_token(self) -> float | None:
        return self.stats.time_to_first_token

    @property
    def latency(self) -> float | None:
        return self.stats.latency


@dataclass(eq=False)
class _Stream:
    """One request as the async side sees it: its queue and where it stands."""

    request_id: str
    prompt: ProcessedPrompt  # processed once, eagerly, by generate()
    params: SamplingParams
    metrics: RequestMetrics
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | EngineDeadError
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once the final item is queued
    added: bool = False  # the loop has added it to the LLMEngine
    abort_queued: bool = False
    finished: bool = False  # the final output (or an error) is in the queue
    session: SessionKV | None = None  # a session turn (its cache branch is leased when it ends)
    cache_salt: str | None = None  # shares KV blocks only with requests of the same salt
    cache_leases: tuple[CacheLease, ...] = ()  # prompt prefixes leased when it ends

    @property
    def n(self) -> int:
        return self.params.n


class AsyncLLMEngine:
    """Async front of `LLMEngine`: `generate()` streams, `abort()` cancels, one loop owns the model.

    Construct it anywhere (loading the model takes seconds, synchronously); the loop starts lazily
    on the running event loop at the first `generate()` (or `await start()`). If the event loop that
    drove it ends (e.g. `asyncio.run` returns), the loop task finishes the step in flight, aborts
    what was live and stops; a later event loop may use the engine again.
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        # NOTE: a step never blocks waiting for a grammar here: the compile's done-callback wakes the loop.
        engine.grammar_wait_s = 0.0
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatserve-engine")
        self._streams: dict[str, _Stream] = {}  # live requests: accepted and not yet finished
        self._pending: collections.deque[tuple] = collections.deque()  # ops for the next step boundary
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._step_future: asyncio.Future | None = None
        self._closing = False  # shutdown() began: no new work, no new loop
        self._last_step_end: float | None = None
        self._idle = False
        self._dead: EngineDeadError | None = None
        self._stats: dict[str, Any] = engine.stats()
        self._ids = itertools.count()
        self.recent_metrics: collections.deque[RequestMetrics] = collections.deque(maxlen=_METRICS_HISTORY)

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
        return self._dead is None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """A live request's metrics, or a recently finished one's (the last `_METRICS_HISTORY` kept)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            return stream.metrics
        return next((m for m in reversed(self.recent_metrics) if m.request_id == request_id), None)

    def loop_state(self) -> dict[str, Any]:
        """Where the engine loop is, for debugging stalls: stepping, idle, or gone."""
        return {
            "task_alive": self.is_running,
            "step_in_flight": self._step_future is not None,
            "seconds_since_last_step": None if self._last_step_end is None else time.monotonic() - self._last_step_end,
            "pending_ops": len(self._pending),
            "waiting_for_wakeup": self._idle,
            "engine_unfinished": self.engine.has_unfinished_requests(),
        }

    def stats(self) -> dict[str, Any]:
        """The LLMEngine's counters as of the last step boundary (a snapshot the loop takes), plus ours.

        Keys include num_running, num_waiting, num_total_blocks, num_free_blocks, num_cached_blocks,
        num_locked_blocks, prefix_cache_*, num_preemptions, num_steps.
        """
        snap = dict(self._stats)
        snap["num_live_requests"] = len(self._streams)
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
        self._ensure_loop()

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead.cause)
        if self._closing:
            raise RuntimeError("the engine has been shut down; create a new AsyncLLMEngine")

    def _ensure_loop(self) -> None:
        if self._closing or self._dead is not None:
            return  # shutdown() (or _fail) settles whatever is still queued
        running = asyncio.get_running_loop()
        if self._task is not None and not self._task.done():
            if self._task.get_loop() is not running:
                raise RuntimeError("this AsyncLLMEngine is driven by another event loop; use it from that loop only")
            return
        # NOTE: a finished task left nothing behind: on exit the loop aborts every live stream.
        self._wakeup = asyncio.Event()
        self._task = running.create_task(self._run_loop(), name="chatserve-engine-loop")

    async def shutdown(self) -> None:
        """Abort every live request (their streams end with finish_reason "abort"), stop the loop and
        the worker thread. Idempotent; the engine accepts no work afterwards."""
        if self.is_running:
            assert self._task is not None and self._wakeup is not None
            if self._task.get_loop() is not asyncio.get_running_loop():
                raise RuntimeError("shut this AsyncLLMEngine down from the event loop that drives it")
            self._closing = True
            self._wakeup.set()
            await asyncio.shield(self._task)  # it applies what is queued, then returns between steps
        self._closing = True
        if self._dead is None:
            self._apply_pending()  # a final abort or integrity check queued in the meantime
            self._abort_all()
        self.engine.close()
        self._executor.shutdown(wait=True)

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
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id per request")
        params = sampling_params if sampling_params is not None else SamplingParams()
        salt, leases = self.engine.check_cache_options(cache_salt, cache_leases)
        processed = self.engine.input_processor.process(prompt)
        self._ensure_loop()
        stats = RequestStats(num_prompt_tokens=processed.num_tokens)
        if session is not None:
            stats.session_history_tokens = session.history_tokens
        stream = _Stream(request_id=request_id, prompt=processed, params=params, metrics=RequestMetrics(request_id, stats),
                         session=session, cache_salt=salt, cache_leases=leases)
        self._streams[request_id] = stream
        self._enqueue(("add", stream))
        return self._iterate(stream)

    async def _iterate(self, stream: _Stream) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # NOTE: runs on break / aclose() / cancellation / garbage collection of the generator.
            if not stream.finished:
                self._abort_nowait(stream)

    async def abort(self, request_id: str) -> RequestMetrics | None:
        """Finish a request with finish_reason "abort". Idempotent; unknown or finished ids are a no-op.

        Returns once the abort is applied: its stream then holds its final output, and the id may be
        reused. That happens at the next step boundary: at most one step after this call. Returns the
        request's metrics (`aborted_in_state`, `blocks_freed`, ...), or None if it was not live.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        self._abort_nowait(stream)
        await stream.done.wait()
        return stream.metrics

    def _abort_nowait(self, stream: _Stream) -> None:
        if stream.finished or self._dead is not None:
            return
        if stream.metrics.abort_step is None:
            stream.metrics.abort_step = self.engine.num_steps
        if not stream.added:
            # Not in the LLMEngine yet (its add is still queued): finish it here; the loop skips the add.
            stream.metrics.aborted_in_state = "waiting"
            self._deliver(stream, self._abort_output(stream))
            return
        if not stream.abort_queued:
            stream.abort_queued = True
            # Also tell the step in flight (it runs on the executor thread): a prefill of only
            # aborted requests stops at its next layer rather than finishing for nobody.
            self.engine.request_abort_soon(stream.request_id)
            self._enqueue(("abort", stream))

    def _enqueue(self, op: tuple) -> None:
        self._pending.append(op)
        self._ensure_loop()
        if self._wakeup is not None:
            self._wakeup.set()

    async def _call_between_steps(self, fn: Callable[[], T]) -> T:
        """Run fn on the event-loop thread at the next step boundary (or now, if no loop runs)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead.cause)  # the LLMEngine's state is unknown: do not touch it
        if not self.is_running:
            return fn()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._enqueue(("call", fn, fut))
        return await fut

    # ---- the loop ----------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        # a request waiting for a KV tier lookup wakes the loop when it lands (like a grammar)
        self.engine.kv_lookup_started = lambda fut: fut.add_done_callback(self._wake_from_thread(loop))
        idle_steps = 0
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                if self._closing:
                    return
                if not self.engine.has_unfinished_requests() or idle_steps >= _MAX_IDLE_STEPS:
                    if idle_steps >= _MAX_IDLE_STEPS and not (self.engine.num_waiting_for_grammar or self.engine.num_waiting_for_kv):
                        logger.warning("the scheduler can schedule nothing (%s); waiting for an abort", self._stats)
                    idle_steps = 0
                    if not self._pending:
                        self._idle = True
                        try:
                            await self._wakeup.wait()
                        finally:
                            self._idle = False
                        self._wakeup.clear()  # (no await since it returned: nothing can have been lost)
                    continue
                # NOTE: the wake-up is cleared only right before something looks (this step: the waiting
                # grammars and KV tier lookups; the next _apply_pending: the queue) or right after the
                # wait returns, never on the way to sleep: a wake-up during the step (a lookup landing
                # after the step looked) stays set, so the idle wait returns at once. (Cleared before
                # the wait, such a lookup was lost and its request never ran.)
                self._wakeup.clear()
                steps_before = self.engine.num_steps
                self._step_future = loop.run_in_executor(self._executor, self._step)
                # NOTE: shielded, so cancelling this task never abandons a step half-way: see below.
                outputs = await asyncio.shield(self._step_future)
                self._step_future = None
                self._last_step_end = time.monotonic()
                idle_steps = idle_steps + 1 if self.engine.num_steps == steps_before else 0
                self._dispatch(outputs)
        except asyncio.CancelledError:
            # The event loop is going away (or someone cancelled us): let the step in flight finish,
            # then end every live stream with an abort so nothing waits forever and no KV leaks.
            if self._step_future is not None:
                try:
                    outputs = await self._step_future
                except BaseException as exc:  # noqa: BLE001 - the step failed after all
                    self._fail(exc)
                    raise asyncio.CancelledError from None
                self._step_future = None
                self._dispatch(outputs)
            self._apply_pending()
            self._abort_all()
            raise
        except BaseException as exc:  # noqa: BLE001 - a failed step (or a bug here) kills the engine
            self._step_future = None
            logger.exception("chatserve engine loop died")
            self._fail(exc)

    def _wake_from_thread(self, loop: asyncio.AbstractEventLoop) -> Callable[[Any], None]:
        """A done-callback (run on the compiler's thread) that wakes the loop to admit the request."""

        def wake(_future: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                pass  # the event loop is closed: nobody waits for this request any more

        return wake

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _step(self) -> list[RequestOutput]:
        """Runs in the worker thread: one engine step, then a stats snapshot for `stats()`."""
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        return outputs

    def _apply_pending(self) -> None:
        """Apply queued adds, aborts and calls. Event-loop thread, between steps only."""
        if not self._pending:
            return
        while self._pending:
            op = self._pending.popleft()
            kind = op[0]
            if kind == "add":
                stream: _Stream = op[1]
                if stream.finished:
                    continue  # aborted before it was added
                try:
                    req = self.engine.add_request(stream.request_id, stream.prompt, stream.params, stats=stream.metrics.stats,
                                                  session=stream.session, cache_salt=stream.cache_salt,
                                                  cache_leases=stream.cache_leases)
                except Exception as exc:  # noqa: BLE001 - validated already; refuse this request only
                    self._deliver_error(stream, exc)
                    continue
                stream.added = True
                if req.grammar_future is not None:
                    req.grammar_future.add_done_callback(self._wake_from_thread(asyncio.get_running_loop()))
            elif kind == "abort":
                stream = op[1]
                if stream.finished:
                    continue  # it finished in the step that was in flight
                self._note_abort_state(stream)
                out = self.engine.abort_request(stream.request_id)
                self._deliver(stream, out if out is not None else self._abort_output(stream))
            elif kind == "call":
                fn, fut = op[1], op[2]
                if fut.cancelled():
                    continue
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
        self._stats = self.engine.stats()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue
            self._deliver(stream, out)

    def _deliver(self, stream: _Stream, out: RequestOutput) -> None:
        m = stream.metrics
        # NOTE: out.stats is m.stats (the engine fills the record generate() made), except for an
        # output made here for a request that never reached the engine: _abort_output passes it too.
        if out.finished:
            if m.stats.finish_time is None:
                m.stats.finish_time = time.monotonic()
            m.finish_step = self.engine.num_steps
            reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
            m.finish_reason = reasons[0] if reasons else None
            self._finish(stream)
        stream.queue.put_nowait(out)

    def _deliver_error(self, stream: _Stream, exc: BaseException) -> None:
        self._finish(stream)
        stream.queue.put_nowait(exc)

    def _finish(self, stream: _Stream) -> None:
        stream.finished = True
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        self.recent_metrics.append(stream.metrics)
        stream.done.set()

    @staticmethod
    def _abort_output(stream: _Stream) -> RequestOutput:
        """The final output of a request that never reached the LLMEngine (or left it already)."""
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt.prompt,
            prompt_token_ids=stream.prompt.prompt_token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(stream.n)],
            finished=True,
            stats=stream.metrics.stats,
        )

    def _abort_all(self) -> None:
        """End every live stream with an abort (event-loop thread, no step in flight)."""
        for stream in list(self._streams.values()):
            if stream.finished:
                continue
            if stream.added:
                self._note_abort_state(stream)
            else:
                stream.metrics.aborted_in_state = "waiting"
            out = self.engine.abort_request(stream.request_id) if stream.added else None
            self._deliver(stream, out if out is not None else self._abort_output(stream))
        self._stats = self.engine.stats()

    def _note_abort_state(self, stream: _Stream) -> None:
        info = self.engine.describe_request(stream.request_id)
        if info is not None:
            stream.metrics.aborted_in_state = info["status"]
            stream.metrics.blocks_freed = info["num_blocks"]

    def _fail(self, exc: BaseException) -> None:
        """A step raised: the LLMEngine's state is unknown, so never touch it again; fail everything."""
        self._dead = EngineDeadError(exc)
        for stream in list(self._streams.values()):
            if not stream.finished:
                # NOTE: one exception object per stream: raising one object in many tasks tangles tracebacks.
                self._deliver_error(stream, EngineDeadError(exc))
        while self._pending:
            op = self._pending.popleft()
            if op[0] == "call" and not op[2].done():
                op[2].set_exception(EngineDeadError(exc))
        self._executor.shutdown(wait=False)


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
