"""The ResponseStore contract, the same tests over the in-memory store and the Redis store.

Redis: the one on 127.0.0.1:6379 under a key prefix of the test's own (every key is checked gone
afterwards), and a redis-server of the test's own for the outage.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from chatserve.sessions import RedisSessionStore
from chatserve.sessions.factory import make_response_store
from chatserve.sessions.memory_response_store import InMemoryResponseStore
from chatserve.sessions.redis_response_store import RedisResponseStore
from chatserve.sessions.response_store import (
    ResponseStore,
    ResponseStoreUnavailable,
    is_valid_response_id,
    new_response_id,
)
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess, redis_answers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _keys(prefix: str) -> list[bytes]:
    with redis.Redis.from_url(URL) as client:
        return sorted(client.scan_iter(match=f"{prefix}*", count=1000))


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield InMemoryResponseStore(ttl_seconds=60)
        return
    if not redis_answers(URL):
        pytest.skip(f"no Redis at {URL}")
    prefix = f"chatserve-test-{uuid.uuid4().hex}:"
    sessions = RedisSessionStore(URL, prefix=prefix)
    try:
        yield RedisResponseStore.beside(sessions, ttl_seconds=60)
    finally:
        await sessions.close()
        left = _keys(prefix)
        if left:
            with redis.Redis.from_url(URL) as client:
                client.delete(*left)
        assert left == [], "keys left behind"


def _response(rid: str, status: str = "in_progress") -> dict:
    return {"id": rid, "object": "response", "status": status, "output": [], "note": "ünïcødé 🙂"}


async def test_put_get_update_delete(store: ResponseStore) -> None:
    rid = new_response_id()
    assert is_valid_response_id(rid)
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    await store.put(_response(rid), items, [])
    assert (await store.get(rid))["status"] == "in_progress"
    assert await store.get_input_items(rid) == items
    assert await store.get_token_ids(rid) == []
    await store.put(_response(rid, "completed"), None, [1, 2, 3, 2**32 - 1])  # items kept, tokens set
    assert (await store.get(rid))["status"] == "completed"
    assert await store.get_input_items(rid) == items
    assert await store.get_token_ids(rid) == [1, 2, 3, 2**32 - 1]
    await store.put(_response(rid, "completed"))  # a status write keeps both
    assert await store.get_token_ids(rid) == [1, 2, 3, 2**32 - 1]
    returned = await store.get(rid)
    returned["status"] = "changed"  # a returned dict is a copy
    assert (await store.get(rid))["status"] == "completed"
    assert await store.delete(rid) is True
    assert await store.delete(rid) is False
    assert await store.get(rid) is None and await store.get_input_items(rid) is None
    assert await store.get_token_ids(rid) is None


async def test_unknown_and_malformed_ids_are_not_found(store: ResponseStore) -> None:
    for rid in (new_response_id(), "resp_x", "", "../../etc", "resp_" + "G" * 32):
        assert await store.get(rid) is None
        assert await store.get_input_items(rid) is None
        assert await store.get_token_ids(rid) is None
        assert await store.delete(rid) is False


async def test_every_key_expires_with_the_ttl(store: ResponseStore) -> None:
    store.ttl_seconds = 0.2
    rid = new_response_id()
    await store.put(_response(rid), [{"id": "m"}], [5, 6])
    assert await store.get(rid) is not None
    for _ in range(100):
        await asyncio.sleep(0.05)
        if await store.get(rid) is None:
            break
    assert await store.get(rid) is None and await store.get_token_ids(rid) is None
    assert await store.get_input_items(rid) is None


async def test_memory_store_is_bounded() -> None:
    store = InMemoryResponseStore(max_responses=3)
    ids = [new_response_id() for _ in range(5)]
    for rid in ids:
        await store.put(_response(rid))
    assert [await store.get(rid) is not None for rid in ids] == [False, False, True, True, True]


async def test_factory_puts_responses_beside_the_sessions() -> None:
    sessions = RedisSessionStore(URL, prefix="chatserve-test-factory:")
    try:
        store = make_response_store(sessions, ttl_seconds=5, max_in_memory=10)
        assert isinstance(store, RedisResponseStore) and store.prefix == sessions.prefix
        assert isinstance(make_response_store(None, ttl_seconds=5, max_in_memory=10), InMemoryResponseStore)
    finally:
        await sessions.close()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
async def test_redis_outage_is_unavailable_then_heals() -> None:
    server = RedisProcess()
    server.start()
    sessions = RedisSessionStore(server.url, prefix="t:")
    store = RedisResponseStore.beside(sessions)
    try:
        rid = new_response_id()
        await store.put(_response(rid), [], [1])
        server.kill()
        with pytest.raises(ResponseStoreUnavailable, match="response store unavailable"):
            await store.get(rid)
        with pytest.raises(ResponseStoreUnavailable):
            await store.put(_response(rid, "completed"))
        server.start()
        assert await store.get(rid) is None  # no persistence: a fresh Redis, but the store answers again
        await store.put(_response(rid), [], [1])
        assert await store.get_token_ids(rid) == [1]
    finally:
        await sessions.close()
        server.kill()
