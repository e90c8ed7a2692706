"""Prefix leases (Anthropic cache_control breakpoints, OpenAI prompt_cache_key): the prefix of a prompt
up to a breakpoint is leased for its TTL, keyed by its block-hash chain and salt, renewed by each hit,
within a cap (--max-prefix-leased-blocks) past which the least recently renewed lease is dropped and
counted. Built on the session lease machinery: soft (leased blocks go last, never at a request's cost).

Every expiry here runs on an injected clock: no sleeps, no wall-clock assertions.
"""

from __future__ import annotations

import random

import pytest

from chatserve.cache import BlockAllocator, PrefixKey, RadixPrefixCache
from chatserve.cache.kv_events import event_hashes

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 16, cap: int | None = None) -> tuple[BlockAllocator, RadixPrefixCache, FakeClock]:
    clock = FakeClock()
    a = BlockAllocator(num_blocks)
    return a, RadixPrefixCache(a, BS, clock=clock, max_prefix_leased_blocks=cap), clock


def finish(a: BlockAllocator, c: RadixPrefixCache, tokens: list[int], *, salt: str | None = None,
           leases: tuple[tuple[int, float], ...] = (), session: tuple[str, float] | None = None) -> int:
    """One request run to the end (as the block manager does it): match, compute the rest, insert, lease
    the asked prefixes, release. Returns how many tokens it matched."""
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
    for position, ttl in leases:
        c.lease_prefix(tokens[: position // BS * BS], ttl, salt=salt)
    if session is not None:
        c.set_lease(session[0], r.node, session[1])
    c.unlock(r.node)
    a.decref(table)
    return m.num_tokens


def toks(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 10_000) for _ in range(n_blocks * BS)]


def flood(a: BlockAllocator, c: RadixPrefixCache, first_seed: int, rounds: int = 8) -> None:
    """One-off prompts that turn the whole pool over (everything unleased is evicted)."""
    for i in range(rounds):
        finish(a, c, toks(first_seed + i, 3))
        c.check_integrity({})


def key_of(tokens: list[int], salt: str | None = None) -> PrefixKey:
    n = len(tokens) // BS
    return PrefixKey(salt, event_hashes(tokens, BS, n, salt)[-1])


def test_a_leased_prefix_is_a_hit_within_its_ttl_and_not_after():
    a, c, clock = make(12)
    system = toks(1, 3)
    other = toks(2, 3)  # the same shape of traffic, unleased
    finish(a, c, system + toks(3, 1), leases=((3 * BS, 300),))
    finish(a, c, other + toks(4, 1))
    assert c.lease_info(key_of(system)) == (3 * BS, clock.t + 300)
    clock.t += 299
    flood(a, c, 100)
    assert c.match_prefix(other).num_tokens == 0  # churned
    assert c.peek_prefix(system) == 3 * BS  # kept by the lease
    clock.t += 301 + 300  # past the end (the match above renewed it to 299 + 300)
    flood(a, c, 200)
    assert c.peek_prefix(system) == 0
    assert c.lease_info(key_of(system)) is None
    c.check_integrity({})


def test_each_hit_renews_the_lease():
    a, c, clock = make(12)
    system = toks(1, 2)
    start = clock.t
    finish(a, c, system + toks(3, 1), leases=((2 * BS, 300),))
    for step in range(1, 5):  # a hit every 250 s keeps it alive well past its first 300 s
        clock.t = start + 250 * step
        flood(a, c, 100 * step)
        assert finish(a, c, system + toks(50 + step, 1)) == 2 * BS, step
        assert c.lease_info(key_of(system)).expires_at == clock.t + 300
    assert c.num_prefix_lease_renewals == 4
    clock.t += 301
    flood(a, c, 900)
    assert c.peek_prefix(system) == 0
    c.check_integrity({})


def test_the_same_prefix_leased_again_is_one_lease_with_the_longer_ttl():
    a, c, clock = make(16)
    system = toks(1, 2)
    finish(a, c, system + toks(2, 1), leases=((2 * BS, 3600),))
    clock.t += 10
    finish(a, c, system + toks(3, 1), leases=((2 * BS, 300),))  # a 5m breakpoint never shortens a 1h lease
    leases = c.prefix_leases()
    assert len(leases) == 1 and leases[0][0] == key_of(system)
    assert leases[0][1].expires_at == clock.t + 3600  # (the second request's hit renewed it, by its own 1h TTL)
    assert c.stats().prefix_leases == 1 and c.stats().prefix_leased == 2
    end = leases[0][1].expires_at
    clock.t += 10
    assert c.lease_prefix(system, 300) == key_of(system)  # leased again with a shorter TTL, and no hit
    assert c.lease_info(key_of(system)).expires_at == end
    c.check_integrity({})


def test_nested_breakpoints_count_their_blocks_once():
    a, c, _ = make(16, cap=4)
    prompt = toks(1, 4)
    finish(a, c, prompt + toks(2, 1), leases=((BS, 300), (2 * BS, 300), (4 * BS + 3, 300)))  # 1, 2 and 4 blocks
    s = c.stats()
    assert s.prefix_leases == 3 and s.prefix_leased == 4 and c.num_prefix_leases_dropped == 0
    c.check_integrity({})


def test_past_the_cap_the_least_recently_renewed_lease_is_dropped_and_counted():
    a, c, clock = make(16, cap=5)
    p1, p2, p3 = toks(1, 2), toks(2, 2), toks(3, 2)
    finish(a, c, p1 + toks(11, 1), leases=((2 * BS, 300),))
    clock.t += 1
    finish(a, c, p2 + toks(12, 1), leases=((2 * BS, 300),))
    clock.t += 1
    finish(a, c, p1 + toks(13, 1))  # a hit renews p1: p2 is now the least recently renewed
    finish(a, c, p3 + toks(14, 1), leases=((2 * BS, 300),))  # 6 blocks > 5: one lease goes
    assert [k for k, _ in c.prefix_leases()] == [key_of(p1), key_of(p3)]
    assert c.num_prefix_leases_dropped == 1 and c.num_prefix_leased_dropped_blocks == 2
    assert c.stats().prefix_leased == 4
    flood(a, c, 100, rounds=10)
    assert c.peek_prefix(p1) == c.peek_prefix(p3) == 2 * BS
    assert c.peek_prefix(p2) == 0
    c.check_integrity({})


def test_a_lease_larger_than_the_cap_is_dropped_itself_and_a_zero_cap_leases_nothing():
    a, c, _ = make(16, cap=2)
    small, big = toks(1, 2), toks(2, 3)
    finish(a, c, small + toks(3, 1), leases=((2 * BS, 300),))
    assert c.lease_prefix(big, 300) is None  # (not in the tree yet)
    finish(a, c, big + toks(4, 1), leases=((3 * BS, 300),))
    assert c.num_prefix_leases_dropped == 2  # the older one first, then the one that alone exceeds the cap
    assert c.stats().prefix_leases == 0 and c.stats().prefix_leased == 0
    a0, c0, _ = make(16, cap=0)
    finish(a0, c0, small + toks(3, 1), leases=((2 * BS, 300),))
    assert c0.stats().prefix_leases == 0 and c0.num_prefix_leases_dropped == 1
    c.check_integrity({})
    c0.check_integrity({})


def test_sessions_do_not_count_in_the_cap_and_salts_key_their_own_leases():
    a, c, _ = make(24, cap=2)
    finish(a, c, toks(1, 4), session=("sess", 600))  # 4 session-leased blocks
    shared = toks(2, 2)
    for salt in ("x", "y"):
        finish(a, c, shared + toks(3, 1), salt=salt, leases=((2 * BS, 300),))
    # same tokens, two salts: two leases of two blocks each, the cap of 2 keeps only the newer
    assert [k for k, _ in c.prefix_leases()] == [key_of(shared, "y")]
    assert key_of(shared, "x") != key_of(shared, "y") != key_of(shared)
    s = c.stats()
    assert s.leased == 6 and s.prefix_leased == 2 and c.lease_info("sess") is not None
    c.check_integrity({})


def test_leases_are_soft_a_request_needing_all_memory_still_gets_it():
    a, c, _ = make(8)
    finish(a, c, toks(1, 4) + toks(2, 1), leases=((4 * BS, 3600),))
    assert c.evict(8) == 5  # every block the tree holds, the leased ones included
    assert a.num_free == a.num_total and c.num_leased_evicted_blocks >= 4
    assert c.stats().prefix_leases == 0 and c.stats().prefix_leased == 0  # nothing left to protect
    c.check_integrity({})


def test_random_workload_with_sessions_prefix_leases_and_salts_keeps_every_invariant():
    rng = random.Random(5)
    a, c, clock = make(24, cap=7)
    stems = [toks(s, 2) for s in range(4)]
    for _ in range(400):
        clock.t += rng.random() * 40
        salt = rng.choice((None, "p", "q"))
        tokens = rng.choice(stems) + toks(rng.randrange(60), rng.randrange(0, 4))
        op = rng.random()
        if op < 0.1:
            c.release_lease(f"s{rng.randrange(4)}")
        elif op < 0.15:
            c.evict(rng.randrange(1, 6))
        elif op < 0.2 and c.prefix_leases():
            c.release_lease(rng.choice(c.prefix_leases())[0])
        else:
            leases = tuple((rng.randrange(len(tokens) + 3), rng.choice((300.0, 3600.0)))
                           for _ in range(rng.randrange(0, 5)))
            session = (f"s{rng.randrange(4)}", rng.uniform(1, 100)) if rng.random() < 0.3 else None
            finish(a, c, tokens, salt=salt, leases=leases, session=session)
        c.check_integrity({})
        assert c.stats().prefix_leased <= 7
    c.reset()
    assert a.num_free == a.num_total and len(c._leases) == 0 and c.stats().prefix_leased == 0


# ---- through the engine --------------------------------------------------------------------------

EBS = 16


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _engine(tiny: str, clock: FakeClock, **kw):
    from chatserve import EngineArgs
    from chatserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs.from_env(model=tiny, dtype="float32", block_size=EBS, num_kv_blocks=24, max_num_seqs=2, **kw),
                     clock=clock)


