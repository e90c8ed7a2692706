"""A session after a server restart, over HTTP: its next turn is served from the disk tier, and
`GET /v1/sessions/{id}` says where its history is (the default model, Redis sessions in DB 9)."""

from __future__ import annotations

import pytest
import redis

from tests.helpers.net import HTTP
from tests.helpers.redis_server import redis_answers

REDIS = "redis://127.0.0.1:6379/9"


@pytest.mark.skipif(not redis_answers(REDIS), reason=f"no Redis at {REDIS}")
def test_a_session_survives_a_restart_warm_from_disk(tmp_path) -> None:
    import httpx

    from tests.helpers.net import wait_until
    from tests.helpers.server import start_server

    flags = ("--max-model-len", "512", "--num-kv-blocks", "48", "--block-size", "16", "--redis-url", REDIS,
             "--kv-offload-dir", str(tmp_path / "kv"))
    system = " ".join(f"Rule {i}: answer briefly and cite source {i}." for i in range(12))
    first = start_server(*flags)
    sid = ""
    try:
        api = httpx.Client(base_url=first.url, timeout=120)
        sid = api.post("/v1/sessions", json={"system_prompt": system}).json()["id"]
        r = api.post(f"/v1/sessions/{sid}/messages", json={"content": "Hello.", "max_tokens": 4, "temperature": 0,
                                                            "stream": False})
        assert r.status_code == 200, r.text
        # the leased history is written through (off the step loop: it lands a moment later), in memory and on disk
        where = wait_until(lambda: (w := api.get(f"/v1/sessions/{sid}").json()["kv_cache"])["tiers"]["disk"]
                           == w["tiers"]["memory"] > 0 and w, timeout=60, what="the history on disk")
        assert first.stop() == 0, first.log()[-3000:]
    except BaseException:
        first.stop()
        if sid:
            _drop_session(sid)
        raise

    second = start_server(*flags)
    try:
        api = httpx.Client(base_url=second.url, timeout=120)
        where = api.get(f"/v1/sessions/{sid}").json()["kv_cache"]
        assert where["tiers"]["memory"] == 0 and where["tiers"]["disk"] >= 64, where
        r = api.post(f"/v1/sessions/{sid}/messages", json={"content": "And again?", "max_tokens": 4, "temperature": 0,
                                                            "stream": False})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        tiers = usage["chatserve"]["tiers"]
        assert tiers["disk"] >= 64 and tiers["tier_miss_reason"] in ("complete", "absent"), usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == tiers["memory"] + tiers["disk"] + tiers["redis"]
        assert usage["chatserve"]["session_history_matched"] is True
        metrics = HTTP.get(f"{second.url}/metrics").text
        assert 'chatserve:kv_offload_hit_blocks_total{medium="disk"' in metrics
        assert api.delete(f"/v1/sessions/{sid}").status_code in (200, 204)
    finally:
        _drop_session(sid)
        assert second.stop() == 0, second.log()[-3000:]
    with redis.Redis.from_url(REDIS) as client:
        assert not [k for k in client.scan_iter("*") if sid.encode() in k], "the session left keys behind"


def _drop_session(sid: str) -> None:
    """However the test ended, the session's keys go (the store's own delete: its keys and index entries)."""
    import asyncio

    from chatserve.sessions.redis_store import RedisSessionStore

    async def drop() -> None:
        store = RedisSessionStore(REDIS)
        try:
            await store.delete(sid)
        finally:
            await store.close()

    asyncio.run(drop())
