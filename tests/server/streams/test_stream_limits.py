"""Streams a client cannot hold forever, and run ids that cannot reach another run's Redis keys.

- A client that stops reading: each SSE write waits at most --sse-send-timeout-s, then the stream ends
  as on a disconnect (the engine request is aborted), quietly: nothing escapes to uvicorn.
- Event-log keys percent-encode the run id, so `X-Request-Id: x:readers` is not run `x`'s heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from chatserve.server import ServerSettings, create_app
from chatserve.server.streams.event_log import RedisEventLog, key_part
from chatserve.server.streams.sse import sse_response
from chatserve.sessions import InMemorySessionStore, RedisSessionStore
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import redis_for_tests

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    yield from redis_for_tests()


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def _scope(app: Any, path: str = "/stream", method: str = "GET") -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "app": app,
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234)}


@pytest.mark.parametrize("first_write_blocks", [True, False])
async def test_a_client_that_stops_reading_is_dropped(caplog, first_write_blocks) -> None:
    """The send that never completes (a full socket) ends the response: the events' generator is closed
    (its cleanup runs) and the call returns instead of raising. Blocked on an event, or on a keepalive."""
    cleaned = asyncio.Event()
    sent: list[bytes] = []

    async def events():
        try:
            yield {"data": "one"}
            await asyncio.Event().wait()  # no more events: only keepalives would follow
        finally:
            cleaned.set()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if first_write_blocks or sent:
                await asyncio.Event().wait()  # the client took nothing more
            sent.append(message["body"])

    app = SimpleNamespace(state=SimpleNamespace(ctx=SimpleNamespace(settings=ServerSettings(sse_send_timeout_s=0.05))))
    response = sse_response(events(), keepalive_s=0.01, headers={}, numbered=False)
    with caplog.at_level(logging.WARNING, logger="chatserve.server.streams.sse"):
        await response(_scope(app), _never, send)  # returns: bounded by the test's timeout, not asserted on
    assert response.send_timeout == 0.05  # from the app's settings
    await asyncio.wait_for(cleaned.wait(), 10)
    assert any("took no data" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_stalled_chat_stream_aborts_its_request(smollm_tokenizer) -> None:
    """Over the real app: a streamed chat whose client stops reading is aborted in the engine."""
    engine = FakeEngine(smollm_tokenizer, reply="Hello there.", hold=True)
    app = create_app(engine, InMemorySessionStore(), ServerSettings(serve_web=False, sse_send_timeout_s=0.05,
                                                                    sse_keepalive_s=0.01))
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": True}).encode()
    delivered = asyncio.Event()
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await _never()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if delivered.is_set():
                await asyncio.Event().wait()  # the socket is full from here on
            delivered.set()

    await app(_scope(app, "/v1/chat/completions", "POST"), receive, send)
    assert delivered.is_set() and len(engine.requests) == 1
    req = engine.requests[0]
    await asyncio.wait_for(req.done.wait(), 10)
    assert req.metrics.aborted_in_state is not None  # aborted, not finished


def test_key_parts_are_one_to_one_and_colon_free() -> None:
    ids = ["chatcmpl-abc", "chatcmpl-abc:readers", "chatcmpl-abc%3Areaders", "a{b}c", "a b", "é", "%", "%25",
           "chatcmpl-" + "x" * 128, "cmpl-A.b_c~d-e"]
    parts = [key_part(i) for i in ids]
    assert len(set(parts)) == len(ids)
    for p in parts:
        assert ":" not in p and "{" not in p and "}" not in p and " " not in p, p
        assert all(c.isascii() for c in p)
    assert key_part("chatcmpl-0123abcd") == "chatcmpl-0123abcd"  # ids of the safe alphabet keep their keys
    assert key_part("cmpl-A.b_c~d-e") == "cmpl-A.b_c~d-e"


async def test_a_request_id_cannot_name_another_runs_redis_keys(redis_url) -> None:
    prefix = f"chatserve-test-{uuid.uuid4().hex[:8]}:"
    store = RedisSessionStore(redis_url, prefix=prefix)
    log = RedisEventLog(store.client, prefix=prefix, max_events=10, ttl_s=30)
    victim, attacker = "chatcmpl-victim", "chatcmpl-victim:readers"
    try:
        await log.append(victim, {"n": "victim-0"})
        async for _ in log.follow(victim):  # a reader: the victim's heartbeat key exists now
            break
        # Before: the attacker's stream key *was* the victim's heartbeat key (a string): XADD failed
        # with WRONGTYPE, or, written first, it broke the victim's reader.
        await log.append(attacker, {"n": "attacker-0"})
        async for _ in log.follow(attacker):
            break
        await log.append(victim, {"n": "victim-1"})
        await log.end(victim)
        await log.end(attacker)
        assert [e["n"] async for _, e in log.follow(victim, heartbeat=False)] == ["victim-0", "victim-1"]
        assert [e["n"] async for _, e in log.follow(attacker, heartbeat=False)] == ["attacker-0"]
        assert log.stream_key(attacker) == f"{prefix}events:chatcmpl-victim%3Areaders"
        assert len({log.stream_key(victim), log.readers_key(victim), log.stream_key(attacker),
                    log.readers_key(attacker)}) == 4
    finally:
        await log.delete(victim)
        await log.delete(attacker)
        with redis.Redis.from_url(redis_url) as client:
            left = list(client.scan_iter(match=f"{prefix}*"))
            if left:
                client.delete(*left)
        await store.close()
    assert left == []
