"""cache_salt (vLLM's answer to prefix-cache timing side channels, CVE-2025-46570): requests share KV
blocks only with requests of the same salt, on every tier: the radix tree, the disk tier, the Redis
tier, and the names the KV events give blocks. Same salt still shares.

Each tier is checked the way an attacker would probe it: the same tokens under another salt (or
none) must be a miss, however warm the cache is for the victim's salt.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator

import pytest
import redis

from chatserve import LLM, SamplingParams
from chatserve.cache import BlockAllocator, BlockStored, KVEventLog, RadixPrefixCache
from chatserve.cache.kv_events import event_hashes
from chatserve.engine.input_processor import PromptError
from tests.helpers.redis_server import redis_answers

BS = 4
SALTS = (None, "tenant-a", "tenant-b")


def toks(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 10_000) for _ in range(n_blocks * BS)]


def finish(a: BlockAllocator, c: RadixPrefixCache, tokens: list[int], salt: str | None) -> list[int]:
    """One request run to the end under ``salt``; returns the tree's block ids of its whole blocks."""
    m = c.match_prefix(tokens, salt=salt)
    c.lock(m.node)
    a.incref(m.block_ids)
    need = len(tokens) // BS - len(m.block_ids)
    if a.num_free < need:
        c.evict(need - a.num_free)
    table = m.block_ids + a.allocate(need)
    r = c.insert(tokens, table, salt=salt)
    c.lock(r.node)
    c.unlock(m.node)
    c.unlock(r.node)
    a.decref(table)
    return r.block_ids


# ---- the radix tree -------------------------------------------------------------------------------


def test_two_salts_never_share_a_block_and_the_same_salt_does():
    a = BlockAllocator(64)
    c = RadixPrefixCache(a, BS)
    tokens = toks(1, 4)
    ids = {salt: finish(a, c, tokens, salt) for salt in SALTS}
    assert len({b for v in ids.values() for b in v}) == 3 * 4, ids  # three disjoint copies of the same 4 blocks
    for salt in SALTS:
        m = c.match_prefix(tokens, salt=salt)
        assert m.block_ids == ids[salt] and m.num_tokens == len(tokens)
        assert c.peek_prefix(tokens, salt=salt) == len(tokens)
        assert c.salt_of(m.node) == salt
        assert finish(a, c, tokens, salt) == ids[salt]  # same salt: shared, no new block
    assert c.match_prefix(tokens, salt="tenant-c").num_tokens == 0
    assert c.peek_prefix(tokens, salt="tenant-c") == 0
    c.check_integrity({})


def test_a_salted_request_never_matches_unsalted_blocks_partially_either():
    a = BlockAllocator(32)
    c = RadixPrefixCache(a, BS)
    tokens = toks(2, 3)
    finish(a, c, tokens, None)
    m = c.match_prefix(tokens[: BS + 2], salt="s")
    assert m.num_tokens == 0
    assert c.match_partial(tokens[: BS + 2], m) is None  # the copy-on-write of a partial block stays in the salt too
    m = c.match_prefix(tokens[:2], salt=None)
    assert c.match_partial(tokens[:2], m) is not None  # (the same prompt unsalted does copy it)


def test_eviction_and_miss_reasons_stay_within_a_salt():
    a = BlockAllocator(8)
    c = RadixPrefixCache(a, BS)
    tokens = toks(3, 4)
    finish(a, c, tokens, "a")
    finish(a, c, toks(4, 8), None)  # fills the pool: salt a's blocks are evicted
    assert c.match_prefix(tokens, salt="a").num_tokens == 0
    assert c.explain_miss(tokens, 0, salt="a").reason == "evicted"
    assert c.explain_miss(tokens, 0, salt="b").reason == "new"  # another salt never held it
    assert c.explain_miss(tokens, 0, salt=None).reason == "new"
    assert "a" not in c._salt_roots  # a salt that holds nothing leaves no root behind
    c.check_integrity({})


