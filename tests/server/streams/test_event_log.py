"""Contract tests of the event logs: one suite, run against Redis Streams and against memory.

The Redis log runs on a RedisSessionStore's client (as the server builds it), against the Redis
on 127.0.0.1:6379 (or $CHATSERVE_TEST_REDIS_URL, else a redis-server of our own); every test uses
its own key prefix and checks that nothing is left under it. The outage test kills a
redis-server of its own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from chatserve.server.streams.event_log import (
    CursorExpired,
    EventLog,
    EventLogNotFound,
    EventLogUnavailable,
    MemoryEventLog,
    RedisEventLog,
    make_event_log,
)
from chatserve.sessions import InMemorySessionStore, RedisSessionStore
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess, redis_for_tests

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis to test against: the running one if it answers, else one of our own."""
    yield from redis_for_tests()


def _keys_under(url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(url) as client:
        return sorted(client.scan_iter(match=f"{prefix}*", count=1000))


def _drop_keys(url: str, prefix: str) -> None:
    with redis.Redis.from_url(url) as client:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)


@pytest.fixture(params=["memory", "redis"])
async def make_log(request: pytest.FixtureRequest) -> AsyncIterator:
    """A factory of logs of one backend (several over one store = several processes over one Redis)."""
    stores: list[RedisSessionStore] = []
    prefix = f"chatserve-test-{uuid.uuid4().hex[:8]}:"
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    memory: dict[tuple[int, float], MemoryEventLog] = {}

    def make(max_events: int = 100, ttl_s: float = 60.0) -> EventLog:
        if url is None:  # one process: "another replica" is the same log
            return memory.setdefault((max_events, ttl_s), MemoryEventLog(max_events=max_events, ttl_s=ttl_s))
        store = RedisSessionStore(url, prefix=prefix)
        stores.append(store)
        return make_event_log(store, max_events=max_events, ttl_s=ttl_s)

    yield make
    for s in stores:
        await s.close()
    if url is not None:
        _drop_keys(url, prefix)


async def _collect(it: AsyncIterator[tuple[int, dict]], limit: int = 10_000) -> list[tuple[int, dict]]:
    out = []
    async for item in it:
        out.append(item)
        assert len(out) <= limit
    return out


async def test_make_event_log_follows_the_session_store() -> None:
    assert isinstance(make_event_log(InMemorySessionStore()), MemoryEventLog)
    assert isinstance(make_event_log(None), MemoryEventLog)
    store = RedisSessionStore("redis://127.0.0.1:1/0", prefix="x:")
    log = make_event_log(store)
    assert isinstance(log, RedisEventLog) and log.prefix == "x:" and log.persistent
    await store.close()


async def test_append_numbers_from_zero_and_replays_in_order(make_log) -> None:
    log = make_log()
    seqs = [await log.append("run1", {"i": i, "text": "héllo"}) for i in range(5)]
    assert seqs == [0, 1, 2, 3, 4]
    await log.end("run1")
    assert await _collect(log.follow("run1")) == [(i, {"i": i, "text": "héllo"}) for i in range(5)]
    assert await _collect(log.follow("run1", after=2)) == [(3, {"i": 3, "text": "héllo"}), (4, {"i": 4, "text": "héllo"})]
    assert await _collect(log.follow("run1", after=4)) == []
    info = await log.info("run1")
    assert info is not None and info.next_seq == 5 and info.first_seq == 0 and info.ended == "completed"


async def test_follow_replays_then_follows_live_events_from_another_process(make_log) -> None:
    writer, reader = make_log(), make_log()  # two logs over one store: two replicas over one Redis
    await writer.append("live", {"i": 0})
    got: list[tuple[int, dict]] = []
    seen_first = asyncio.Event()

    async def read() -> None:
        async for item in reader.follow("live", after=-1):
            got.append(item)
            seen_first.set()

    task = asyncio.create_task(read())
    await asyncio.wait_for(seen_first.wait(), 10)
    assert await reader.has_readers("live") and await writer.has_readers("live")
    for i in range(1, 20):
        await writer.append("live", {"i": i})
        if i % 5 == 0:
            await asyncio.sleep(0.01)
    info = await writer.info("live")
    assert info is not None and info.ended is None and info.next_seq == 20
    await writer.end("live", "failed")
    await asyncio.wait_for(task, 10)
    assert got == [(i, {"i": i}) for i in range(20)]  # in order, no gap, no duplicate
    info = await reader.info("live")
    assert info is not None and info.ended == "failed"


