"""Branches of a session over HTTP against a real server: fork, regenerate, edit, rename, per-reply
stats and the cache stats endpoint, with the in-memory store and with real Redis.

What is checked is the mechanism: a fork holds the source's exact token history, so the first turn
on it (an edit) reports cached tokens covering the shared turns; a regenerate prompts with the
stored history up to the last reply, so all of its prompt but the last token comes from the cache.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import redis

from tests.helpers.errors import assert_error
from tests.helpers.server import ServerProcess, start_server

pytestmark = pytest.mark.timeout(300)
REDIS_DB = 11  # this module's own database on the shared Redis
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
BLOCK = 16
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 3


def _redis() -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request: pytest.FixtureRequest) -> Any:
    args = ["--max-model-len", "2048"]  # the default dtype: the fast path of every host (the mechanism is under test)
    if request.param == "redis":
        try:
            leftover = list(_redis().scan_iter("chatserve:*"))
        except redis.ConnectionError:
            pytest.skip("no Redis at 127.0.0.1:6379")
        if leftover:
            pytest.fail(f"Redis db {REDIS_DB} is not empty before the test: {leftover[:5]}")
        args += ["--redis-url", REDIS_URL]
    srv = start_server(*args)
    srv.store = request.param  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    if request.param == "redis":
        r = _redis()
        leftover = list(r.scan_iter("chatserve:*"))
        for key in leftover:
            r.delete(key)
        # The two index zsets go once the last session is deleted; nothing else may stay.
        assert not leftover, f"keys left behind: {leftover[:10]}"


@pytest.fixture
def api(server: ServerProcess) -> Any:
    client = httpx.Client(base_url=server.url, timeout=120)
    created: list[str] = []
    client.created = created  # type: ignore[attr-defined]
    yield client
    for sid in created:
        client.delete(f"/v1/sessions/{sid}")
    client.close()


def _new(api: httpx.Client, **body: Any) -> dict[str, Any]:
    r = api.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    api.created.append(r.json()["id"])  # type: ignore[attr-defined]
    return r.json()


def _turn(api: httpx.Client, sid: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"content": content, "stream": False, "max_tokens": 8, "temperature": 0, **extra}
    r = api.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _fork(api: httpx.Client, sid: str, keep_turns: int, **extra: Any) -> dict[str, Any]:
    r = api.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": keep_turns, **extra})
    assert r.status_code == 201, r.text
    api.created.append(r.json()["id"])  # type: ignore[attr-defined]
    return r.json()


def _history_len(reply: dict[str, Any]) -> int:
    """A turn's history length: its prompt plus every token it generated."""
    return int(reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"])


def _cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_edit_turn_one_of_three_branches_with_the_shared_history_cached(api: httpx.Client) -> None:
    s = _new(api, system_prompt=SYSTEM, metadata={"title": "trip"})
    replies = [_turn(api, s["id"], q) for q in ("Name a fruit.", "Name a colour.", "Name an animal.")]
    shared = _history_len(replies[0])  # the edit keeps turn 0 and replaces turn 1

    fork = _fork(api, s["id"], 1, metadata={"branch_at": 2})
    assert fork["id"] != s["id"] and fork["num_turns"] == 1 and fork["system_prompt"] == SYSTEM
    assert fork["forked_from"] == {"session_id": s["id"], "turn": 1}
    assert fork["metadata"] == {"branch_at": 2}
    source = api.get(f"/v1/sessions/{s['id']}").json()
    assert fork["messages"] == source["messages"][:2]

    edited = _turn(api, fork["id"], "Name a vegetable.")
    # The branch's first request found the whole shared turn in the cache (at most the part of a
    # block the radix tree cannot share), so a branch costs no prefill of what it shares.
    assert _cached(edited) >= shared - BLOCK, (edited["usage"], shared)
    assert _cached(edited) >= 2 * BLOCK
    assert edited["usage"]["prompt_tokens"] > shared
    after = api.get(f"/v1/sessions/{fork['id']}").json()
    assert [m["content"] for m in after["messages"] if m["role"] == "user"] == ["Name a fruit.", "Name a vegetable."]
    assert api.get(f"/v1/sessions/{s['id']}").json()["num_turns"] == 3  # the source is untouched

    # keep_turns 0 is an empty branch with the same system prompt; its first turn shares that.
    empty = _fork(api, s["id"], 0)
    assert empty["num_turns"] == 0 and empty["messages"] == []
    first = _turn(api, empty["id"], "Name a fruit.")
    assert first["usage"]["prompt_tokens"] == replies[0]["usage"]["prompt_tokens"]
    assert _cached(first) >= first["usage"]["prompt_tokens"] - BLOCK


def test_regenerate_replaces_the_last_reply_with_its_prompt_cached(api: httpx.Client) -> None:
    s = _new(api, system_prompt=SYSTEM)
    _turn(api, s["id"], "Say hello.")
    second = _turn(api, s["id"], "Tell me a number.", temperature=1.0, seed=1)
    before = api.get(f"/v1/sessions/{s['id']}").json()["messages"]

    r = api.post(f"/v1/sessions/{s['id']}/regenerate", json={"stream": False, "max_tokens": 8, "temperature": 1.0,
                                                              "seed": 2})
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]  # the very same prompt
    assert _cached(again) >= again["usage"]["prompt_tokens"] - BLOCK, again["usage"]
    after = api.get(f"/v1/sessions/{s['id']}").json()
    assert after["num_turns"] == 2 and len(after["messages"]) == 4
    assert after["messages"][:3] == before[:3]
    assert after["messages"][3]["content"] == again["choices"][0]["message"]["content"]

    # Streamed, the same: chunks, then the stored reply is the streamed text.
    text, usage = [], None
    with api.stream("POST", f"/v1/sessions/{s['id']}/regenerate", json={"max_tokens": 8, "temperature": 0}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    final = api.get(f"/v1/sessions/{s['id']}").json()
    assert final["num_turns"] == 2 and final["messages"][3]["content"] == "".join(text)
    assert usage is not None and usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK


def test_reply_stats_are_stored_with_each_turn(api: httpx.Client) -> None:
    s = _new(api, system_prompt=SYSTEM)
    replies = [_turn(api, s["id"], q, max_tokens=6, ignore_eos=True) for q in ("One.", "Two.")]
    got = api.get(f"/v1/sessions/{s['id']}").json()
    stats = [m["stats"] for m in got["messages"] if m["role"] == "assistant"]
    assert [m["stats"] for m in got["messages"] if m["role"] == "user"] == [None, None]
    for stat, reply in zip(stats, replies):
        assert stat == reply["stats"]
        assert stat["ttft_s"] > 0 and stat["decode_tokens_per_s"] > 0
        assert stat["completion_tokens"] == reply["usage"]["completion_tokens"] == 6
        assert stat["cached_tokens"] == _cached(reply) and stat["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert stats[1]["cached_tokens"] >= _history_len(replies[0]) - BLOCK


def test_rename_and_defaults_by_patch(api: httpx.Client) -> None:
    s = _new(api)
    r = api.patch(f"/v1/sessions/{s['id']}", json={"title": "Weekend plans"})
    assert r.status_code == 200 and r.json()["title"] == "Weekend plans"
    r = api.patch(f"/v1/sessions/{s['id']}", json={"defaults": {"temperature": 0, "seed": 7, "top_k": 3, "max_tokens": 4}})
    assert r.json()["defaults"] == {"temperature": 0, "seed": 7, "top_k": 3, "max_tokens": 4}
    assert r.json()["title"] == "Weekend plans"
    reply = api.post(f"/v1/sessions/{s['id']}/messages", json={"content": "Hi", "stream": False}).json()
    assert reply["usage"]["completion_tokens"] <= 4  # the stored defaults apply to the next turn
    listed = api.get("/v1/sessions", params={"limit": 100}).json()["data"]
    assert next(x for x in listed if x["id"] == s["id"])["title"] == "Weekend plans"
    assert api.patch(f"/v1/sessions/{s['id']}", json={"title": ""}).json()["title"] is None


def test_bad_input_is_a_400_naming_the_field(api: httpx.Client) -> None:
    s = _new(api)
    sid = s["id"]
    assert_error(api.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": 1}), 400, param="keep_turns")
    assert_error(api.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": -1}), 400, param="keep_turns")
    assert_error(api.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": "0"}), 400, param="keep_turns")
    assert_error(api.post(f"/v1/sessions/{sid}/fork", json={}), 400, param="keep_turns")
    assert_error(api.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": 0, "title": 5}), 400, param="title")
    assert_error(api.patch(f"/v1/sessions/{sid}", json={"title": "x" * 201}), 400, param="title")
    assert_error(api.patch(f"/v1/sessions/{sid}", json={"defaults": {"top_p": 3}}), 400, param="defaults.top_p")
    assert_error(api.patch(f"/v1/sessions/{sid}", json={}), 400, param="title")
    assert_error(api.post(f"/v1/sessions/{sid}/regenerate", json={"stream": False}), 400, param="session_id")
    assert_error(api.post(f"/v1/sessions/{sid}/regenerate", json={"n": 2}), 400, param="n")
    missing = "sess_" + "0" * 25
    assert_error(api.post(f"/v1/sessions/{missing}/fork", json={"keep_turns": 0}), 404, code="session_not_found")
    assert_error(api.patch(f"/v1/sessions/{missing}", json={"title": "x"}), 404, code="session_not_found")
    assert_error(api.post(f"/v1/sessions/{missing}/regenerate", json={}), 404, code="session_not_found")
    assert len([x for x in api.get("/v1/sessions", params={"limit": 100}).json()["data"] if x["forked_from"]]) == 0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^chatserve:{re.escape(name)}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_cache_stats_match_the_metrics(api: httpx.Client) -> None:
    s = _new(api, system_prompt=SYSTEM)
    _turn(api, s["id"], "Hello.")
    stats = api.get("/v1/cache/stats").json()
    metrics = api.get("/metrics").text
    assert stats["object"] == "cache.stats"
    assert stats["total_blocks"] == _metric(metrics, "kv_cache_total_blocks") > 0
    assert stats["cached_blocks"] == _metric(metrics, "kv_cache_cached_blocks") > 0  # the finished turn stays cached
    assert stats["kv_cache_usage_perc"] == pytest.approx(_metric(metrics, "kv_cache_usage_perc"))
    assert stats["prefix_cache_hits_tokens"] == _metric(metrics, "prefix_cache_hits")
    assert stats["prefix_cache_queries_tokens"] == _metric(metrics, "prefix_cache_queries") > 0
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits_tokens"] / stats["prefix_cache_queries_tokens"])
    assert stats["free_blocks"] + stats["cached_blocks"] + stats["used_blocks"] == stats["total_blocks"]


def test_forked_redis_keys_expire_with_the_session(server: ServerProcess, api: httpx.Client) -> None:
    if server.store != "redis":  # type: ignore[attr-defined]
        pytest.skip("Redis key layout")
    s = _new(api, ttl_seconds=600)
    _turn(api, s["id"], "Hi.")
    fork = _fork(api, s["id"], 1)
    api.patch(f"/v1/sessions/{fork['id']}", json={"title": "b"})
    r = _redis()
    keys = list(r.scan_iter(f"chatserve:session:{fork['id']}*"))
    assert len(keys) == 3  # hash, messages, tokens (no lock between turns)
    assert all(0 < r.pttl(k) <= 600_000 for k in keys), [(k, r.pttl(k)) for k in keys]
    assert api.delete(f"/v1/sessions/{fork['id']}").status_code == 200
    assert list(r.scan_iter(f"chatserve:session:{fork['id']}*")) == []
