"""Soft KV leases: a session's cached branch survives unleased churn, and never costs a request memory."""

from __future__ import annotations

import random

import pytest

from chatserve.cache import BlockAllocator, RadixPrefixCache

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 16) -> tuple[BlockAllocator, RadixPrefixCache, FakeClock]:
    clock = FakeClock()
    a = BlockAllocator(num_blocks)
    return a, RadixPrefixCache(a, BS, clock=clock), clock


def finish(a: BlockAllocator, c: RadixPrefixCache, tokens: list[int], lease: tuple[str, float] | None = None) -> object:
    """One request run to the end: match, fill the rest with fresh blocks, insert, maybe lease, release."""
    m = c.match_prefix(tokens)
    c.lock(m.node)
    a.incref(m.block_ids)
    need = len(tokens) // BS - len(m.block_ids)
    if a.num_free < need:
        c.evict(need - a.num_free)
    table = m.block_ids + a.allocate(need)
    r = c.insert(tokens, table)
    c.lock(r.node)
    c.unlock(m.node)
    if lease is not None:
        c.set_lease(lease[0], r.node, lease[1])
    c.unlock(r.node)
    a.decref(table)
    return r.node


def toks(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 10_000) for _ in range(n_blocks * BS)]


def test_leased_branch_survives_churn_that_evicts_unleased_ones():
    a, c, _ = make(16)
    session = toks(1, 4)
    finish(a, c, session, lease=("sess-a", 60))
    unleased = toks(2, 4)
    finish(a, c, unleased)
    assert c.stats().leased == 4
    for i in range(10):  # one-off traffic: 3 blocks each, needs eviction from the 8th block on
        finish(a, c, toks(100 + i, 3))
        c.check_integrity({})
    assert c.match_prefix(session).num_tokens == len(session)  # kept
    assert c.match_prefix(unleased).num_tokens < len(unleased)  # churned
    assert c.lease_info("sess-a").num_tokens == len(session)


def test_leases_never_refuse_memory_oldest_lease_goes_first():
    a, c, clock = make(8)
    first, second = toks(1, 4), toks(2, 4)
    finish(a, c, first, lease=("old", 60))
    clock.t += 1
    finish(a, c, second, lease=("new", 60))
    assert a.num_free == 0 and c.stats().leased == 8
    # a request that needs all memory still gets it: leased leaves go, the oldest lease first
    assert c.evict(4) == 4
    assert c.match_prefix(first).num_tokens == 0 and c.match_prefix(second).num_tokens == len(second)
    assert c.lease_info("old") is None  # its branch is gone entirely: nothing left to protect
    assert c.evict(4) == 4 and a.num_free == 8
    assert c.stats().leased == 0 and c.num_leased_evicted_blocks == 8
    c.check_integrity({})


def test_renewing_moves_a_lease_to_the_new_turn_and_to_the_back_of_the_queue():
    a, c, clock = make(12)
    one, two = toks(1, 2), toks(2, 2)
    finish(a, c, one, lease=("s1", 60))
    finish(a, c, two, lease=("s2", 60))
    clock.t += 10
    finish(a, c, one + toks(3, 2), lease=("s1", 60))  # s1's next turn: renewed, longer branch
    assert c.lease_info("s1").num_tokens == 4 * BS
    assert c.lease_info("s1").expires_at == clock.t + 60
    c.check_integrity({})
    finish(a, c, toks(9, 8))  # fills memory; s2 (renewed longest ago) is evicted first
    assert c.match_prefix(two).num_tokens == 0
    assert c.match_prefix(one).num_tokens == len(one)
    c.check_integrity({})


@pytest.mark.parametrize("how", ["expiry", "release"])
def test_expiry_and_release_return_the_branch_to_plain_lru(how):
    a, c, clock = make(8)
    leased = toks(1, 2)
    finish(a, c, leased, lease=("s", 30))
    later = toks(2, 2)
    finish(a, c, later)  # newer in LRU than the leased branch
    if how == "expiry":
        clock.t += 31
        assert c.lease_info("s") is None
    else:
        assert c.release_lease("s") and not c.release_lease("s")
    assert c.stats().leased == 0
    c.check_integrity({})
    c.evict(2)  # plain LRU now: the older branch (the formerly leased one) goes first
    assert c.match_prefix(leased).num_tokens == 0 and c.match_prefix(later).num_tokens == len(later)
    c.check_integrity({})


