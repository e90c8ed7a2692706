"""The run registry and the disconnect policy, with scripted producers over the memory log.

A producer here is an async generator that yields events until told to stop (`on_abort` sets a
flag and it yields one last event, as a Generation does with its finish_reason "abort" chunk).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from chatserve.server.errors import APIError
from chatserve.server.settings import ServerSettings
from chatserve.server.streams.event_log import EventLog, EventLogUnavailable, MemoryEventLog
from chatserve.server.streams.runs import DisconnectPolicy, RunRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Producer:
    """Yields {"i": n} every `every_s` (forever, or `count` times) until aborted; then one last {"abort": reason}."""

    def __init__(self, count: int | None = None, every_s: float = 0.01) -> None:
        self.count, self.every_s = count, every_s
        self.aborted: list[str] = []
        self._stop = asyncio.Event()

    def on_abort(self, reason: str) -> None:
        self.aborted.append(reason)
        self._stop.set()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        i = 0
        while self.count is None or i < self.count:
            if self._stop.is_set():
                yield {"abort": self.aborted[0]}
                return
            yield {"i": i}
            i += 1
            await asyncio.sleep(self.every_s)


async def _read(registry: RunRegistry, run_id: str, after: int = -1, limit: int | None = None) -> list[tuple[int, dict]]:
    out = []
    async for item in registry.attach(run_id, after):
        out.append(item)
        if limit is not None and len(out) >= limit:
            break
    return out


async def _until(cond: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_policy_parse() -> None:
    s = ServerSettings(detach_lease_s=30, max_detach_lease_s=100)
    assert DisconnectPolicy.parse(None, param="p", settings=s) == DisconnectPolicy()
    assert DisconnectPolicy.parse(None, param="p", settings=s, default=DisconnectPolicy.detach(5)).lease_s == 5
    assert DisconnectPolicy.parse("abort", param="p", settings=s).mode == "abort"
    assert DisconnectPolicy.parse("detach", param="p", settings=s) == DisconnectPolicy("detach", 30.0)
    assert DisconnectPolicy.parse({"mode": "detach", "lease_seconds": 2.5}, param="p", settings=s).lease_s == 2.5
    assert DisconnectPolicy.parse({"lease_seconds": 7}, param="p", settings=s) == DisconnectPolicy("detach", 7.0)
    assert DisconnectPolicy.parse({"mode": "abort"}, param="p", settings=s).mode == "abort"
    for bad, param in [("later", "p"), (3, "p"), ({"mode": "x"}, "p.mode"), ({"lease_seconds": 0}, "p.lease_seconds"),
                       ({"lease_seconds": 101}, "p.lease_seconds"), ({"lease_seconds": True}, "p.lease_seconds"),
                       ({"lease_seconds": "5"}, "p.lease_seconds"), ({"mode": "abort", "lease_seconds": 1},
                                                                     "p.lease_seconds"), ({"ttl": 1}, "p")]:
        with pytest.raises(APIError) as exc:
            DisconnectPolicy.parse(bad, param="p", settings=s)
        assert exc.value.status == 400 and exc.value.param == param, bad


async def test_a_run_logs_every_event_and_ends_completed() -> None:
    registry = RunRegistry(MemoryEventLog())
    p = Producer(count=5)
    run = registry.start("r1", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    assert await _read(registry, "r1") == [(i, {"i": i}) for i in range(5)]
    await asyncio.wait_for(run.done.wait(), 10)
    assert run.status == "completed" and run.abort_reason is None and p.aborted == []
    assert registry.get("r1") is run
    info = await registry.log.info("r1")
    assert info is not None and info.ended == "completed"
    # a reader after the end (any cursor) replays the rest
    assert [s for s, _ in await _read(registry, "r1", after=2)] == [3, 4]


async def test_duplicate_running_id_is_refused() -> None:
    registry = RunRegistry(MemoryEventLog())
    p = Producer()
    registry.start("dup", p.events(), policy=DisconnectPolicy.detach(5), on_abort=p.on_abort)
    with pytest.raises(ValueError, match="already running"):
        registry.start("dup", Producer().events(), policy=DisconnectPolicy(), on_abort=lambda r: None)
    await registry.shutdown()


async def test_abort_policy_aborts_when_the_last_reader_leaves() -> None:
    registry = RunRegistry(MemoryEventLog())
    p = Producer()
    run = registry.start("a", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    first = await _read(registry, "a", limit=3)
    assert [s for s, _ in first] == [0, 1, 2]
    await asyncio.wait_for(run.done.wait(), 10)
    assert p.aborted == ["client_disconnect"] and run.status == "aborted"
    events = await _read(registry, "a")
    assert events[-1][1] == {"abort": "client_disconnect"}  # the producer's last event is logged
    assert [s for s, _ in events] == list(range(len(events)))


async def test_abort_policy_keeps_going_while_another_reader_reads() -> None:
    registry = RunRegistry(MemoryEventLog())
    p = Producer(count=40)
    run = registry.start("two", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    stayer = asyncio.create_task(_read(registry, "two"))
    await _read(registry, "two", limit=2)  # one reader leaves early
    got = await asyncio.wait_for(stayer, 10)
    assert [s for s, _ in got] == list(range(40)) and p.aborted == [] and run.status == "completed"


async def test_detached_run_goes_on_without_readers_until_its_lease_expires() -> None:
    registry = RunRegistry(MemoryEventLog())
    p = Producer(every_s=0.02)
    run = registry.start("d", p.events(), policy=DisconnectPolicy.detach(0.6), on_abort=p.on_abort)
    first = await _read(registry, "d", limit=2)
    await asyncio.sleep(0.3)  # the reader is gone, the lease still runs
    assert run.running and p.aborted == []
    later = await _read(registry, "d", after=first[-1][0], limit=3)  # a reconnect renews the lease
    assert [s for s, _ in later] == [2, 3, 4]  # no gap, no duplicate across the reconnect
    await asyncio.wait_for(run.done.wait(), 10)
    assert p.aborted == ["lease_expired"] and run.status == "aborted" and run.abort_reason == "lease_expired"


async def test_a_reader_elsewhere_keeps_a_detached_run_alive() -> None:
    """A reader in another process shows only through the log's heartbeat (follow with heartbeat=True)."""
    log = MemoryEventLog()
    registry = RunRegistry(log)
    p = Producer(count=60, every_s=0.02)
    run = registry.start("far", p.events(), policy=DisconnectPolicy.detach(0.3), on_abort=p.on_abort)
    await _until(lambda: run.num_events > 0)
    remote = [item async for item in log.follow("far")]  # not through the registry: as another replica would
    await asyncio.wait_for(run.done.wait(), 10)
    assert [s for s, _ in remote] == list(range(60)) and run.status == "completed" and p.aborted == []


