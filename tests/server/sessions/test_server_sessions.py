"""The session API over HTTP against a real server, with the in-memory store and with real Redis.

The same contract runs against both stores; Redis-only tests cover a server restart, key cleanup
and an outage of a Redis server this test starts and kills itself.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from tests.helpers.errors import assert_error
from tests.helpers.net import wait_until
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess
from tests.helpers.server import ServerProcess, start_server
from tests.helpers.streams import stream_in_thread

pytestmark = pytest.mark.timeout(300)
REDIS_DB = 7  # this module's own database on the shared Redis
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
BLOCK = 16


def _redis_keys() -> list[bytes]:
    return list(redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB).scan_iter("chatserve:*"))


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request):
    args = ["--max-model-len", "2048"]
    if request.param == "redis":
        if _redis_keys():
            pytest.fail(f"Redis db {REDIS_DB} is not empty before the test: {_redis_keys()[:5]}")
        args += ["--redis-url", REDIS_URL]
    srv = start_server(*args)
    srv.store = request.param  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    if request.param == "redis":
        leftover = _redis_keys()
        r = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        for key in leftover:
            r.delete(key)
        assert not leftover, f"keys left behind: {leftover[:10]}"


@pytest.fixture
def api(server: ServerProcess):
    client = httpx.Client(base_url=server.url, timeout=120)
    created: list[str] = []
    client.created = created  # type: ignore[attr-defined]
    yield client
    for sid in created:
        client.delete(f"/v1/sessions/{sid}")
    client.close()


def new_session(api: httpx.Client, **body) -> dict:
    r = api.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    s = r.json()
    api.created.append(s["id"])  # type: ignore[attr-defined]
    return s


def turn(api: httpx.Client, sid: str, content: str, **extra) -> httpx.Response:
    body = {"content": content, "stream": False, "max_tokens": 12, "temperature": 0, **extra}
    return api.post(f"/v1/sessions/{sid}/messages", json=body)


def stream_turn(api: httpx.Client, sid: str, content: str, **extra) -> list[dict | str]:
    body = {"content": content, "max_tokens": 12, "temperature": 0, **extra}
    out: list[dict | str] = []
    with api.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- contract (both stores) ---------------------------------------------------------------------
def test_create_get_list_delete(api):
    a = new_session(api, system_prompt="You are terse.", metadata={"title": "first"}, ttl_seconds=600,
                    defaults={"temperature": 0, "max_tokens": 8})
    assert a["object"] == "session" and a["num_turns"] == 0 and a["ttl_seconds"] == 600
    assert a["system_prompt"] == "You are terse." and a["metadata"] == {"title": "first"}
    time.sleep(0.01)
    b = new_session(api, metadata={"title": "second"})
    got = api.get(f"/v1/sessions/{a['id']}").json()
    assert got["id"] == a["id"] and got["messages"] == []
    page = api.get("/v1/sessions", params={"limit": 1}).json()
    assert page["object"] == "list" and [s["id"] for s in page["data"]] == [b["id"]] and page["has_more"] is True
    page2 = api.get("/v1/sessions", params={"limit": 1, "after": b["id"]}).json()
    assert [s["id"] for s in page2["data"]] == [a["id"]]
    deleted = api.delete(f"/v1/sessions/{a['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert_error(api.get(f"/v1/sessions/{a['id']}"), 404)
    assert_error(api.delete(f"/v1/sessions/{a['id']}"), 404)


def test_three_turns_reuse_the_whole_history(api):
    s = new_session(api, system_prompt="You are a helpful assistant. " * 5)
    history = 0
    cached = []
    for i, q in enumerate(["What is the capital of France?", "And of Italy?", "Which one is bigger?"]):
        r = turn(api, s["id"], q, max_tokens=20)
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        c = usage["prompt_tokens_details"]["cached_tokens"]
        cached.append(c)
        if i > 0:
            assert c >= history - BLOCK, (i, c, history)
            assert usage["prompt_tokens"] > history  # the stored history plus the new user turn
        history = usage["prompt_tokens"] + usage["completion_tokens"]
        assert body["choices"][0]["message"]["content"]
    assert cached[1] < cached[2]
    got = api.get(f"/v1/sessions/{s['id']}").json()
    assert got["num_turns"] == 3
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"] * 3
    assert got["messages"][1]["finish_reason"] in ("stop", "length") and got["messages"][1]["usage"]["completion_tokens"]


def test_streamed_turn_has_chat_chunks_and_usage(api):
    s = new_session(api)
    events = stream_turn(api, s["id"], "Say hello.")
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    stored = api.get(f"/v1/sessions/{s['id']}").json()["messages"]
    assert stored[1]["content"] == text


def test_bad_requests(api):
    s = new_session(api)
    assert_error(api.post(f"/v1/sessions/{s['id']}/messages", json={"content": ""}), 400)
    assert_error(api.post(f"/v1/sessions/{s['id']}/messages", json={"content": "x", "temperature": 9}), 400)
    assert_error(api.post(f"/v1/sessions/{s['id']}/messages", content=b"{nope", headers={"content-type": "application/json"}), 400)
    assert_error(api.post("/v1/sessions", json={"ttl_seconds": -5}), 400)
    assert_error(api.post("/v1/sessions", json={"metadata": "not an object"}), 400)
    assert_error(api.get("/v1/sessions", params={"limit": 0}), 400)
    assert_error(api.post("/v1/sessions/sess_doesnotexist/messages", json={"content": "hi"}), 404)
    assert_error(api.get("/v1/sessions/../etc"), 404)
    # nothing was stored by the failed turns
    assert api.get(f"/v1/sessions/{s['id']}").json()["num_turns"] == 0


def test_concurrent_turn_is_409_and_cancelled_turn_is_kept(api, server):
    s = new_session(api)
    sid = s["id"]
    body = {"content": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    stream = stream_in_thread(server.url, f"/v1/sessions/{sid}/messages", body, headers={"X-Request-Id": f"turn-{sid}"})
    wait_until(lambda: server.gauge("num_requests_running") == 1, what="the turn to run")
    err = assert_error(turn(api, sid, "interrupting"), 409)
    assert "turn" in err["message"]
    time.sleep(0.4)
    state = api.post(f"/v1/requests/turn-{sid}/cancel").json()
    assert state["status"] == "aborted" and state["completion_tokens"] > 0
    stream.join(30)
    assert stream.status == 200 and stream.data[-1] == "[DONE]"
    got = api.get(f"/v1/sessions/{sid}").json()
    assert got["num_turns"] == 1
    partial = got["messages"][1]
    assert partial["finish_reason"] == "abort" and partial["content"]
    # the next turn continues from the partial reply, and reuses its KV
    r = turn(api, sid, "Please continue.")
    assert r.status_code == 200
    usage = r.json()["usage"]
    prev = partial["usage"]["prompt_tokens"] + partial["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] > prev
    assert usage["prompt_tokens_details"]["cached_tokens"] >= prev - BLOCK - 1


def test_disconnected_turn_is_stored_as_abort(api, server):
    s = new_session(api)
    sid = s["id"]
    body = {"content": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with api.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n >= 6:
                break
    wait_until(lambda: api.get(f"/v1/sessions/{sid}").json()["num_turns"] == 1, 10, "the aborted turn to be stored")
    msg = api.get(f"/v1/sessions/{sid}").json()["messages"][1]
    assert msg["finish_reason"] == "abort"
    server.wait_idle()
    # the lock was released: a new turn runs
    assert turn(api, sid, "hi").status_code == 200


# ---- Redis only ---------------------------------------------------------------------------------
def test_session_survives_a_server_restart_and_delete_leaves_no_key(server):
    if server.store != "redis":
        pytest.skip("the in-memory store does not survive a restart by design")
    with httpx.Client(base_url=server.url, timeout=120) as api:
        api.created = []  # type: ignore[attr-defined]
        s = new_session(api, system_prompt="Be brief.")
        assert turn(api, s["id"], "Name a fruit.").status_code == 200
        before = api.get(f"/v1/sessions/{s['id']}").json()
    other = start_server("--redis-url", REDIS_URL, "--max-model-len", "2048")
    try:
        with httpx.Client(base_url=other.url, timeout=120) as api2:
            after = api2.get(f"/v1/sessions/{s['id']}").json()
            assert after["messages"] == before["messages"] and after["num_turns"] == 1
            r = turn(api2, s["id"], "Another one?")
            assert r.status_code == 200
            assert api2.get(f"/v1/sessions/{s['id']}").json()["num_turns"] == 2
            assert any(s["id"].encode() in k for k in _redis_keys())
            assert api2.delete(f"/v1/sessions/{s['id']}").status_code == 200
            assert not [k for k in _redis_keys() if s["id"].encode() in k]
    finally:
        assert other.stop() == 0


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server binary not installed")
def test_redis_outage_gives_503_then_recovers():
    rds = RedisProcess()
    rds.start()
    srv = start_server("--redis-url", rds.url, "--max-model-len", "2048")
    try:
        api = httpx.Client(base_url=srv.url, timeout=60)
        s = new_session_plain(api)
        assert turn(api, s["id"], "Hello!").status_code == 200
        # freeze Redis: timeouts, not refusals; the session endpoints answer 503 quickly
        rds.freeze()
        # the client's 60 s timeout is the hang guard: without the server's Redis socket timeout this
        # request would hang on the frozen server instead of answering 503
        err = assert_error(turn(api, s["id"], "Are you there?"), 503)
        assert "unavailable" in err["message"]
        assert_error(api.get("/v1/sessions"), 503)
        chat = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200  # the stateless API does not depend on Redis
        rds.thaw()
        # nothing half-written: the failed turn left the session as it was
        got = api.get(f"/v1/sessions/{s['id']}").json()
        assert got["num_turns"] == 1 and len(got["messages"]) == 2
        # kill it outright: 503 again, then a restart heals without restarting chatserve
        rds.kill()
        assert_error(api.post("/v1/sessions", json={}), 503)
        rds.start()  # the same port: chatserve reconnects
        s2 = new_session_plain(api)
        assert turn(api, s2["id"], "Back again?").status_code == 200
        assert srv.gauge("num_requests_running") == 0
    finally:
        srv.stop()
        rds.kill()


def new_session_plain(api: httpx.Client) -> dict:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()