def _run(engine, rid: str, ids: list[int], **kw):
    from chatserve import SamplingParams

    engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), **kw)
    for _ in range(200):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                engine.check_integrity()
                return out
    raise AssertionError(f"{rid} did not finish")


def _ids(seed: int | str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


def _flood(engine, tag: str) -> None:
    """12 one-off prompts of 4 blocks each through a 24-block pool: every unleased block is evicted."""
    for i in range(12):
        _run(engine, f"{tag}-{i}", _ids(f"{tag}-{i}", 64))


def test_engine_cache_control_lease_survives_a_flood_within_its_ttl_and_not_after(tiny):
    from chatserve.core.cache_lease import CacheLease

    clock = FakeClock()
    engine = _engine(tiny, clock)
    system, unleased = _ids(1, 48), _ids(2, 48)  # three blocks each
    out = _run(engine, "first", system + _ids(3, 10), cache_leases=[CacheLease(48, 300)])
    assert out.num_cached_tokens == 0
    _run(engine, "control", unleased + _ids(4, 10))
    assert engine.stats()["num_prefix_leases"] == 1 and engine.stats()["num_prefix_leased_blocks"] == 3
    clock.t += 200
    _flood(engine, "f1")
    hit = _run(engine, "hit", system + _ids(5, 10))  # no lease asked: the hit alone renews it
    assert hit.num_cached_tokens == 48 and hit.stats.cache_lease_hit
    assert _run(engine, "control-again", unleased + _ids(6, 10)).num_cached_tokens == 0
    clock.t += 250  # 450 s after the lease was set: alive only because the hit renewed it
    _flood(engine, "f2")
    assert _run(engine, "renewed", system + _ids(7, 10)).num_cached_tokens == 48
    stats = engine.stats()
    assert stats["prefix_cache_prefix_lease_renewals"] == 2 and stats["prefix_cache_prefix_leases_set"] == 1
    clock.t += 301  # past the last renewal's end
    _flood(engine, "f3")
    gone = _run(engine, "expired", system + _ids(8, 10))
    assert gone.num_cached_tokens == 0 and gone.stats.cache_miss_reason == "evicted"
    stats = engine.stats()
    assert stats["num_prefix_leases"] == 0 and stats["num_prefix_leased_blocks"] == 0
    assert stats["num_preemptions"] == 0


def test_engine_prompt_cache_key_lease_of_the_whole_prompt_and_its_salt(tiny):
    clock = FakeClock()
    engine = _engine(tiny, clock)
    prompt = _ids(10, 70)  # a prompt_cache_key lease: the whole prompt (4 full blocks)
    _run(engine, "k", prompt, cache_salt="user-1", cache_leases=[(len(prompt), 3600)])
    _flood(engine, "f")
    assert _run(engine, "other-salt", prompt, cache_salt="user-2").num_cached_tokens == 0
    assert _run(engine, "same-salt", prompt, cache_salt="user-1").num_cached_tokens == 64


def test_engine_cap_overflow_drops_the_oldest_lease_and_counts_it(tiny):
    from prometheus_client import generate_latest

    from chatserve.server.metrics import ServerMetrics

    clock = FakeClock()
    engine = _engine(tiny, clock, max_prefix_leased_blocks=4)
    first, second = _ids(20, 48), _ids(21, 48)
    _run(engine, "a", first + _ids(22, 5), cache_leases=[(48, 300)])
    clock.t += 1
    _run(engine, "b", second + _ids(23, 5), cache_leases=[(48, 300)])  # 3 + 3 > 4: "a"'s lease goes
    stats = engine.stats()
    assert stats["prefix_cache_prefix_leases_dropped"] == 1 and stats["prefix_cache_prefix_leased_dropped_blocks"] == 3
    assert stats["num_prefix_leases"] == 1 and stats["max_prefix_leased_blocks"] == 4
    _flood(engine, "f")
    assert _run(engine, "b2", second + _ids(24, 5)).num_cached_tokens == 48
    assert _run(engine, "a2", first + _ids(25, 5)).num_cached_tokens == 0
    text = generate_latest(ServerMetrics(engine.stats, "tiny").registry).decode()
    assert 'chatserve:prefix_cache_prefix_leases_dropped_total{model_name="tiny"} 1.0' in text
    assert 'chatserve:kv_cache_prefix_leased_blocks{model_name="tiny"} 3.0' in text
    assert 'chatserve:kv_cache_max_prefix_leased_blocks{model_name="tiny"} 4.0' in text


def test_default_cap_is_half_the_pool_and_the_flag_is_checked(tiny):
    from chatserve import EngineArgs

    engine = _engine(tiny, FakeClock())
    assert engine.stats()["max_prefix_leased_blocks"] == 12
    with pytest.raises(ValueError, match="max_prefix_leased_blocks"):
        EngineArgs(max_prefix_leased_blocks=-1)
