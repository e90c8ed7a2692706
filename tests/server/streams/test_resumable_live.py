"""Resumable streams on a real server with the real model and a Redis of the test's own.

- A Chat Completions stream (the openai SDK) whose connection drops, resumed with Last-Event-ID
  (raw httpx), reassembles to the same text as an uninterrupted greedy run.
- The same, resumed through another server process (this test process, running the app over a
  scripted engine) sharing the Redis, while the run is still generating.
- A detached run nobody resumes is aborted when its lease expires and frees its KV blocks.
- Redis killed during a logged run: the run ends failed with a clear log line, the server stays
  up, Redis-backed endpoints answer 503 until Redis is back.

One server for the module; generations are short except where a run must outlive a lease.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from chatserve.sessions import RedisSessionStore
from tests.helpers.asgi import app_client
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.net import HTTP
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess
from tests.helpers.server import ServerProcess, start_server
from tests.helpers.streams import parse_sse_lines

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")]

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Write three sentences about the sea."}]
GREEDY = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def srv(redis_proc: RedisProcess) -> Iterator[ServerProcess]:
    server = start_server("--redis-url", redis_proc.url, "--max-model-len", "1024", "--no-web")
    yield server
    assert server.stop() == 0, server.log()[-3000:]  # detached runs end cleanly at shutdown
    assert "Traceback" not in server.log(), server.log()[-6000:]


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> str:
    """The uninterrupted greedy reply (a plain stream)."""
    stream = client.chat.completions.create(**GREEDY, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    return text


def content_of(payloads: list[str]) -> str:
    out = []
    for data in payloads:
        if data != "[DONE]":
            for c in json.loads(data).get("choices", []):
                out.append(c.get("delta", {}).get("content") or "")
    return "".join(out)


def finish_of(payloads: list[str]) -> list[str]:
    return [c["finish_reason"] for d in payloads if d != "[DONE]" for c in json.loads(d).get("choices", [])
            if c.get("finish_reason")]


def drop_after(client: openai.OpenAI, k: int, request_id: str, **extra: Any) -> tuple[str, int]:
    """Start a resumable stream through the SDK, read k chunks, drop the connection: (text so far, last id)."""
    stream = client.chat.completions.create(
        **{**GREEDY, **extra.pop("body", {})}, stream=True, stream_options={"resumable": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"disconnect_policy": extra.pop("policy", {"mode": "detach", "lease_seconds": 60}),
                    **extra.pop("extra_body", {})},
        extra_headers={"X-Request-Id": request_id})
    text, n = "", 0
    for chunk in stream:
        n += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if n == k:
            break
    stream.close()  # the connection drops; the detached run goes on
    return text, n - 1  # SSE ids are 0, 1, 2, ...: the k-th chunk was event k-1


def resume(url: str, run_id: str, last_id: int, headers: dict[str, str] | None = None) -> list[tuple[str | None, str]]:
    with HTTP.stream("GET", f"{url}/v1/chat/completions/{run_id}/stream",
                      headers={"Last-Event-ID": str(last_id), **(headers or {})}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return parse_sse_lines(resp.iter_lines())


def metric(srv: ServerProcess, name: str) -> float:
    return srv.metrics().get(name, 0.0)


def wait_for(cond: Any, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g}s"
        time.sleep(0.1)


def blocks_all_free(srv: ServerProcess) -> None:
    srv.wait_idle(timeout=30)
    cache = HTTP.get(f"{srv.url}/debug/cache", timeout=30)
    assert cache.status_code == 200, cache.text  # the invariants hold
    stats = cache.json()["stats"]
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"], stats
    assert srv.gauge("kv_cache_usage_perc") == 0.0


def test_resume_with_last_event_id_reassembles_the_greedy_reply(srv: ServerProcess, client: openai.OpenAI,
                                                               reference: str) -> None:
    before, last_id = drop_after(client, 4, "resume-greedy")
    events = resume(srv.url, "chatcmpl-resume-greedy", last_id)
    ids = [int(i) for i, _ in events if i is not None]
    assert ids == list(range(last_id + 1, last_id + 1 + len(ids)))  # the rest, no gap, no duplicate
    payloads = [d for _, d in events]
    assert payloads[-1] == "[DONE]" and finish_of(payloads) in (["length"], ["stop"])
    assert before + content_of(payloads) == reference
    # resuming again from the very start replays the whole stream (the log outlives the run)
    again = resume(srv.url, "chatcmpl-resume-greedy", -1)
    assert content_of([d for _, d in again]) == reference


def test_resume_from_another_process_sharing_the_redis(srv: ServerProcess, redis_proc: RedisProcess,
                                                       client: openai.OpenAI, reference: str,
                                                       smollm_tokenizer: Any) -> None:
    """This test process is the other replica: the app over a scripted engine, on the same Redis."""
    import asyncio

    before, last_id = drop_after(client, 3, "resume-far", policy={"mode": "detach", "lease_seconds": 1})

    async def through_other_replica() -> list[tuple[str | None, str]]:
        store = RedisSessionStore(redis_proc.url)  # the server's default prefix
        try:
            async with app_client(FakeEngine(smollm_tokenizer, reply="not this"), store) as other:
                resp = await other.get("/v1/chat/completions/chatcmpl-resume-far/stream",
                                       headers={"Last-Event-ID": str(last_id)})
                assert resp.status_code == 200, resp.text
                return parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))
        finally:
            await store.close()

    events = asyncio.run(through_other_replica())
    payloads = [d for _, d in events]
    assert [int(i) for i, _ in events if i is not None][0] == last_id + 1
    # the far reader's heartbeat kept the 1 s lease alive: the run finished rather than aborted
    assert finish_of(payloads) in (["length"], ["stop"]) and before + content_of(payloads) == reference


def test_detached_run_nobody_resumes_is_aborted_at_lease_expiry_and_frees_its_blocks(
        srv: ServerProcess, client: openai.OpenAI) -> None:
    aborts = 'chatserve:request_aborts_total{model_name="%s",reason="lease_expired"}' % MODEL
    start = metric(srv, aborts)
    # 900 tokens with ignore_eos: far longer than the 1 s lease on any CPU
    _, last_id = drop_after(client, 2, "lease-1", policy={"mode": "detach", "lease_seconds": 1},
                            body={"max_tokens": 900}, extra_body={"ignore_eos": True})
    wait_for(lambda: metric(srv, aborts) >= start + 1, what="a lease_expired abort")
    blocks_all_free(srv)
    # what it produced before the lease ran out is still there to read, ending with finish_reason "abort"
    payloads = [d for _, d in resume(srv.url, "chatcmpl-lease-1", last_id)]
    assert payloads[-1] == "[DONE]" and finish_of(payloads) == ["abort"]


def test_redis_killed_during_a_logged_run(srv: ServerProcess, redis_proc: RedisProcess) -> None:
    """Last: it kills the module's Redis (and brings it back empty). The run completes in memory."""
    body = {**GREEDY, "max_tokens": 60, "ignore_eos": True, "stream": True, "stream_options": {"resumable": True},
            "disconnect_policy": {"mode": "detach", "lease_seconds": 60}}
    payloads: list[str] = []
    with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "redis-dies"},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for _, data in _events(resp.iter_lines()):
            payloads.append(data)
            if len(payloads) == 3:
                redis_proc.kill()
    # this replica's reader never noticed: it reads the run's in-process mirror
    assert payloads[-1] == "[DONE]" and finish_of(payloads) == ["length"], payloads[-3:]
    wait_for(lambda: "run chatcmpl-redis-dies: its shared event log failed" in srv.log(), timeout=30,
             what="the log line")
    assert "completes in this process's memory" in srv.log()
    blocks_all_free(srv)
    assert HTTP.get(f"{srv.url}/health", timeout=10).status_code == 200  # the server stays up
    # resumable here from the mirror; anything that needs Redis is a 503 until it is back
    again = resume(srv.url, "chatcmpl-redis-dies", 1)
    assert [d for _, d in again] == payloads[2:]
    elsewhere = HTTP.get(f"{srv.url}/v1/chat/completions/chatcmpl-somewhere-else/stream", timeout=30)
    assert elsewhere.status_code == 503 and elsewhere.json()["error"]["code"] == "event_log_unavailable"
    assert HTTP.post(f"{srv.url}/v1/sessions", json={}, timeout=30).status_code == 503
    redis_proc.start()  # back, empty (no persistence)
    wait_for(lambda: HTTP.post(f"{srv.url}/v1/sessions", json={}, timeout=30).status_code == 201, timeout=30,
             what="sessions answering again")
    assert HTTP.get(f"{srv.url}/v1/chat/completions/chatcmpl-somewhere-else/stream", timeout=30).status_code == 404
    # and a new logged stream works again, readable through Redis too
    fresh = HTTP.post(f"{srv.url}/v1/chat/completions", json={**GREEDY, "max_tokens": 4, "stream": True,
                       "stream_options": {"resumable": True}}, headers={"X-Request-Id": "after-redis"}, timeout=120)
    assert fresh.status_code == 200 and fresh.text.rstrip().endswith("data: [DONE]")
    import redis as redis_sync

    wait_for(lambda: redis_sync.Redis.from_url(redis_proc.url).exists("chatserve:events:chatcmpl-after-redis") == 1,
             timeout=30, what="the new log in Redis")


def _events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) per event as lines arrive (parse_sse_lines needs the whole stream)."""
    cur_id: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield cur_id, "\n".join(data)
            cur_id, data = None, []
        elif line.startswith("id:"):
            cur_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
