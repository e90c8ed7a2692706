"""SIGTERM: no new work, running streams finish or end with finish_reason "abort", turns stored, exit 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import redis

from chatserve.sessions import RedisSessionStore
from tests.helpers.net import HTTP, wait_until
from tests.helpers.server import start_server
from tests.helpers.streams import stream_in_thread

pytestmark = pytest.mark.timeout(240)
REDIS_DB = 8
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"


def test_sigterm_drains_streams_stores_turns_and_exits_0():
    # A grace long enough for what is left of the short stream (it has begun before the signal) on a
    # loaded machine, far too short for the long ones. A real `python -m chatserve serve` process (not
    # a fork of the suite's warm interpreter): the entry point, its signal handling and its exit
    # status exactly as a user's supervisor sees them.
    srv = start_server("--redis-url", REDIS_URL, "--shutdown-grace-s", "4", "--max-model-len", "2048",
                       real_process=True)
    sid = None
    try:
        sid = HTTP.post(f"{srv.url}/v1/sessions", json={}, timeout=30).json()["id"]
        short = stream_in_thread(srv.url, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True})
        long = stream_in_thread(srv.url, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Story please"}], "max_tokens": 1500,
                                 "ignore_eos": True, "stream": True})
        turn = stream_in_thread(srv.url, f"/v1/sessions/{sid}/messages",
                                {"content": "Tell me everything.", "max_tokens": 1500, "ignore_eos": True})
        wait_until(lambda: short.data and long.data and turn.data, 60, "all three streams to produce tokens")
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new connections once shutdown began
            HTTP.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       timeout=5)
        rc = srv.proc.wait(60)  # a hang guard: it exits after the grace and the final writes
        for stream in (short, long, turn):
            stream.join(30)
        assert rc == 0, srv.log()[-3000:]
        assert short.finish_reasons in (["length"], ["stop"]) and short.data[-1] == "[DONE]"
        assert long.finish_reasons == ["abort"] and long.data[-1] == "[DONE]", long
        assert turn.finish_reasons == ["abort"] and turn.data[-1] == "[DONE]", turn

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
