"""Bounded soak: a small-KV server under mixed hostile load with a Redis outage in the middle.

Default run: 12 s of load (CHATSERVE_SOAK_SECONDS=600 for a long one by hand); the outage stretches
(bounded) until a session request has met it, and the load until a session turn has succeeded after
it, so a slow host checks the same things as a fast one. A few dozen concurrent
clients mix streaming and non-streaming chat, shared and distinct prefixes, early
disconnects, cancels through the endpoint, session turns and garbage bodies, against a server whose
KV pool and batch are small enough that eviction, preemption and load shedding all happen. The
test's own Redis is killed a third of the way in and restarted at two thirds.

Afterwards: /health is 200; every request got 200, a clear 4xx, or 503 with Retry-After (never
another 5xx, never a hang); the running/waiting gauges and KV usage are back at 0; the KV cache
passes its integrity check; every session holds whole turns only; RSS stayed flat.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.helpers.errors import check_error_body
from tests.helpers.net import HTTP
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess
from tests.helpers.server import start_server

SOAK_SECONDS = float(os.environ.get("CHATSERVE_SOAK_SECONDS", "12"))
NUM_CLIENTS = int(os.environ.get("CHATSERVE_SOAK_CLIENTS", "32"))
OVERTIME_S = 90.0  # the most each phase may run past its share of SOAK_SECONDS (mechanism, not speed)
REQUEST_TIMEOUT = 180.0  # a request slower than this counts as a hang (the machine may be shared)
SHARED_PREFIX = " ".join(f"Policy {i}: be concise, accurate and kind about subject {i}." for i in range(24))

pytestmark = [pytest.mark.timeout(int(SOAK_SECONDS) + 300),
              pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")]


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    session_503_in_outage: int = 0
    session_ok_after_outage: int = 0

    def note(self, action: str, outcome: str) -> None:
        self.outcomes[f"{action}:{outcome}"] += 1

    async def check_status(self, action: str, r: httpx.Response) -> bool:
        """True for 200; records anything that breaks the contract (reads an error body first)."""
        status = r.status_code
        if status == 200 or status == 201:
            return True
        await r.aread()
        try:
            check_error_body(r.json())
        except Exception:  # noqa: BLE001
            self.problems.append(f"{action}: {status} without OpenAI error shape: {r.text[:200]}")
            return False
        if status == 503 and "retry-after" not in r.headers:
            self.problems.append(f"{action}: 503 without Retry-After: {r.text[:200]}")
        elif status >= 500 and status != 503:
            self.problems.append(f"{action}: {status}: {r.text[:300]}")
        return False


def _chat_body(rng: random.Random, stream: bool) -> dict:
    if rng.random() < 0.6:
        messages = [{"role": "system", "content": SHARED_PREFIX},
                    {"role": "user", "content": f"Question {rng.randrange(10**6)}: what is policy {rng.randrange(24)}?"}]
    else:
        words = " ".join(rng.choice(["apple", "river", "stone", "cloud", "lamp", "tiger", "pencil", "ocean"])
                         for _ in range(rng.randrange(20, 160)))
        messages = [{"role": "user", "content": f"{rng.randrange(10**6)} Summarise: {words}"}]
    return {"messages": messages, "max_tokens": rng.randrange(4, 40), "temperature": rng.choice([0, 0.7, 1.0]),
            "stream": stream, "seed": rng.randrange(1000)}


async def _read_stream(resp: httpx.Response, stop_after: int | None = None) -> tuple[list[str], bool]:
    """(data payloads, saw [DONE]); stops early after `stop_after` data lines."""
    data = []
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            data.append(payload)
            if payload == "[DONE]":
                return data, True
            if stop_after is not None and len(data) >= stop_after:
                return data, False
    return data, False


def _keep_going(deadline: float, tally: Tally, phase: dict) -> bool:
    """Until the deadline; past it (bounded), while the outage lasts or no session turn has succeeded
    since Redis came back: a slow host may not get one through the shed load in the last third."""
    now = time.monotonic()
    if now < deadline:
        return True
    if now >= deadline + 2 * OVERTIME_S:
        return False
    return phase["name"] != "after" or tally.session_ok_after_outage == 0


async def _client(i: int, url: str, deadline: float, tally: Tally, phase: dict) -> None:
    rng = random.Random(1000 + i)
    session_id: str | None = None
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as http:
        while _keep_going(deadline, tally, phase):
            r: httpx.Response | None = None
            action = rng.choices(["stream", "nonstream", "disconnect", "cancel", "session", "garbage"],
                                 weights=[25, 15, 12, 12, 24, 12])[0]
            try:
                if action == "stream":
                    async with http.stream("POST", "/v1/chat/completions", json=_chat_body(rng, True)) as r:
                        if await tally.check_status(action, r):
                            data, done = await _read_stream(r)
                            if not done:
                                tally.problems.append(f"stream ended without [DONE]: {data[-2:]}")
                            tally.note(action, "200")
                        else:
                            tally.note(action, str(r.status_code))
                elif action == "nonstream":
                    r = await http.post("/v1/chat/completions", json=_chat_body(rng, False))
                    ok = await tally.check_status(action, r)
                    if ok and r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
                        tally.problems.append(f"nonstream finish_reason {r.json()['choices'][0]['finish_reason']}")
                    tally.note(action, str(r.status_code))
                elif action == "disconnect":
                    body = _chat_body(rng, True) | {"max_tokens": 200, "ignore_eos": True}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        if await tally.check_status(action, r):
                            await _read_stream(r, stop_after=rng.randrange(1, 6))
                        tally.note(action, str(r.status_code))
                elif action == "cancel":
                    rid = f"soak-{i}-{rng.randrange(10**9)}"
                    body = _chat_body(rng, True) | {"max_tokens": 200, "ignore_eos": True}
                    async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
                        if await tally.check_status(action, r):
                            await asyncio.sleep(rng.random() * 0.5)
                            c = await http.post(f"/v1/requests/{rid}/cancel")
                            if c.status_code != 200 or c.json()["status"] not in ("aborted", "finished"):
                                tally.problems.append(f"cancel answered {c.status_code} {c.text[:200]}")
                            data, done = await _read_stream(r)
                            if not done:
                                tally.problems.append("cancelled stream ended without [DONE]")
                        tally.note(action, str(r.status_code))
                elif action == "session":
                    if session_id is None:
                        r = await http.post("/v1/sessions", json={"system_prompt": "You are brief."})
                        if await tally.check_status("session-create", r):
                            session_id = r.json()["id"]
                        elif r.status_code == 503 and phase["name"] == "outage":
                            tally.session_503_in_outage += 1
                        tally.note("session-create", f"{r.status_code}:{phase['name']}")
                        continue
                    body = {"content": f"Tell me about item {rng.randrange(100)}.", "max_tokens": rng.randrange(4, 24),
                            "stream": rng.random() < 0.5}
                    if body["stream"]:
                        async with http.stream("POST", f"/v1/sessions/{session_id}/messages", json=body) as r:
                            status = r.status_code
                            if await tally.check_status(action, r):
                                if rng.random() < 0.2:
                                    await _read_stream(r, stop_after=2)  # a disconnected turn
                                else:
                                    data, done = await _read_stream(r)
                                    store_failed = any('"error"' in d for d in data)
                                    if not done and not store_failed:
                                        tally.problems.append(f"session stream ended badly: {data[-2:]}")
                    else:
                        r = await http.post(f"/v1/sessions/{session_id}/messages", json=body)
                        await tally.check_status(action, r)
                        status = r.status_code
                    if status == 404:
                        session_id = None  # Redis restarted empty: start a new session
                    if status == 503 and phase["name"] == "outage":
                        tally.session_503_in_outage += 1
                    if status == 200 and phase["name"] == "after":
                        tally.session_ok_after_outage += 1
                    tally.note(action, f"{status}:{phase['name']}")
                else:  # garbage
                    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/sessions"])
                    junk = rng.choice([b"{", b"[]", bytes(rng.randrange(256) for _ in range(64)), b'{"ttl_seconds": -1}'
                                       if path == "/v1/sessions" else b'{"messages": 5, "prompt": {}}',
                                       b'{"messages": [{"role": "user", "content": "x"}], "n": -1, "ttl_seconds": "x"}'])
                    r = await http.post(path, content=junk, headers={"content-type": "application/json"})
                    if not 400 <= r.status_code < 500:
                        tally.problems.append(f"garbage to {path} got {r.status_code}")
                    await tally.check_status(action, r)
                    tally.note(action, str(r.status_code))
                if r is not None and r.status_code == 503:
                    await asyncio.sleep(0.2 + rng.random())  # a polite client backs off (Retry-After: 1)
            except httpx.TimeoutException:
                try:
                    debug = (await http.get("/debug/cache", timeout=10)).text[:1500]
                except httpx.HTTPError as exc:
                    debug = repr(exc)
                tally.problems.append(f"{action}: hang (no answer in {REQUEST_TIMEOUT}s)")
                print(f"HANG in {action} (client {i}): server state {debug}", flush=True)
            except httpx.HTTPError as exc:
                tally.problems.append(f"{action}: transport error {exc!r}")


def test_soak_mixed_load_with_redis_outage():
    rds = RedisProcess()
    rds.start()
    srv = start_server("--redis-url", rds.url, "--num-kv-blocks", "64", "--max-model-len", "1024",
                       "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-queue-len", "12",
                       "--sse-keepalive-s", "1")
    tally = Tally()
    phase = {"name": "before"}
    try:
        proc = psutil.Process(srv.proc.pid)
        # warm up, then take the baseline RSS
        HTTP.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4}, timeout=60)
        rss_samples: list[float] = []

        async def sample_rss(stop: asyncio.Event) -> None:
            while not stop.is_set():
                rss_samples.append(proc.memory_info().rss / 2**20)
                await asyncio.sleep(1.0)

        async def main():
            deadline = time.monotonic() + SOAK_SECONDS
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(stop))
            clients = [asyncio.create_task(_client(i, srv.url, deadline, tally, phase)) for i in range(NUM_CLIENTS)]
            await asyncio.sleep(SOAK_SECONDS / 3)
            phase["name"] = "outage"
            rds.kill()
            await asyncio.sleep(SOAK_SECONDS / 3)
            # Redis stays down until a session request has met the outage (bounded): on a slow host
            # the clients may all be busy with chats for the whole third.
            overtime = time.monotonic() + OVERTIME_S
            while tally.session_503_in_outage == 0 and time.monotonic() < overtime:
                await asyncio.sleep(0.2)
            rds.start()
            phase["name"] = "after"
            await asyncio.gather(*clients)
            stop.set()
            await sampler

        asyncio.run(main())
        # NOTE: RSS grows while allocator pools and KV pages warm up, then stays flat. It used to
        # climb for minutes (+52 MiB in the last third of a 300 s run, 1.4 GiB peak): oneDNN kept a
        # primitive per distinct matmul row count. Matmul shapes are now bounded (see
        # chatserve/models/cpu_linear.py); a 300 s run then measured +1.9 MiB in its last third.
        third = max(1, len(rss_samples) // 3)
        rss_start, rss_end = rss_samples[third], rss_samples[-1]
        rss_final_third = rss_samples[-1] - rss_samples[-third - 1]

        assert HTTP.get(f"{srv.url}/health", timeout=10).status_code == 200
        m = srv.wait_idle(timeout=15)
        assert m["chatserve:kv_cache_usage_perc"] == 0
        integrity = HTTP.get(f"{srv.url}/debug/cache", timeout=30)
        assert integrity.status_code == 200 and integrity.json()["ok"], integrity.text
        # sessions work again after the outage, and hold whole turns only
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            s = http.post("/v1/sessions", json={})
            assert s.status_code == 201, s.text
            sid = s.json()["id"]
            assert http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "stream": False,
                                                                     "max_tokens": 3}).status_code == 200
            page = http.get("/v1/sessions", params={"limit": 100}).json()["data"]
            for sess in page:
                full = http.get(f"/v1/sessions/{sess['id']}").json()
                roles = [msg["role"] for msg in full["messages"]]
                assert roles == ["user", "assistant"] * full["num_turns"], full
        metrics = srv.metrics()
        stats = integrity.json()["stats"]
        report = {
            "seconds": SOAK_SECONDS, "clients": NUM_CLIENTS,
            "outcomes": dict(sorted(tally.outcomes.items())),
            "requests_total": sum(tally.outcomes.values()),
            "aborts": {k.split('reason="')[1].rstrip('"}'): v for k, v in metrics.items()
                       if k.startswith("chatserve:request_aborts_total{")},
            "preemptions": stats.get("num_preemptions"), "evicted_blocks": stats.get("prefix_cache_evicted_blocks"),
            "session_503_in_outage": tally.session_503_in_outage,
            "session_ok_after_outage": tally.session_ok_after_outage,
            "rss_mib_first": round(rss_samples[0], 1), "rss_mib_after_warmup": round(rss_start, 1),
            "rss_mib_end": round(rss_end, 1), "rss_mib_max": round(max(rss_samples), 1),
            "rss_mib_growth_final_third": round(rss_final_third, 1),
        }
        print("\nSOAK REPORT " + json.dumps(report, indent=1))
        problems = collections.Counter(tally.problems)
        assert not problems, "\n".join(f"{n} x {p}" for p, n in problems.most_common(30))
        assert "Traceback" not in srv.log(), srv.log()[-4000:]
        assert tally.session_503_in_outage >= 1
        assert tally.session_ok_after_outage >= 1
        assert sum(v for k, v in tally.outcomes.items() if k.startswith(("stream:200", "nonstream:200"))) >= 10
        if SOAK_SECONDS >= 300:
            assert rss_final_third < 32, report  # MiB: flat once warm
        else:
            assert rss_end - rss_start < 96, report  # MiB: warm-up only, no runaway
        assert stats["prefix_cache_evicted_blocks"] > 0, report  # the small pool really was under pressure
    finally:
        srv.stop()
        rds.kill()
