"""Runs: generations that go on independent of the HTTP connection that started them.

A run drives one producer of events (a Chat Completions stream asked to be resumable, a
background response) in a task of its own and appends every event to the `EventLog`; readers
(the connection that started it, a reconnect with a cursor, a reader on another replica) follow
the log. What a lost connection means is the request's `DisconnectPolicy`:

- `abort` (the default of Chat Completions, as before): when the last reader leaves, and nobody
  reads from another replica, the run is aborted (`on_abort("client_disconnect")`) and the engine
  frees its KV blocks. A run nobody ever attached to is aborted after ATTACH_GRACE_S.
- `detach` with a lease of N seconds: the run continues without readers; if no reader is attached
  anywhere for N seconds in a row it is aborted with reason `lease_expired`, freeing its blocks.

Readers in this process are counted here; readers elsewhere are seen through the log's reader
heartbeat (`EventLog.has_readers`).

Two logs when the shared one is Redis: every event goes first to an in-process mirror (a
MemoryEventLog), which this process's readers follow, and a writer task copies the events to the
shared log in batches (one pipelined round trip per batch, however many events piled up while the
last one was in flight). So the connection that started a run reads it at memory speed, Redis
latency never slows the generation, and readers on other replicas read Redis. If the shared log
fails (Redis went away), the run completes in memory: readers here go on, the server logs it, the
incomplete shared log is deleted (best effort) and the mirror is kept for the log's TTL so resumes
on this replica still work; resumes elsewhere fail (503 while Redis is down, then 404). Once the
shared log is ended, the mirror goes after MIRROR_LINGER_S.

    NOTE: who owns what. The run's task owns the producer (it alone iterates it and closes it);
    the watchdog only ever *asks* the producer to stop, through `on_abort`, which must make the
    producer end soon (a `Generation.close`: the engine then delivers finish_reason "abort" and
    the stream writes its last events). Should the producer not end within ABORT_DEADLINE_S of
    that ask, the task is cancelled. The writer task alone writes the shared log (one writer per key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from chatserve.server.errors import bad_request
from chatserve.server.settings import ServerSettings
from chatserve.server.streams.event_log import EventLog, EventLogError, LogInfo, MemoryEventLog

logger = logging.getLogger(__name__)

ATTACH_GRACE_S = 5.0  # abort policy: how long a run waits for its first reader
ABORT_DEADLINE_S = 10.0  # after on_abort, how long the producer may take to end before its task is cancelled
MIRROR_LINGER_S = 30.0  # how long a run's in-process mirror outlives the end of its shared log
_MAX_TICK_S = 0.25
_KEEP_ENDED = 1024  # ended runs whose final state get() still reports


@dataclass(frozen=True)
class DisconnectPolicy:
    """What a lost connection means for a run: `abort` it, or let it go on for `lease_s` without readers."""

    mode: Literal["abort", "detach"] = "abort"
    lease_s: float = 0.0

    @classmethod
    def detach(cls, lease_s: float) -> DisconnectPolicy:
        return cls("detach", float(lease_s))

    @classmethod
    def parse(cls, value: Any, *, param: str, settings: ServerSettings,
              default: DisconnectPolicy | None = None) -> DisconnectPolicy:
        """A request's field: None (the default), "abort", "detach" (the server's lease), or
        {"mode": "detach", "lease_seconds": N}. Anything else is a 400 naming `param`."""
        if value is None:
            return default or cls()
        if value == "abort":
            return cls()
        if value == "detach":
            return cls.detach(settings.detach_lease_s)
        if isinstance(value, dict):
            unknown = set(value) - {"mode", "lease_seconds"}
            if unknown:
                raise bad_request(f"unknown field(s) {sorted(unknown)} in {param}; it takes mode and lease_seconds",
                                  param=param)
            mode = value.get("mode", "detach")
            if mode == "abort":
                if "lease_seconds" in value:
                    raise bad_request(f"{param}.lease_seconds only applies to mode 'detach'",
                                      param=f"{param}.lease_seconds")
                return cls()
            if mode != "detach":
                raise bad_request(f"{param}.mode must be 'abort' or 'detach', got {mode!r}", param=f"{param}.mode")
            lease = value.get("lease_seconds", settings.detach_lease_s)
            if isinstance(lease, bool) or not isinstance(lease, (int, float)) \
                    or not 0 < lease <= settings.max_detach_lease_s:
                raise bad_request(f"{param}.lease_seconds must be a number in (0, {settings.max_detach_lease_s:g}], "
                                  f"got {lease!r}", param=f"{param}.lease_seconds")
            return cls.detach(lease)
        raise bad_request(f"{param} must be 'abort', 'detach' or {{\"mode\": \"detach\", \"lease_seconds\": N}}, "
                          f"got {value!r}", param=param)


def _ignore(reason: str) -> None:
    return None


class Run:
    """One run's state, as the process driving it sees it."""

    def __init__(self, run_id: str, policy: DisconnectPolicy, on_abort: Callable[[str], object]) -> None:
        self.run_id = run_id
        self.policy = policy
        self.status: str = "running"  # running | completed | aborted | failed
        self.abort_reason: str | None = None
        self.done = asyncio.Event()  # the producer ended and the log was ended
        self.num_events = 0
        self._on_abort = on_abort
        self._local_readers = 0
        self._ever_attached = False
        self._readers_changed = asyncio.Event()
        self._logged = asyncio.Event()  # the first event is in the log (or the run is done): readers may follow
        self.shared_failed = False  # the shared log (Redis) failed: the run completes in memory
        self._pending: list[dict[str, Any]] = []  # events for the shared log's writer
        self._wake = asyncio.Event()
        self._final: str | None = None  # the end status, once the producer ended
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def abort(self, reason: str) -> bool:
        """Ask the producer to stop (once); False if the run already ended or was asked."""
        if not self.running or self.abort_reason is not None:
            return False
        self.abort_reason = reason
        try:
            self._on_abort(reason)
        except Exception:  # noqa: BLE001 - the deadline below still ends the run
            logger.exception("run %s: on_abort(%s) failed", self.run_id, reason)
        task = self._task
        if task is not None:
            asyncio.get_running_loop().call_later(ABORT_DEADLINE_S, lambda: task.done() or task.cancel())
        return True

    def _reader_joined(self) -> None:
        self._local_readers += 1
        self._ever_attached = True
        self._readers_changed.set()

    def _reader_left(self) -> None:
        self._local_readers -= 1
        self._readers_changed.set()