def test_split_and_partial_eviction_keep_lease_counts_exact():
    a, c, _ = make(10)
    base = toks(1, 5)
    finish(a, c, base, lease=("s", 60))
    finish(a, c, base[: 2 * BS] + toks(2, 2))  # splits the leased edge after 2 blocks
    c.check_integrity({})
    assert c.stats().leased == 5
    finish(a, c, toks(3, 8))  # 3 free + 5: the 2-block unleased branch, then the leased 3-block tail
    c.check_integrity({})
    assert c.lease_info("s").num_tokens == 2 * BS
    assert c.stats().leased == 2


def test_random_workload_with_leases_keeps_every_invariant():
    rng = random.Random(7)
    a, c, clock = make(24)
    prefixes = [toks(s, 2) for s in range(4)]
    for _step in range(300):
        clock.t += rng.random()
        tokens = rng.choice(prefixes) + toks(rng.randrange(50), rng.randrange(0, 4))
        op = rng.random()
        if op < 0.2:
            c.release_lease(f"s{rng.randrange(6)}")
        elif op < 0.25:
            c.evict(rng.randrange(1, 6))
        else:
            lease = (f"s{rng.randrange(6)}", rng.uniform(0.5, 20)) if rng.random() < 0.5 else None
            finish(a, c, tokens, lease)
        c.check_integrity({})
    c.reset()
    assert a.num_free == a.num_total and len(c._leases) == 0


# ---- through the engine --------------------------------------------------------------------------

ENGINE_BLOCK = 16


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _run(engine, request_id: str, prompt: list[int], session=None, max_tokens: int = 2):
    from chatserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, session=session)
    final = None
    for _ in range(500):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        if final is not None:
            return final
    raise AssertionError(f"{request_id} did not finish")


def _sessions_under_churn(folder: str, lease_seconds: float) -> tuple[list, object]:
    """Two sessions with a 3-block history each, then one-off traffic 3x the pool, then their next turns."""
    from chatserve import LLM
    from chatserve.core.session_kv import SessionKV

    llm = LLM(folder, dtype="float32", num_kv_blocks=24, block_size=ENGINE_BLOCK, max_num_seqs=2)
    engine = llm.engine
    histories = {}
    for s in ("sa", "sb"):
        prompt = [random.Random(s).randrange(100, 30_000) for _ in range(49)]
        out = _run(engine, f"{s}-1", prompt, SessionKV(s, lease_seconds, 0))
        histories[s] = prompt + out.outputs[0].token_ids
    for i in range(18):  # 18 one-off prompts of 4 blocks: the 24-block pool turns over three times
        _run(engine, f"oneoff-{i}", [random.Random(i).randrange(100, 30_000) for _ in range(64)])
        engine.check_integrity()
    turns = [_run(engine, f"{s}-2", histories[s] + [11, 12, 13], SessionKV(s, lease_seconds, len(histories[s])))
             for s in ("sa", "sb")]
    return turns, engine


def test_leased_sessions_keep_their_hits_while_one_off_traffic_churns(folder):
    turns, engine = _sessions_under_churn(folder, lease_seconds=600)
    for out in turns:
        assert out.num_cached_tokens >= 48, [t.num_cached_tokens for t in turns]
        assert out.stats.cache_lease_hit and out.stats.session_history_matched is True
        assert out.stats.cache_miss_reason in ("new", "diverged")  # the new message, not the history
    stats = engine.stats()
    assert stats["prefix_cache_lease_hits"] == 2 and stats["num_preemptions"] == 0
    assert stats["num_leased_blocks"] > 0
    engine.check_integrity()


def test_without_leases_the_same_churn_evicts_the_sessions(folder):
    turns, engine = _sessions_under_churn(folder, lease_seconds=0)
    for out in turns:
        assert out.num_cached_tokens == 0 and out.stats.cache_miss_reason == "evicted"
        assert out.stats.session_history_matched is False and not out.stats.cache_lease_hit
    assert engine.stats()["num_leased_blocks"] == 0