async def test_many_followers_each_get_every_event_once(make_log) -> None:
    log = make_log()
    await log.append("fan", {"i": 0})
    tasks = [asyncio.create_task(_collect(log.follow("fan", after=a))) for a in (-1, 0, -1)]
    await asyncio.sleep(0)
    for i in range(1, 30):
        await log.append("fan", {"i": i})
    await log.end("fan")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [s for s, _ in results[0]] == list(range(30))
    assert [s for s, _ in results[1]] == list(range(1, 30))
    assert results[2] == results[0]


async def test_length_is_bounded_and_an_old_cursor_is_refused(make_log) -> None:
    log = make_log(max_events=4)
    for i in range(10):
        await log.append("b", {"i": i})
    info = await log.info("b")
    assert info is not None and info.next_seq == 10 and info.first_seq == 6
    await log.end("b")
    info = await log.info("b")
    assert info is not None and info.first_seq == 6 and info.ended == "completed"
    with pytest.raises(CursorExpired) as exc:
        await _collect(log.follow("b", after=-1))
    assert exc.value.first == 6
    assert [s for s, _ in await _collect(log.follow("b", after=5))] == [6, 7, 8, 9]


async def test_missing_log_is_not_found(make_log) -> None:
    log = make_log()
    assert await log.info("nope") is None and not await log.exists("nope")
    with pytest.raises(EventLogNotFound):
        await _collect(log.follow("nope"))
    assert not await log.has_readers("nope")
    assert not await log.delete("nope")


async def test_logs_expire_after_their_last_write(make_log) -> None:
    log = make_log(ttl_s=0.3)
    await log.append("exp", {"i": 0})
    await log.end("exp")
    assert await log.exists("exp")
    for _ in range(100):  # bounded: expiry is at most ttl plus Redis' expiry cycle
        if not await log.exists("exp"):
            break
        await asyncio.sleep(0.05)
    assert not await log.exists("exp")


async def test_a_follower_ends_when_the_log_expires_under_it(make_log) -> None:
    log = make_log(ttl_s=0.5)
    await log.append("gone", {"i": 0})  # a writer that dies: never ended
    with pytest.raises(EventLogNotFound):
        await asyncio.wait_for(_collect(log.follow("gone")), 20)


async def test_delete_removes_the_log(make_log) -> None:
    log = make_log()
    await log.append("d", {"i": 0})
    assert await log.delete("d")
    assert not await log.exists("d")


async def test_redis_keys_are_namespaced_and_expire(redis_url: str) -> None:
    prefix = f"chatserve-test-{uuid.uuid4().hex[:8]}:"
    store = RedisSessionStore(redis_url, prefix=prefix)
    log = make_event_log(store, max_events=10, ttl_s=30)
    try:
        await log.append("k", {"a": 1})
        await _collect_one(log)
        keys = _keys_under(redis_url, prefix)
        assert keys == [f"{prefix}events:k".encode(), f"{prefix}events:k:readers".encode()]
        with redis.Redis.from_url(redis_url) as client:
            assert 0 < client.ttl(f"{prefix}events:k") <= 30
            assert 0 < client.pttl(f"{prefix}events:k:readers") <= 3000
    finally:
        await log.delete("k")
        assert _keys_under(redis_url, prefix) == []
        await store.close()


async def _collect_one(log: EventLog) -> None:
    async for _ in log.follow("k"):
        break


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
async def test_redis_outage_is_unavailable_and_heals() -> None:
    server = RedisProcess()
    server.start()
    store = RedisSessionStore(server.url, prefix="t:")
    log = make_event_log(store)
    try:
        await log.append("o", {"i": 0})
        server.kill()
        with pytest.raises(EventLogUnavailable, match="event log unavailable"):
            await log.append("o", {"i": 1})
        with pytest.raises(EventLogUnavailable):
            await _collect(log.follow("o"))
        server.start()
        assert await log.info("o") is None  # a Redis without persistence came back empty
        assert await log.append("new", {"i": 0}) == 0
    finally:
        server.kill()
        await store.close()