def test_random_salted_workload_keeps_every_invariant():
    rng = random.Random(11)
    a = BlockAllocator(24)
    c = RadixPrefixCache(a, BS)
    stems = [toks(s, 2) for s in range(3)]
    for _ in range(300):
        salt = rng.choice(SALTS)
        tokens = rng.choice(stems) + toks(rng.randrange(40), rng.randrange(0, 3))
        if rng.random() < 0.1:
            c.evict(rng.randrange(1, 5))
        else:
            finish(a, c, tokens, salt)
        c.check_integrity({})
        # no block is named under two salts: every salt's subtree holds its own blocks
        seen: dict[int, str | None] = {}
        for _tokens, ids, s in c.leaf_paths():
            for b in ids:
                assert seen.setdefault(b, s) == s
    c.reset()
    assert a.num_free == a.num_total and not c._salt_roots


# ---- KV events ------------------------------------------------------------------------------------


def test_kv_events_name_the_same_tokens_differently_per_salt():
    a = BlockAllocator(64)
    log = KVEventLog(BS)
    c = RadixPrefixCache(a, BS, kv_events=log)
    tokens = toks(5, 3)
    stored: dict[str | None, list[int]] = {}
    for salt in SALTS:
        finish(a, c, tokens, salt)
        events = log.drain()
        assert len(events) == 1 and isinstance(events[0], BlockStored)
        assert events[0].token_ids == tokens and events[0].parent_block_hash is None
        stored[salt] = events[0].block_hashes
        assert stored[salt] == event_hashes(tokens, BS, 3, salt)  # the salt is part of the first block's hash
    assert stored[None] == event_hashes(tokens, BS, 3)  # unsalted names are what they always were
    all_hashes = [h for v in stored.values() for h in v]
    assert len(set(all_hashes)) == len(all_hashes) == 9
    finish(a, c, tokens, "tenant-a")
    assert log.drain() == []  # same salt: nothing new stored
    # a continuation chains from its salted parent
    finish(a, c, tokens + toks(6, 1), "tenant-b")
    (e,) = log.drain()
    assert e.parent_block_hash == stored["tenant-b"][-1]
    assert e.block_hashes == event_hashes(tokens + toks(6, 1), BS, 4, "tenant-b")[3:]


# ---- through the engine: memory, disk, Redis ----------------------------------------------------------

EBS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


def _full(ids: list[int]) -> int:
    return (len(ids) - 1) // EBS * EBS


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.engine.close()


def _make(made: list[LLM], folder: str, **kw) -> LLM:
    llm = LLM(folder, dtype="float32", block_size=EBS, num_kv_blocks=kw.pop("num_kv_blocks", 48), max_num_seqs=2, **kw)
    made.append(llm)
    return llm


def _run(llm: LLM, rid: str, ids: list[int], salt: str | None):
    engine = llm.engine
    engine.add_request(rid, {"prompt_token_ids": ids}, GREEDY, cache_salt=salt)
    final = None
    for _ in range(200):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        if final is not None:
            engine.check_integrity()
            return final
    raise AssertionError(f"{rid} did not finish")


def test_engine_memory_tier_shares_only_within_a_salt(tiny, engines):
    llm = _make(engines, tiny)
    ids = _prompt(1)
    assert _run(llm, "a1", ids, "a").num_cached_tokens == 0
    assert _run(llm, "b1", ids, "b").num_cached_tokens == 0  # same tokens, another salt: computed again
    assert _run(llm, "n1", ids, None).num_cached_tokens == 0  # and unsalted too
    for i, salt in enumerate(("a", "b", None)):
        out = _run(llm, f"again{i}", ids, salt)
        assert out.num_cached_tokens == _full(ids), salt  # each salt hits its own copy
    # every copy is in the tree at once: three disjoint sets of blocks
    tree = llm.engine.block_manager.cache
    assert tree.stats().evictable >= 3 * _full(ids) // EBS