class RunRegistry:
    """The runs this process drives, and readers' access to any run's events (through the log)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log  # the shared log (Redis, or the memory log without one)
        # this process's mirror of its own runs (the shared log itself when that is memory)
        self.local = log if isinstance(log, MemoryEventLog) else MemoryEventLog(max_events=log.max_events,
                                                                               ttl_s=log.ttl_s)
        self._runs: OrderedDict[str, Run] = OrderedDict()

    def start(self, run_id: str, events: AsyncIterator[dict[str, Any]], *, policy: DisconnectPolicy,
              on_abort: Callable[[str], object]) -> Run:
        """Drive `events` into the log under `run_id` until it ends; see the module docstring."""
        old = self._runs.get(run_id)
        if old is not None and old.running:
            raise ValueError(f"a run with id {run_id!r} is already running")
        run = Run(run_id, policy, on_abort)
        self._runs[run_id] = run
        self._runs.move_to_end(run_id)
        while len(self._runs) > _KEEP_ENDED:
            oldest = next(iter(self._runs.values()))
            if oldest.running:
                break
            self._runs.popitem(last=False)
        loop = asyncio.get_running_loop()
        if self.local is not self.log:
            run._writer = loop.create_task(self._write(run))
        run._task = loop.create_task(self._drive(run, events))
        run._watcher = loop.create_task(self._watch(run))
        return run

    async def info(self, run_id: str) -> LogInfo | None:
        """Where a run's log stands: this process's mirror if it has the run, else the shared log
        (raises EventLogUnavailable when that is Redis and Redis is down)."""
        if self.local is not self.log:
            info = await self.local.info(run_id)
            if info is not None:
                return info
        return await self.log.info(run_id)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def abort(self, run_id: str, reason: str) -> bool:
        run = self._runs.get(run_id)
        return run is not None and run.abort(reason)

    @property
    def running(self) -> list[Run]:
        return [r for r in self._runs.values() if r.running]

    async def attach(self, run_id: str, after: int = -1) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(seq, event) after the cursor, then live ones until the run ends; a run this process drives
        counts the reader while it iterates, a run elsewhere sees it through the log's heartbeat."""
        run = self._runs.get(run_id)
        local = run is not None and run.running
        if run is not None and local:
            run._reader_joined()
        try:
            if run is not None and local:
                await run._logged.wait()
            source = self.local if await self.local.exists(run_id) else self.log
            async for item in source.follow(run_id, after, heartbeat=not local):
                yield item
        finally:
            if run is not None and local:
                run._reader_left()

    async def shutdown(self, timeout_s: float = ABORT_DEADLINE_S) -> None:
        """Abort every running run (reason "engine") and wait for their logs to be ended."""
        runs = self.running
        for run in runs:
            run.abort("engine")
        if runs:
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in runs], timeout=timeout_s)

    # --- the run's two tasks --------------------------------------------------------------

    async def _drive(self, run: Run, events: AsyncIterator[dict[str, Any]]) -> None:
        status = "completed"
        try:
            await self.local.delete(run.run_id)  # a finished run's log under a reused id is replaced
            async for event in events:
                await self.local.append(run.run_id, event)  # memory: no I/O, cannot fail for a live run
                run.num_events += 1
                run._logged.set()
                if run._writer is not None and not run.shared_failed:
                    run._pending.append(event)
                    run._wake.set()
        except asyncio.CancelledError:
            status = "aborted"
            logger.warning("run %s: its producer did not end within %.0fs of abort; cancelled", run.run_id,
                           ABORT_DEADLINE_S)
        except Exception:
            status = "failed"
            logger.exception("run %s: its producer failed", run.run_id)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
            if status == "completed" and run.abort_reason is not None:
                status = "aborted"
            with contextlib.suppress(EventLogError):
                await self.local.end(run.run_id, status)
            run._final = status
            run._logged.set()
            if run._writer is not None:
                run._wake.set()
                with contextlib.suppress(BaseException):
                    await run._writer  # the shared log ended too (or failed) before the run counts as done
            run.status = status
            run._on_abort = _ignore  # an ended run kept for get() holds no Generation
            run.done.set()
            run._readers_changed.set()

    async def _write(self, run: Run) -> None:
        """Copy the run's events to the shared log in batches, then end it (see the module docstring)."""
        key = run.run_id
        try:
            await self.log.delete(key)
        except EventLogError as exc:
            self._shared_failed(run, exc)
        while True:
            await run._wake.wait()
            run._wake.clear()
            batch, run._pending = run._pending, []
            if batch and not run.shared_failed:
                try:
                    await self.log.append_many(key, batch)
                except EventLogError as exc:
                    self._shared_failed(run, exc)
            if run._final is not None and not run._pending:
                break
        if run.shared_failed:
            with contextlib.suppress(EventLogError):
                await self.log.delete(key)  # incomplete: readers elsewhere get a clean 404, not a gap
            return
        try:
            await self.log.end(key, run._final)
        except EventLogError as exc:
            logger.warning("run %s: could not end its shared event log (%s); readers elsewhere stop when it "
                           "expires", key, exc)
            return
        loop = asyncio.get_running_loop()
        loop.call_later(MIRROR_LINGER_S, lambda: self._drop_mirror(run))

    def _drop_mirror(self, run: Run) -> None:
        current = self._runs.get(run.run_id)
        if current is not None and current is not run and current.running:
            return  # the id was reused: the mirror is the new run's
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self.local.delete(run.run_id))

    def _shared_failed(self, run: Run, exc: EventLogError) -> None:
        run.shared_failed = True
        run._pending = []
        logger.warning("run %s: its shared event log failed after %d events (%s); the run completes in this "
                       "process's memory: readers here go on, resumes on other replicas fail until it is back",
                       run.run_id, run.num_events, exc)

    async def _watch(self, run: Run) -> None:
        """The disconnect policy: abort the run once nobody has read it for the policy's lease."""
        last_seen = time.monotonic()
        lease = run.policy.lease_s if run.policy.mode == "detach" else 0.0
        # a reader leaving wakes the watchdog at once; the tick only paces the checks for readers elsewhere
        tick = min(1.0, max(lease / 8, 0.05)) if run.policy.mode == "detach" else _MAX_TICK_S
        while run.running and run.abort_reason is None:
            run._readers_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run._readers_changed.wait(), tick)
            if not run.running or run.abort_reason is not None:
                return
            now = time.monotonic()
            if run._local_readers > 0:
                last_seen = now
                continue
            try:
                remote = await self.log.has_readers(run.run_id)
            except EventLogError:
                remote = False
            if remote:
                last_seen = now
                continue
            if run.policy.mode == "detach":
                if now - last_seen >= lease:
                    logger.info("run %s: no reader for %.1fs (its lease); aborting", run.run_id, lease)
                    run.abort("lease_expired")
            elif run._ever_attached or now - last_seen >= ATTACH_GRACE_S:
                run.abort("client_disconnect")
