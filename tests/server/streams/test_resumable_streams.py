"""Resumable streams over the real app and a scripted engine (FakeEngine, in process): the request
fields, the resume routes (Last-Event-ID and starting_after), their refusals, and a resume through a
second app sharing the Redis (another replica). The real model, dropped connections, leases and a
Redis killed mid-run are in test_resumable_live.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from chatserve.sessions import InMemorySessionStore, RedisSessionStore
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import redis_answers
from tests.helpers.streams import parse_sse_lines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

REPLY = "Hello there, friend. How are you today?"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
RESUMABLE = {**CHAT, "stream_options": {"resumable": True}}
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply=REPLY)


def sse(resp: httpx.Response) -> list[tuple[str | None, str]]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
    return parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))


def text_of(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                out.append(c.get("delta", {}).get("content") or c.get("text") or "")
    return "".join(out)


async def test_plain_stream_has_no_ids_and_is_not_logged(engine) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "plain-1"})
        events = sse(resp)
        assert [eid for eid, _ in events] == [None] * len(events)
        assert "x-chatserve-resume" not in resp.headers
        assert_error(await client.get("/v1/chat/completions/chatcmpl-plain-1/stream"), 404, param="id",
                     code="not_found")


async def test_resumable_stream_resumes_from_any_cursor(engine) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=RESUMABLE, headers={"X-Request-Id": "res-1"})
        events = sse(resp)
        assert resp.headers["x-chatserve-resume"] == "/v1/chat/completions/chatcmpl-res-1/stream"
        assert [eid for eid, _ in events] == [str(i) for i in range(len(events))]
        assert events[-1][1] == "[DONE]" and text_of(events) == REPLY
        path = resp.headers["x-chatserve-resume"]
        for cursor in (-1, 0, 3, len(events) - 2):
            by_header = sse(await client.get(path, headers={"Last-Event-ID": str(cursor)}))
            by_query = sse(await client.get(path, params={"starting_after": cursor}))
            assert by_header == by_query == events[cursor + 1:]
        assert sse(await client.get(path)) == events  # no cursor: from the start
        assert sse(await client.get(path, headers={"Last-Event-ID": str(len(events) - 1)})) == []


async def test_resume_refusals_name_the_cursor(engine) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=RESUMABLE, headers={"X-Request-Id": "ref-1"})
        n = len(sse(resp))
        path = "/v1/chat/completions/chatcmpl-ref-1/stream"
        for bad in ("x", "1.5", "-2", "", "9" * 30, "１"):
            assert_error(await client.get(path, params={"starting_after": bad}), 400, param="starting_after")
        assert_error(await client.get(path, headers={"Last-Event-ID": "abc"}), 400, param="Last-Event-ID")
        assert_error(await client.get(path, params={"starting_after": n}), 400, param="starting_after",
                     contains="beyond")
        assert_error(await client.get(path, params={"starting_after": 1}, headers={"Last-Event-ID": "2"}), 400,
                     param="starting_after", contains="disagree")
        assert_error(await client.get("/v1/chat/completions/chatcmpl-nope/stream"), 404, code="not_found")
        # a chat id on the completions route (and the other way round) is not found
        assert_error(await client.get("/v1/completions/chatcmpl-ref-1/stream"), 404)
        assert_error(await client.get("/v1/chat/completions/resp_abc/stream"), 404)


async def test_cursor_older_than_the_kept_events_is_a_400(engine) -> None:
    async with app_client(engine, event_log_max_events=4) as client:
        resp = await client.post("/v1/chat/completions", json=RESUMABLE, headers={"X-Request-Id": "trim-1"})
        n = len(sse(resp))
        path = "/v1/chat/completions/chatcmpl-trim-1/stream"
        assert_error(await client.get(path, params={"starting_after": 0}), 400, param="starting_after",
                     code="cursor_expired")
        tail = sse(await client.get(path, params={"starting_after": n - 5}))
        assert [eid for eid, _ in tail] == [str(i) for i in range(n - 4, n)]


async def test_disconnect_policy_field_is_checked(engine) -> None:
    async with app_client(engine, max_detach_lease_s=60) as client:
        for value, param in [("sometimes", "disconnect_policy"), ({"mode": "linger"}, "disconnect_policy.mode"),
                             ({"lease_seconds": 61}, "disconnect_policy.lease_seconds"),
                             ({"lease_seconds": -1}, "disconnect_policy.lease_seconds"),
                             ({"lease": 5}, "disconnect_policy")]:
            assert_error(await client.post("/v1/chat/completions", json={**CHAT, "disconnect_policy": value}), 400,
                         param=param)
        assert_error(await client.post("/v1/chat/completions", json={**CHAT, "disconnect_policy": 5}), 400,
                     param="disconnect_policy")
        assert_error(await client.post("/v1/chat/completions", json={**CHAT, "stream": False,
                                                                     "disconnect_policy": "detach"}), 400,
                     param="disconnect_policy", contains="stream")
        assert_error(await client.post("/v1/completions", json={"prompt": "x", "disconnect_policy": "detach"}), 400,
                     param="disconnect_policy")
        assert engine.requests == []  # refused before any engine work
        # abort without a stream is today's behaviour; detach implies a logged stream
        ok = await client.post("/v1/chat/completions", json={**CHAT, "stream": False, "disconnect_policy": "abort"})
        assert ok.status_code == 200
        detached = await client.post("/v1/chat/completions", json={**CHAT, "disconnect_policy": {"lease_seconds": 5}},
                                     headers={"X-Request-Id": "det-1"})
        assert text_of(sse(detached)) == REPLY and "x-chatserve-resume" in detached.headers


async def test_text_completions_resume_on_their_own_route(engine) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "stream_options": {
            "resumable": True, "include_usage": True}}, headers={"X-Request-Id": "cmp-1"})
        events = sse(resp)
        assert resp.headers["x-chatserve-resume"] == "/v1/completions/cmpl-cmp-1/stream"
        assert json.loads(events[-2][1])["usage"]["completion_tokens"] > 0
        assert sse(await client.get("/v1/completions/cmpl-cmp-1/stream", params={"starting_after": 1})) == events[2:]


async def test_a_resumable_session_turn_is_stored_and_resumable(engine) -> None:
    async with app_client(engine, InMemorySessionStore()) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        resp = await client.post(f"/v1/sessions/{sid}/messages", json={
            "content": "Hi", "stream_options": {"resumable": True}, "disconnect_policy": "detach"},
            headers={"X-Request-Id": "turn-1"})
        events = sse(resp)
        assert text_of(events) == REPLY
        resumed = sse(await client.get(resp.headers["x-chatserve-resume"], headers={"Last-Event-ID": "0"}))
        assert resumed == events[1:]
        session = (await client.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in session["messages"]] == ["Hi", REPLY]
        bad = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "disconnect_policy": "later"})
        assert_error(bad, 400, param="disconnect_policy")


@pytest.fixture
async def redis_stores() -> AsyncIterator[list[RedisSessionStore]]:
    """Two session stores on one Redis under one fresh prefix: what two replicas have."""
    if not redis_answers(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    prefix = f"chatserve-test-{uuid.uuid4().hex[:8]}:"
    stores = [RedisSessionStore(REDIS_URL, prefix=prefix), RedisSessionStore(REDIS_URL, prefix=prefix)]
    yield stores
    client = stores[0].client
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    for s in stores:
        await s.close()


async def test_resume_on_another_replica_sharing_the_redis(smollm_tokenizer, redis_stores: Any) -> None:
    one, two = FakeEngine(smollm_tokenizer, reply=REPLY), FakeEngine(smollm_tokenizer, reply="other")
    async with app_client(one, redis_stores[0]) as a, app_client(two, redis_stores[1]) as b:
        resp = await a.post("/v1/chat/completions", json=RESUMABLE, headers={"X-Request-Id": "far-1"})
        events = sse(resp)
        path = resp.headers["x-chatserve-resume"]
        assert sse(await b.get(path, headers={"Last-Event-ID": "2"})) == events[3:]
        assert two.requests == []  # replica b only read the log
        redis = redis_stores[0].client
        base = f"{redis_stores[0].prefix}events:chatcmpl-far-1"
        keys = sorted([k async for k in redis.scan_iter(match=f"{redis_stores[0].prefix}events:*")])
        assert keys == [base.encode(), f"{base}:readers".encode()]  # the log, and b's reader heartbeat
        assert 0 < await redis.ttl(base) <= 600 and 0 < await redis.pttl(f"{base}:readers") <= 3000
