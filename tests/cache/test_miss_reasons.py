"""Why a request missed the prefix cache: each cause produced on purpose, in the tree, offline and over HTTP."""

from __future__ import annotations

import random

import pytest

from chatserve import LLM, SamplingParams
from chatserve.cache import BlockAllocator, RadixPrefixCache
from tests.helpers.net import HTTP
from tests.helpers.server import ServerProcess, start_server

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


# ---- the tree alone ------------------------------------------------------------------------------


def cached_tree(num_blocks: int = 16) -> tuple[BlockAllocator, RadixPrefixCache]:
    a = BlockAllocator(num_blocks)
    return a, RadixPrefixCache(a, BS)


def put(a: BlockAllocator, c: RadixPrefixCache, tokens: list[int]) -> None:
    need = len(tokens) // BS
    if a.num_free < need:
        c.evict(need - a.num_free)
    table = a.allocate(need)
    c.insert(tokens, table)
    a.decref(table)


def lookup(c: RadixPrefixCache, tokens: list[int]):
    m = c.match_prefix(tokens)
    p = c.match_partial(tokens, m)
    return c.explain_miss(tokens, m.num_tokens + (p.num_tokens if p else 0))


def test_tree_reports_each_reason():
    a, c = cached_tree()
    seen = toks(1, 12)
    assert lookup(c, seen).reason == "new"
    put(a, c, seen)
    assert lookup(c, seen).reason == "none"
    edited = seen[:6] + toks(2, 6)  # departs inside the second block
    why = lookup(c, edited)
    assert (why.reason, why.diverged_at) == ("diverged", 6)
    edited_on_boundary = seen[:8] + toks(3, 4)
    assert lookup(c, edited_on_boundary)[:2] == ("diverged", 8)
    assert lookup(c, toks(4, 12)).reason == "new"  # shares nothing: never held
    c.evict(16)
    assert lookup(c, seen).reason == "evicted"
    c.reset()  # a reset forgets: the next run starts cold
    assert lookup(c, seen).reason == "new"
    c.check_integrity({})


def test_eviction_record_is_bounded():
    a = BlockAllocator(4)
    c = RadixPrefixCache(a, BS, eviction_memory_blocks=3)
    first = toks(1, 8)
    put(a, c, first)
    for i in range(6):  # each evicts the previous two blocks: 12 remembered, only 3 kept
        put(a, c, toks(10 + i, 8))
    assert lookup(c, first).reason == "new"
    assert len(c._evicted) == 3


# ---- offline, through the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_engine_reports_each_reason_on_the_request_record(folder):
    llm = LLM(folder, dtype="float32", num_kv_blocks=12, block_size=16, max_num_seqs=2)
    seen = {"prompt_token_ids": toks(1, 65)}  # 4 whole blocks + the last token: all of it cacheable
    first = llm.generate(seen, PARAMS)[0]
    assert (first.stats.cache_miss_reason, first.num_cached_tokens) == ("new", 0)
    again = llm.generate(seen, PARAMS)[0]
    assert (again.stats.cache_miss_reason, again.num_cached_tokens) == ("none", 64)
    edited = {"prompt_token_ids": seen["prompt_token_ids"][:37] + toks(2, 28)}
    out = llm.generate(edited, PARAMS)[0]
    assert (out.stats.cache_miss_reason, out.stats.cache_diverged_at, out.num_cached_tokens) == ("diverged", 37, 37)
    for i in range(4):  # unrelated traffic pushes `seen` out of the 12-block pool
        llm.generate({"prompt_token_ids": toks(100 + i, 65)}, PARAMS)
    back = llm.generate(seen, PARAMS)[0]
    assert back.stats.cache_miss_reason == "evicted" and back.num_cached_tokens == 0
    reasons = llm.engine.stats()["prefix_cache_miss_reasons"]
    assert reasons == {"none": 1, "new": 5, "evicted": 1, "diverged": 1, "skipped": 0}
    assert not first.stats.cache_lease_hit and first.stats.session_history_matched is None
    llm.engine.check_integrity()


# ---- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    # a small pool (in tokens) so a few long prompts evict the first one
    srv = start_server("--max-model-len", "512", "--num-kv-blocks", "40", "--block-size", "16",
                       "--max-num-seqs", "2")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _complete(srv: ServerProcess, prompt: list[int]) -> dict:
    model = HTTP.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = HTTP.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_http_usage_reports_each_reason_and_metrics_count_them(server):
    model = HTTP.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model
    before = server.metrics()
    seen = toks(7, 193)  # 12 whole blocks + the last token
    u = _complete(server, seen)
    assert u["chatserve"]["miss_reason"] == "new" and u["chatserve"]["matched_tokens"] == 0
    u = _complete(server, seen)
    assert u["chatserve"] == {"matched_tokens": 192, "miss_reason": "none", "diverged_at": None, "lease_hit": False,
                              "session_history_matched": None,
                              "tiers": {"memory": 192, "disk": 0, "redis": 0, "tier_miss_reason": None}}
    assert u["prompt_tokens_details"]["cached_tokens"] == 192
    u = _complete(server, seen[:90] + toks(8, 103))
    assert (u["chatserve"]["miss_reason"], u["chatserve"]["diverged_at"], u["chatserve"]["matched_tokens"]) == (
        "diverged", 90, 90)
    for i in range(4):  # 4 x 13 blocks of unrelated prompts through a 40-block pool
        _complete(server, toks(200 + i, 193))
    u = _complete(server, seen)
    assert u["chatserve"]["miss_reason"] == "evicted"
    after = server.wait_idle()

    def delta(reason: str) -> float:
        key = f'chatserve:prefix_cache_miss_reason_total{{model_name="{model}",reason="{reason}"}}'
        return after[key] - before.get(key, 0.0)

    assert [delta(r) for r in ("new", "none", "diverged", "evicted")] == [5, 1, 1, 1]