async def test_a_run_nobody_attaches_to_is_aborted_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("chatserve.server.streams.runs.ATTACH_GRACE_S", 0.2)
    registry = RunRegistry(MemoryEventLog())
    p = Producer()
    run = registry.start("orphan", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    await asyncio.wait_for(run.done.wait(), 10)
    assert p.aborted == ["client_disconnect"]


class SharedLog(EventLog):
    """A stand-in for the Redis log: another store (a memory log inside), slow, and failing on demand."""

    backend = "test"
    persistent = True

    def __init__(self, delay_s: float = 0.0, ok: int | None = None) -> None:
        super().__init__()
        self.inner = MemoryEventLog()
        self.delay_s, self.ok = delay_s, ok
        self.batches: list[int] = []

    def _check(self, n: int = 0) -> None:
        if self.ok is not None:
            if self.ok < n or self.ok <= 0:
                self.ok = 0
                raise EventLogUnavailable("event log unavailable: cannot reach Redis (test)")
            self.ok -= n

    async def append(self, key: str, event: dict[str, Any]) -> int:
        return (await self.append_many(key, [event]))[0]

    async def append_many(self, key: str, events: list[dict[str, Any]]) -> list[int]:
        await asyncio.sleep(self.delay_s)
        self._check(len(events))
        self.batches.append(len(events))
        return [await self.inner.append(key, e) for e in events]

    async def end(self, key: str, status: str = "completed") -> None:
        self._check()
        await self.inner.end(key, status)

    def follow(self, key: str, after: int = -1, *, heartbeat: bool = True) -> AsyncIterator[tuple[int, dict]]:
        self._check()
        return self.inner.follow(key, after, heartbeat=heartbeat)

    async def info(self, key: str) -> Any:
        self._check()
        return await self.inner.info(key)

    async def has_readers(self, key: str) -> bool:
        return await self.inner.has_readers(key)

    async def delete(self, key: str) -> bool:
        self._check()
        return await self.inner.delete(key)


async def test_with_a_shared_log_readers_here_read_the_mirror_and_writes_are_batched() -> None:
    shared = SharedLog(delay_s=0.05)
    registry = RunRegistry(shared)
    p = Producer(count=50, every_s=0.002)
    run = registry.start("m", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    got = await _read(registry, "m")
    assert [s for s, _ in got] == list(range(50))
    await asyncio.wait_for(run.done.wait(), 10)
    assert run.status == "completed"
    # the shared log has every event, in order, and its end; written in far fewer round trips than events
    assert [s for s, _ in [item async for item in shared.inner.follow("m")]] == list(range(50))
    info = await shared.info("m")
    assert info is not None and info.ended == "completed"
    assert sum(shared.batches) == 50 and len(shared.batches) < 25, shared.batches
    assert (await registry.info("m")) == info  # the mirror (still lingering) says the same


async def test_a_failing_shared_log_lets_the_run_complete_in_memory(caplog: pytest.LogCaptureFixture) -> None:
    shared = SharedLog(ok=3)
    registry = RunRegistry(shared)
    p = Producer(count=30)
    run = registry.start("f", p.events(), policy=DisconnectPolicy(), on_abort=p.on_abort)
    got = await _read(registry, "f")
    await asyncio.wait_for(run.done.wait(), 10)
    assert [s for s, _ in got] == list(range(30)) and run.status == "completed" and p.aborted == []
    assert run.shared_failed
    assert "its shared event log failed" in caplog.text and "completes in this process's memory" in caplog.text
    # this replica still resumes it from its mirror
    assert [s for s, _ in await _read(registry, "f", after=20)] == list(range(21, 30))


async def test_a_failing_producer_ends_the_log_failed() -> None:
    registry = RunRegistry(MemoryEventLog())

    async def broken() -> AsyncIterator[dict[str, Any]]:
        yield {"i": 0}
        raise RuntimeError("boom")

    run = registry.start("b", broken(), policy=DisconnectPolicy.detach(30), on_abort=lambda r: None)
    assert await _read(registry, "b") == [(0, {"i": 0})]
    await asyncio.wait_for(run.done.wait(), 10)
    assert run.status == "failed"
    info = await registry.log.info("b")
    assert info is not None and info.ended == "failed"


async def test_a_producer_that_ignores_abort_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("chatserve.server.streams.runs.ABORT_DEADLINE_S", 0.2)
    registry = RunRegistry(MemoryEventLog())
    closed = asyncio.Event()

    async def stubborn() -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                yield {"x": 1}
                await asyncio.sleep(0.05)
        finally:
            closed.set()

    run = registry.start("s", stubborn(), policy=DisconnectPolicy.detach(30), on_abort=lambda r: None)
    assert registry.abort("s", "cancel_endpoint")
    assert not registry.abort("s", "cancel_endpoint")  # asked once
    await asyncio.wait_for(run.done.wait(), 10)
    assert run.status == "aborted" and closed.is_set()


async def test_shutdown_aborts_running_runs_and_ends_their_logs() -> None:
    registry = RunRegistry(MemoryEventLog())
    producers = [Producer() for _ in range(3)]
    runs = [registry.start(f"s{i}", p.events(), policy=DisconnectPolicy.detach(30), on_abort=p.on_abort)
            for i, p in enumerate(producers)]
    await _until(lambda: all(r.num_events for r in runs))
    await registry.shutdown()
    assert all(not r.running and r.abort_reason == "engine" for r in runs)
    assert all(p.aborted == ["engine"] for p in producers)
    assert registry.running == []
    for r in runs:
        info = await registry.log.info(r.run_id)
        assert info is not None and info.ended == "aborted"
