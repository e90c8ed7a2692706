"""Scale-out pieces without a router: cancels through another replica, the session and instance headers.

Two apps over fake engines stand for two replicas; their cancel buses share the real Redis on
127.0.0.1:6379 (a channel of this test's own), as replicas behind a router share one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from chatserve.server.cancel_bus import CancelBus
from chatserve.sessions import InMemorySessionStore
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.net import free_port
from tests.helpers.redis_server import redis_answers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

REDIS = "redis://127.0.0.1:6379/0"
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def replica(engine: FakeEngine, bus: CancelBus | None = None, sessions: Any = None, **settings: Any) -> Any:
    """One replica: the app with its lifespan running (the cancel bus starts there)."""
    return app_client(engine, sessions, bus, lifespan=True, **settings)


async def wait_for(cond: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.skipif(not redis_answers(REDIS), reason="needs the Redis on 127.0.0.1:6379")
async def test_a_cancel_sent_to_another_replica_stops_the_request(smollm_tokenizer) -> None:
    channel = f"chatserve:test-cancel:{uuid.uuid4().hex}"
    owner_engine = FakeEngine(smollm_tokenizer, hold=True)
    other_engine = FakeEngine(smollm_tokenizer)
    bus_a, bus_b = CancelBus(REDIS, channel=channel), CancelBus(REDIS, channel=channel)
    async with replica(owner_engine, bus_a) as a, replica(other_engine, bus_b) as b:
        await asyncio.wait_for(asyncio.gather(bus_a.ready.wait(), bus_b.ready.wait()), 10)
        task = asyncio.ensure_future(a.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r-remote"}))
        await wait_for(lambda: owner_engine.requests and owner_engine.requests[0].num_sent == 1)
        cancelled = await b.post("/v1/requests/r-remote/cancel")
        reply = await task
        again = await b.delete("/v1/requests/r-remote")  # idempotent through the peer too
        unknown = await b.post("/v1/requests/nobody-has-this/cancel")
        owner_engine.release()
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["id"] == "r-remote" and cancelled.json()["status"] == "aborted"
    assert reply.json()["choices"][0]["finish_reason"] == "abort"
    assert again.status_code == 200 and again.json() == cancelled.json()
    assert_error(unknown, 404, param="request_id", code="request_not_found")
    assert other_engine.requests == []  # the peer ran nothing


async def test_a_cancel_bus_without_redis_is_a_503_not_a_hang(smollm_tokenizer) -> None:
    bus = CancelBus(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.5)
    async with replica(FakeEngine(smollm_tokenizer), bus) as client:
        resp = await client.post("/v1/requests/elsewhere/cancel")
        served = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "here"})
        local = await client.post("/v1/requests/here/cancel")  # a request this replica holds needs no Redis
    assert_error(resp, 503, code="cancel_bus_unavailable")
    assert served.status_code == 200 and local.status_code == 200 and local.json()["status"] == "finished"


async def test_session_routes_carry_and_check_x_session_id(smollm_tokenizer) -> None:
    async with replica(FakeEngine(smollm_tokenizer), sessions=InMemorySessionStore()) as client:
        created = await client.post("/v1/sessions", json={})
        sid = created.json()["id"]
        assert created.headers["x-session-id"] == sid
        got = await client.get(f"/v1/sessions/{sid}", headers={"X-Session-Id": sid})
        assert got.status_code == 200 and got.headers["x-session-id"] == sid
        turn = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi"}, headers={"X-Session-Id": sid})
        assert turn.status_code == 200 and turn.headers["x-session-id"] == sid
        wrong = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi"},
                                  headers={"X-Session-Id": "someone-else"})
        assert_error(wrong, 400, param="X-Session-Id", code="session_id_mismatch")
        missing = await client.get("/v1/sessions/does-not-exist")
        assert missing.status_code == 404 and missing.headers["x-session-id"] == "does-not-exist"
        # A path that decodes to a control character is a 404 without the echo (a "\r" in a header
        # would make the HTTP server drop the connection instead of answering).
        hostile = await client.get("/v1/sessions/sess%0D")
        assert hostile.status_code == 404 and "x-session-id" not in hostile.headers
        after = await client.get(f"/v1/sessions/{sid}")
    assert after.json()["num_turns"] == 1  # the refused turn never ran


async def test_every_response_names_the_instance(smollm_tokenizer) -> None:
    async with replica(FakeEngine(smollm_tokenizer), instance_id="replica-7") as client:
        for resp in (await client.get("/health"), await client.post("/v1/chat/completions", json=CHAT),
                     await client.post("/v1/chat/completions", json={"messages": []})):
            assert resp.headers["x-chatserve-instance"] == "replica-7"
