"""SIGTERM: no new work, running streams finish or end with finish_reason "abort", turns stored, exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
import redis

from chatserve.sessions import RedisSessionStore

from .server_utils import start_server

pytestmark = pytest.mark.timeout(240)
REDIS_DB = 8
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"


def _collect(url: str, path: str, body: dict, sink: dict) -> threading.Thread:
    def run():
        try:
            with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
                sink["status"] = r.status_code
                sink["data"] = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        except Exception as exc:  # noqa: BLE001
            sink["error"] = repr(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def _finish_reasons(data: list[str]) -> list[str]:
    out = []
    for d in data:
        if d != "[DONE]":
            out += [c["finish_reason"] for c in json.loads(d).get("choices", []) if c.get("finish_reason")]
    return out


def test_sigterm_drains_streams_stores_turns_and_exits_0():
    srv = start_server("--redis-url", REDIS_URL, "--shutdown-grace-s", "3", "--max-model-len", "2048")
    sid = None
    try:
        sid = httpx.post(f"{srv.url}/v1/sessions", json={}, timeout=30).json()["id"]
        short, long, turn = {}, {}, {}
        threads = [
            _collect(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 8, "stream": True}, short),
            _collect(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Story please"}],
                                                        "max_tokens": 1500, "ignore_eos": True, "stream": True}, long),
            _collect(srv.url, f"/v1/sessions/{sid}/messages", {"content": "Tell me everything.", "max_tokens": 1500,
                                                                "ignore_eos": True}, turn),
        ]
        deadline = time.monotonic() + 60
        while srv.gauge("num_requests_running") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new connections once shutdown began
            httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       timeout=5)
        rc = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert rc == 0, srv.log()[-3000:]
        assert elapsed < 3 + 8, elapsed
        assert _finish_reasons(short["data"]) in (["length"], ["stop"]) and short["data"][-1] == "[DONE]"
        assert _finish_reasons(long["data"]) == ["abort"] and long["data"][-1] == "[DONE]", long
        assert _finish_reasons(turn["data"]) == ["abort"] and turn["data"][-1] == "[DONE]", turn

        async def stored():
            store = RedisSessionStore(REDIS_URL)
            try:
                return await store.get_messages(sid)
            finally:
                await store.close()

        messages = asyncio.run(stored())
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].finish_reason == "abort" and messages[1].content
    finally:
        srv.stop(signal.SIGKILL)
        r = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        for key in r.scan_iter("chatserve:*"):
            r.delete(key)
