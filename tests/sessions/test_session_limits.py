"""The session stores' limits (count, bytes, TTL) on memory and on a real Redis, and their HTTP answers:
429 `session_limit_reached` past the count, 507 `session_storage_full` past the bytes, 400 past the
longest TTL, each in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis

from chatserve.sessions import (
    InMemorySessionStore,
    Message,
    RedisSessionStore,
    SessionLimitExceeded,
    SessionLimits,
    SessionStore,
    SessionValidationError,
)
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import redis_for_tests

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    yield from redis_for_tests()


@pytest.fixture
def prefix() -> str:
    return f"chatserve-test-{uuid.uuid4().hex}:"


def _sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Any]:
    """store(limits) -> a store of the parametrized kind (Redis: all on one prefix, like replicas)."""
    made: list[SessionStore] = []

    def make(limits: SessionLimits | None = None) -> SessionStore:
        if request.param == "memory":
            store: SessionStore = InMemorySessionStore(limits=limits)
        else:
            store = RedisSessionStore(request.getfixturevalue("redis_url"), prefix=prefix, limits=limits)
        made.append(store)
        return store

    yield make
    for store in made:
        await check_bytes(store)
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        with _sync_client(url) as client:
            left = list(client.scan_iter(match=f"{prefix}*"))
            if left:
                client.delete(*left)
    for store in made:
        await store.close()


async def held_bytes(store: SessionStore) -> int:
    if isinstance(store, InMemorySessionStore):
        return store.total_bytes
    assert isinstance(store, RedisSessionStore)
    return await store.total_bytes()


async def live_count(store: SessionStore) -> int:
    if isinstance(store, InMemorySessionStore):
        store._prune()
        return len(store._sessions)
    assert isinstance(store, RedisSessionStore)
    return await store.count()


async def check_bytes(store: SessionStore) -> None:
    """The running byte count equals the bytes actually stored, counted from scratch."""
    if isinstance(store, InMemorySessionStore):
        store.check_integrity()
        return
    assert isinstance(store, RedisSessionStore)
    total = await store.total_bytes()
    actual = 0
    client = store.client
    for sid in await client.zrange(f"{store.prefix}sessions", 0, -1):
        k = store.keys(sid.decode())
        record = await client.hgetall(k.session)
        if not record:
            continue
        actual += sum(len(v) for v in record.values())
        actual += sum(len(m) for m in await client.lrange(k.messages, 0, -1))
        actual += await client.strlen(k.tokens)
    assert total == actual, (total, actual)


async def a_turn(store: SessionStore, sid: str, text: str = "hello", tokens: int = 8) -> None:
    token = await store.acquire_turn_lock(sid)
    try:
        session = await store.get(sid)
        assert session is not None
        history = await store.get_history_tokens(sid)
        await store.append_turn(sid, Message("user", text), Message("assistant", text[::-1], "stop"),
                                history + list(range(tokens)), expected_num_turns=session.num_turns)
    finally:
        await store.release_turn_lock(sid, token)


async def test_the_count_limit(make_store) -> None:
    store = make_store(SessionLimits(max_count=3))
    sessions = [await store.create() for _ in range(3)]
    with pytest.raises(SessionLimitExceeded) as info:
        await store.create()
    assert info.value.kind == "count" and "3" in str(info.value)
    with pytest.raises(SessionLimitExceeded):
        await store.fork(sessions[0].id, 0)
    assert await live_count(store) == 3
    assert await store.delete(sessions[1].id)
    forked = await store.fork(sessions[0].id, 0)
    with pytest.raises(SessionLimitExceeded):
        await store.create()
    assert await store.delete(forked.id)
    await store.create()
    # turns on existing sessions are not limited by the count
    await a_turn(store, sessions[0].id)


async def test_expired_sessions_stop_counting(make_store) -> None:
    store = make_store(SessionLimits(max_count=2))
    short = [await store.create(ttl_seconds=0.05) for _ in range(2)]
    with pytest.raises(SessionLimitExceeded):
        await store.create()
    while any([await store.get(s.id) is not None for s in short]):  # bounded by the test timeout
        await asyncio.sleep(0.02)
    await store.create()
    await store.create()
    with pytest.raises(SessionLimitExceeded):
        await store.create()


async def test_the_count_holds_across_replicas_creating_at_once(make_store, request) -> None:
    """Replicas sharing one Redis (or one process's callers) cannot pass the limit together."""
    stores = [make_store(SessionLimits(max_count=5)) for _ in range(3 if "redis" in request.node.name else 1)]
    results = await asyncio.gather(*(stores[i % len(stores)].create() for i in range(12)), return_exceptions=True)
    made = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, SessionLimitExceeded)]
    assert len(made) == 5 and len(refused) == 7, results
    assert await live_count(stores[0]) == 5


async def test_the_byte_limit(make_store) -> None:
    probe = make_store()
    one = await probe.create(metadata={"pad": "x" * 100})
    empty_size = await held_bytes(probe)
    assert empty_size > 100
    await probe.delete(one.id)
    assert await held_bytes(probe) == 0

    limit = 3 * empty_size + 800
    store = make_store(SessionLimits(max_bytes=limit))
    sid = (await store.create(metadata={"pad": "x" * 100})).id
    await store.create(metadata={"pad": "x" * 100})
    await check_bytes(store)
    with pytest.raises(SessionLimitExceeded) as info:
        await store.create(metadata={"pad": "x" * 2000})  # would pass the limit
    assert info.value.kind == "bytes"
    await a_turn(store, sid, "a" * 20)  # under the limit: a turn starts, and is stored whole
    await check_bytes(store)
    await a_turn(store, sid, "b" * 1000, tokens=100)  # this one takes the store past the limit
    assert await held_bytes(store) >= limit
    with pytest.raises(SessionLimitExceeded) as info:
        await store.acquire_turn_lock(sid)  # no new turn while full
    assert info.value.kind == "bytes"
    with pytest.raises(SessionLimitExceeded):
        await store.create()
    with pytest.raises(SessionLimitExceeded):
        await store.fork(sid, 2)
    await check_bytes(store)
    assert await store.delete(sid)
    await store.create()  # room again
    await check_bytes(store)