def test_a_request_needing_all_memory_still_runs_past_leases(folder):
    from chatserve import LLM
    from chatserve.core.session_kv import SessionKV

    llm = LLM(folder, dtype="float32", num_kv_blocks=16, block_size=ENGINE_BLOCK, max_num_seqs=2, max_model_len=256)
    engine = llm.engine
    for s in range(3):
        _run(engine, f"s{s}", [random.Random(s).randrange(100, 30_000) for _ in range(64)], SessionKV(f"s{s}", 600, 0))
    assert engine.stats()["num_leased_blocks"] == 12
    big = [random.Random(99).randrange(100, 30_000) for _ in range(15 * ENGINE_BLOCK)]
    out = _run(engine, "big", big, max_tokens=8)  # needs 16 blocks: every leased one goes
    assert len(out.outputs[0].token_ids) == 8
    stats = engine.stats()
    assert stats["num_preemptions"] == 0 and stats["prefix_cache_leased_evicted_blocks"] >= 12
    engine.check_integrity()


@pytest.mark.parametrize("how", ["expiry", "release"])
def test_lease_expiry_and_session_delete_release_the_branch(folder, how):
    import time

    from chatserve import LLM
    from chatserve.core.session_kv import SessionKV

    llm = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=ENGINE_BLOCK)
    engine = llm.engine
    history = [random.Random(5).randrange(100, 30_000) for _ in range(50)]
    _run(engine, "t1", history, SessionKV("s", 600, 0))
    report = engine.session_cache_report("s", history)
    assert report["leased"] and report["leased_tokens"] == 48 and report["cached_tokens"] == 48
    assert report["leased_until"] > time.time() + 500
    if how == "expiry":
        assert engine.block_manager.cache.expire_leases(time.monotonic() + 601) == 1
    else:
        assert engine.release_kv_lease("s") is True
    report = engine.session_cache_report("s", history)
    assert not report["leased"] and report["leased_until"] is None
    assert report["cached_tokens"] == 48  # still cached, now as plain LRU
    assert engine.stats()["num_leased_blocks"] == 0
    engine.check_integrity()


# ---- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from tests.helpers.server import start_server

    srv = start_server("--max-model-len", "512", "--num-kv-blocks", "32", "--block-size", "16",
                       "--max-num-seqs", "2", "--kv-lease-seconds", "600")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_http_sessions_keep_hits_under_churn_report_their_cache_and_release_on_delete(server):
    import httpx

    api = httpx.Client(base_url=server.url, timeout=120)
    model = api.get("/v1/models").json()["data"][0]["id"]
    # two unrelated system prompts (~7 blocks each): a shared prefix would be leased for both
    leased = api.post("/v1/sessions", json={"system_prompt": " ".join(f"rule {i}: be brief." for i in range(15))}).json()["id"]
    unleased = api.post("/v1/sessions", json={"system_prompt": " ".join(f"Answer in French, {i}." for i in range(15)),
                                              "defaults": {"kv_lease_seconds": 0}}).json()["id"]
    try:
        def turn(sid: str, text: str) -> dict:
            r = api.post(f"/v1/sessions/{sid}/messages", json={"content": text, "max_tokens": 4, "temperature": 0, "stream": False})
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        for sid in (leased, unleased):
            turn(sid, "Hello there.")
        got = api.get(f"/v1/sessions/{leased}").json()["kv_cache"]
        assert got["leased"] and got["leased_tokens"] >= 16 and got["cached_tokens"] >= got["leased_tokens"] - 16
        assert got["leased_until"] > 0 and got["history_tokens"] > got["cached_tokens"] - 16
        assert api.get(f"/v1/sessions/{unleased}").json()["kv_cache"]["leased"] is False
        assert server.gauge("kv_cache_leased_blocks") > 0
        for i in range(6):  # one-off traffic: 6 x 8 blocks through a 32-block pool
            prompt = [random.Random(1000 + i).randrange(100, 30_000) for _ in range(128)]
            r = api.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
        kept = turn(leased, "And again?")
        assert kept["chatserve"]["lease_hit"] is True and kept["chatserve"]["session_history_matched"] is True
        lost = turn(unleased, "And again?")
        assert lost["chatserve"]["session_history_matched"] is False
        assert lost["chatserve"]["miss_reason"] == "evicted" and lost["chatserve"]["lease_hit"] is False
        m = server.wait_idle()
        assert m["chatserve:prefix_cache_lease_hits_total"] >= 1
        assert m["chatserve:num_preemptions_total"] == 0
    finally:
        for sid in (leased, unleased):
            api.delete(f"/v1/sessions/{sid}")
    assert server.gauge("kv_cache_leased_blocks") == 0  # delete released the lease
    api.close()
