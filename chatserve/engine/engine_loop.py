"""The loop that owns the synchronous `LLMEngine` for `AsyncLLMEngine`.

One asyncio task runs the loop. While there is work it runs a step on a dedicated one-thread
executor (the worker thread), so steps never overlap and the event loop stays free for HTTP; then
it hands the step's outputs to the request records as one `OutputsReady`. When idle it waits on
an `asyncio.Event` (no spinning, no polling).

NOTE: the `LLMEngine` is not thread-safe. Every command that changes it (`AddRequest`,
`AbortRequest`, `CallInEngine`) is queued and applied by the loop *between* steps, on the
event-loop thread, never while a step is in flight. Only the step itself runs on the worker
thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chatserve.engine.engine_messages import (
    AbortRequest,
    AddRequest,
    CallInEngine,
    EngineCommand,
    EngineDeadError,
    EngineDied,
    OutputsReady,
    RequestAborted,
    RequestFailed,
    Shutdown,
)
from chatserve.engine.llm_engine import LLMEngine
from chatserve.engine.request_record import RequestLedger, RequestRecord, RequestStage
from chatserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# After this many consecutive steps that scheduled nothing, the loop stops stepping and waits for a
# new request or abort (which is the only thing that can change the scheduler's mind). Reaching it
# means a request can never be scheduled (e.g. it outgrew the KV pool); it is logged, not spun on.
MAX_IDLE_STEPS = 2


class EngineLoop:
    """Owns the driving of one `LLMEngine`: the queue of commands for the next step boundary, the
    asyncio task that steps the engine on the worker thread, the wake-up event, the step in flight,
    the stats snapshot taken after each step, and whether the engine died (then it never touches
    the `LLMEngine` again). What the engine reports goes to the `RequestLedger` as events.

    `step` is the function run on the worker thread for each step; it is looked up through the
    owner (`AsyncLLMEngine._step`) each time, so a test may wrap it.
    """

    def __init__(self, engine: LLMEngine, requests: RequestLedger, executor: ThreadPoolExecutor,
                 step: Callable[[], list[RequestOutput]]) -> None:
        self.engine = engine
        self.requests = requests
        self.executor = executor
        self._step = step
        self._commands: collections.deque[EngineCommand] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._step_future: asyncio.Future[list[RequestOutput]] | None = None
        self._last_step_end: float | None = None
        self._idle = False
        self.closing = False  # shutdown began: no new work, no new loop
        self.dead: EngineDeadError | None = None
        self.stats_snapshot: dict[str, Any] = engine.stats()

    # ---- state -------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def state(self) -> dict[str, Any]:
        """Where the loop is, for debugging stalls: stepping, idle, or gone."""
        return {
            "task_alive": self.is_running,
            "step_in_flight": self._step_future is not None,
            "seconds_since_last_step": None if self._last_step_end is None else time.monotonic() - self._last_step_end,
            "pending_ops": len(self._commands),
            "waiting_for_wakeup": self._idle,
            "engine_unfinished": self.engine.has_unfinished_requests(),
        }

    # ---- commands ----------------------------------------------------------------------------
    def submit(self, command: EngineCommand) -> None:
        """Queue a command for the next step boundary (starting the loop if none runs) and wake the loop."""
        self._commands.append(command)
        self.ensure_running()
        self.wake()

    def ensure_running(self) -> None:
        if self.closing or self.dead is not None:
            return  # shutdown (or the engine's death) settles whatever is still queued
        running = asyncio.get_running_loop()
        if self._task is not None and not self._task.done():
            if self._task.get_loop() is not running:
                raise RuntimeError("this AsyncLLMEngine is driven by another event loop; use it from that loop only")
            return
        # NOTE: a finished task left nothing behind: on exit the loop aborts every live request.
        self._wakeup = asyncio.Event()
        self._task = running.create_task(self._run(), name="chatserve-engine-loop")

    def wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def wake_from_thread(self, loop: asyncio.AbstractEventLoop) -> Callable[[Any], None]:
        """A done-callback (run on a compiler's or KV loader's thread) that wakes the loop to admit the request."""

        def wake(_future: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.wake)
            except RuntimeError:
                pass  # the event loop is closed: nobody waits for this request any more

        return wake

    async def stop(self) -> None:
        """Queue `Shutdown` and wait until the loop has applied what was queued before it and returned."""
        assert self._task is not None
        if self._task.get_loop() is not asyncio.get_running_loop():
            raise RuntimeError("shut this AsyncLLMEngine down from the event loop that drives it")
        self._commands.append(Shutdown())
        self.closing = True
        self.wake()
        await asyncio.shield(self._task)

    def apply_commands(self) -> bool:
        """Apply the queued commands in order (event-loop thread, between steps only); True if one was `Shutdown`."""
        if not self._commands:
            return False
        stop = False
        while self._commands:
            match self._commands.popleft():
                case AddRequest(record=record):
                    self._add(record)
                case AbortRequest(record=record):
                    if not record.ended:  # (else it finished in the step that was in flight)
                        self._abort_in_engine(record)
                case CallInEngine(fn=fn, future=future):
                    if future.cancelled():
                        continue
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # noqa: BLE001 - handed to the caller
                        future.set_exception(exc)
                case Shutdown():
                    stop = True
        self.stats_snapshot = self.engine.stats()
        return stop

    def _add(self, record: RequestRecord) -> None:
        if record.ended:
            return  # aborted before it was added
        try:
            req = self.engine.add_request(record.request_id, record.prompt, record.params, stats=record.metrics.stats,
                                          session=record.session, cache_salt=record.cache_salt, cache_leases=record.cache_leases)
        except Exception as exc:  # noqa: BLE001 - validated already; refuse this request only
            self.requests.apply(RequestFailed(record, exc))
            return
        record.stage = RequestStage.IN_ENGINE
        if req.grammar_future is not None:
            req.grammar_future.add_done_callback(self.wake_from_thread(asyncio.get_running_loop()))

    def _abort_in_engine(self, record: RequestRecord) -> None:
        """End a live request with an abort: taken out of the `LLMEngine` if it got there (noting where
        it stood and what it gave back), ended here with an empty final output if not."""
        if record.stage is RequestStage.IN_ENGINE:
            info = self.engine.describe_request(record.request_id)
            out = self.engine.abort_request(record.request_id)
            state, blocks = (info["status"], info["num_blocks"]) if info is not None else (None, 0)
        else:
            out, state, blocks = None, "waiting", 0
        final = out if out is not None else record.abort_output()
        self.requests.apply(RequestAborted(record, final, state, blocks, self.engine.num_steps))

    def abort_all(self) -> None:
        """End every live request with an abort (event-loop thread, no step in flight)."""
        for record in list(self.requests.live.values()):
            if not record.ended:
                self._abort_in_engine(record)
        self.stats_snapshot = self.engine.stats()

    # ---- the loop ----------------------------------------------------------------------------
    def step_on_worker(self) -> list[RequestOutput]:
        """Runs on the worker thread: one engine step, then a stats snapshot for `stats()`."""
        outputs = self.engine.step()
        self.stats_snapshot = self.engine.stats()
        return outputs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # a request waiting for a KV tier lookup wakes the loop when it lands (like a grammar)
        wake = self.wake_from_thread(loop)
        self.engine.kv_lookup_started = lambda fut: fut.add_done_callback(wake)
        idle_steps = 0
        assert self._wakeup is not None
        try:
            while True:
                if self.apply_commands():
                    return
                if not self.engine.has_unfinished_requests() or idle_steps >= MAX_IDLE_STEPS:
                    if idle_steps >= MAX_IDLE_STEPS and not (self.engine.num_waiting_for_grammar or self.engine.num_waiting_for_kv):
                        logger.warning("the scheduler can schedule nothing (%s); waiting for an abort", self.stats_snapshot)
                    idle_steps = 0
                    if not self._commands:
                        self._idle = True
                        try:
                            await self._wakeup.wait()
                        finally:
                            self._idle = False
                        self._wakeup.clear()  # (no await since it returned: nothing can have been lost)
                    continue
                # NOTE: the wake-up is cleared only right before something looks (this step: the waiting
                # grammars and KV tier lookups; the next apply_commands: the queue) or right after the
                # wait returns, never on the way to sleep: a wake-up during the step (a lookup landing
                # after the step looked) stays set, so the idle wait returns at once. (Cleared before
                # the wait, such a lookup was lost and its request never ran.)
                self._wakeup.clear()
                steps_before = self.engine.num_steps
                self._step_future = loop.run_in_executor(self.executor, self._step)
                # NOTE: shielded, so cancelling this task never abandons a step half-way: see below.
                outputs = await asyncio.shield(self._step_future)
                self._step_future = None
                self._last_step_end = time.monotonic()
                idle_steps = idle_steps + 1 if self.engine.num_steps == steps_before else 0
                self.requests.apply(OutputsReady(outputs, self.engine.num_steps))
        except asyncio.CancelledError:
            # The event loop is going away (or someone cancelled us): let the step in flight finish,
            # then end every live request with an abort so nothing waits forever and no KV leaks.
            if self._step_future is not None:
                try:
                    outputs = await self._step_future
                except BaseException as exc:  # noqa: BLE001 - the step failed after all
                    self.fail(exc)
                    raise asyncio.CancelledError from None
                self._step_future = None
                self.requests.apply(OutputsReady(outputs, self.engine.num_steps))
            self.apply_commands()
            self.abort_all()
            raise
        except BaseException as exc:  # noqa: BLE001 - a failed step (or a bug here) kills the engine
            self._step_future = None
            logger.exception("chatserve engine loop died")
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """A step raised: the `LLMEngine`'s state is unknown, so never touch it again; end everything."""
        self.dead = EngineDeadError(exc)
        self.requests.apply(EngineDied(exc))
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, CallInEngine) and not command.future.done():
                command.future.set_exception(EngineDeadError(exc))
        self.executor.shutdown(wait=False)