def test_engine_disk_tier_shares_only_within_a_salt(tiny, engines, tmp_path):
    ids = _prompt(2)
    first = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy="write_through")
    first.engine.kv_tiering.record_events = True
    _run(first, "w", ids, "a")
    tiering = first.engine.kv_tiering
    assert tiering.store.flush()
    n = len(ids) // EBS
    stored = tiering.stored_events()
    assert [e.block_hashes[0] for e in stored][: _full(ids) // EBS] == event_hashes(ids, EBS, n, "a")[: _full(ids) // EBS]
    assert not set(event_hashes(ids, EBS, n)) & {e.block_hashes[0] for e in stored}
    assert tiering.locate(ids, "a")["disk"] >= _full(ids)
    assert tiering.locate(ids, "b")["disk"] == 0 and tiering.locate(ids)["disk"] == 0
    first.engine.close()
    engines.remove(first)

    second = _make(engines, tiny, kv_offload_dir=str(tmp_path))  # a restart: only the disk is warm
    for salt in ("b", None):
        out = _run(second, f"probe-{salt}", ids, salt)
        assert out.num_cached_tokens == 0 and out.stats.num_disk_cached_tokens == 0, salt
    assert second.engine.reset_prefix_cache()
    out = _run(second, "owner", ids, "a")
    assert out.stats.num_disk_cached_tokens == _full(ids) == out.num_cached_tokens


@pytest.fixture
def redis9() -> Iterator[dict]:
    url = "redis://127.0.0.1:6379/9"
    if not redis_answers(url):
        pytest.skip(f"no Redis at {url}")
    prefix = f"chatserve-test-salt-{uuid.uuid4().hex}:"
    yield {"kv_offload_redis_url": url, "kv_offload_redis_prefix": prefix}
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
        assert not list(client.scan_iter(f"{prefix}*"))


def test_engine_redis_tier_shares_only_within_a_salt(tiny, engines, redis9):
    ids = _prompt(3)
    writer = _make(engines, tiny, kv_offload_policy="write_through", **redis9)
    _run(writer, "w", ids, "a")
    assert writer.engine.kv_tiering.store.flush()
    with redis.Redis.from_url(redis9["kv_offload_redis_url"]) as client:
        assert list(client.scan_iter(f"{redis9['kv_offload_redis_prefix']}*"))  # it did write there
    reader = _make(engines, tiny, **redis9)  # a second replica: never saw the prompt, shares only Redis
    assert reader.engine.kv_tiering.locate(ids, "b")["redis"] == 0
    for salt in ("b", None):
        out = _run(reader, f"probe-{salt}", ids, salt)
        assert out.num_cached_tokens == 0 and out.stats.num_redis_cached_tokens == 0, salt
    assert reader.engine.reset_prefix_cache()
    out = _run(reader, "owner", ids, "a")
    assert out.stats.num_redis_cached_tokens == _full(ids) == out.num_cached_tokens


def test_salt_and_lease_options_are_checked_at_the_call(tiny, engines):
    from chatserve import AsyncLLMEngine
    from chatserve.core.cache_lease import CacheLease

    llm = _make(engines, tiny)
    engine = llm.engine
    for bad in ("", 5):
        with pytest.raises(PromptError, match="cache_salt") as err:
            engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, GREEDY, cache_salt=bad)  # type: ignore[arg-type]
        assert err.value.param == "cache_salt"
    for leases in ([CacheLease(16, 300)] * 5, [(16, 0)], [(-1, 300)], [(16, float("inf"))], [("16", 300)], [(16,)]):
        with pytest.raises(PromptError) as err:
            engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, GREEDY, cache_leases=leases)  # type: ignore[arg-type]
        assert err.value.param == "cache_leases", leases
    assert not engine.requests
    aengine = AsyncLLMEngine(engine)

    async def go():
        with pytest.raises(PromptError, match="cache_salt"):
            aengine.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, cache_salt="")
        outs = [o async for o in aengine.generate({"prompt_token_ids": _prompt(9)}, GREEDY, cache_salt="z",
                                                   cache_leases=[(64, 300)])]
        again = [o async for o in aengine.generate({"prompt_token_ids": _prompt(9)}, GREEDY, cache_salt="z")]
        other = [o async for o in aengine.generate({"prompt_token_ids": _prompt(9)}, GREEDY, cache_salt="y")]
        await aengine.shutdown()
        return outs[-1], again[-1], other[-1]

    first, again, other = asyncio.run(go())
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == _full(_prompt(9)) and other.num_cached_tokens == 0
    assert engine.stats()["num_prefix_leases"] == 1