async def test_bytes_are_counted_exactly_through_every_write(make_store) -> None:
    store = make_store(SessionLimits(max_bytes=10**9))
    s = await store.create(system_prompt="sys", metadata={"k": "v"})
    await a_turn(store, s.id, "first")
    await a_turn(store, s.id, "second" * 20, tokens=40)
    await check_bytes(store)
    await store.update(s.id, title="A title", metadata={"k": "w" * 500}, defaults={"temperature": 0.5})
    await check_bytes(store)
    await store.touch(s.id)
    await check_bytes(store)
    token = await store.acquire_turn_lock(s.id)  # regenerate: the last turn is replaced
    await store.append_turn(s.id, Message("user", "second"), Message("assistant", "shorter", "stop"), [1, 2, 3],
                            replace_last_turn=True)
    await store.release_turn_lock(s.id, token)
    await check_bytes(store)
    fork = await store.fork(s.id, 2, title="branch")
    await check_bytes(store)
    before = await held_bytes(store)
    assert await store.delete(fork.id)
    assert await held_bytes(store) < before
    assert await store.delete(s.id)
    assert await held_bytes(store) == 0


async def test_the_longest_ttl(make_store) -> None:
    store = make_store(SessionLimits(max_ttl_seconds=100))
    assert (await store.create()).ttl_seconds == 100  # the default (24 h) is capped
    assert (await store.create(ttl_seconds=100)).ttl_seconds == 100
    with pytest.raises(SessionValidationError, match="at most 100"):
        await store.create(ttl_seconds=101)
    with pytest.raises(SessionValidationError):
        await store.create(ttl_seconds=365 * 24 * 3600)


def test_limits_are_checked() -> None:
    for bad in ({"max_count": 0}, {"max_bytes": -1}, {"max_count": True}, {"max_ttl_seconds": 0}):
        with pytest.raises((ValueError, SessionValidationError)):
            SessionLimits(**bad)


async def test_redis_sessions_written_before_bytes_were_counted_join_the_count(redis_url, prefix) -> None:
    store = RedisSessionStore(redis_url, prefix=prefix)
    try:
        s = await store.create()
        await a_turn(store, s.id, "old")
        # as a store of the previous version left it: no per-session bytes, no total
        await store.client.delete(f"{prefix}sessions:bytes", f"{prefix}sessions:total_bytes")
        await a_turn(store, s.id, "new")
        await check_bytes(store)
        assert await store.delete(s.id)
        assert await store.total_bytes() == 0
    finally:
        with _sync_client(redis_url) as client:
            left = list(client.scan_iter(match=f"{prefix}*"))
            if left:
                client.delete(*left)
        await store.close()
    assert left == []


# ---- over HTTP -----------------------------------------------------------------------------------------
@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply="Hello there.")


async def test_http_answers_of_the_limits(engine) -> None:
    store = InMemorySessionStore()
    async with app_client(engine, store, session_max_count=2, session_max_bytes=1500,
                          session_max_ttl_s=3600) as client:
        assert store.limits == SessionLimits(2, 1500, 3600)  # the server's settings reach the store
        first = (await client.post("/v1/sessions", json={})).json()
        assert first["ttl_seconds"] == 3600
        err = assert_error(await client.post("/v1/sessions", json={"ttl_seconds": 3601}), 400)
        assert "ttl_seconds" in err["message"] and "3600" in err["message"]
        second = await client.post("/v1/sessions", json={})
        assert second.status_code == 201
        err = assert_error(await client.post("/v1/sessions", json={}), 429, code="session_limit_reached")
        assert "--session-max-count" in err["message"]
        assert_error(await client.post(f"/v1/sessions/{first['id']}/fork", json={"keep_turns": 0}), 429,
                     code="session_limit_reached")
        assert (await client.delete(f"/v1/sessions/{second.json()['id']}")).status_code == 200
        # bytes: a turn that fills the store is stored; the next one is refused before it starts
        resp = await client.post(f"/v1/sessions/{first['id']}/messages", json={"content": "word " * 150, "stream": False})
        assert resp.status_code == 200, resp.text
        assert store.total_bytes >= 1500
        started = len(engine.requests)
        resp = await client.post(f"/v1/sessions/{first['id']}/messages", json={"content": "more", "stream": False})
        err = assert_error(resp, 507, code="session_storage_full")
        assert err["type"] == "insufficient_storage_error" and "--session-max-bytes" in err["message"]
        assert len(engine.requests) == started  # refused before the engine saw it
        resp = await client.post(f"/v1/sessions/{first['id']}/messages", json={"content": "more"})  # streamed too
        assert_error(resp, 507)
        assert_error(await client.post("/v1/sessions", json={}), 507, code="session_storage_full")
        assert (await client.delete(f"/v1/sessions/{first['id']}")).status_code == 200
        assert (await client.post("/v1/sessions", json={})).status_code == 201
        store.check_integrity()
