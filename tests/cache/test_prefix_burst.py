"""A burst of requests with one new shared prefix after prior traffic computes that prefix once.

The bug this guards (issue 22): an unrelated earlier chat caches the chat template's opening; the
first request of the burst copies those few tokens into its private block (a token-granular
partial hit) and so looks "ahead" of the shared block to the in-flight check, and every other
request admitted in the same step prefilled the whole prefix again.
"""

from __future__ import annotations

import random

import pytest

from chatserve import LLM, SamplingParams
from tests.helpers.net import HTTP

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _burst_prompts(rng: random.Random, opening: list[int], system_len: int, users: int) -> tuple[list[int], list[dict]]:
    """The template opening (cached by earlier traffic), a new system prompt, then a private question each."""
    system = [rng.randrange(100, 40000) for _ in range(system_len - len(opening))]
    shared = opening + system
    prompts = [{"prompt_token_ids": shared + [rng.randrange(100, 40000) for _ in range(12 + i)]} for i in range(users)]
    return shared, prompts


@pytest.mark.parametrize("users", [8, 16])
@pytest.mark.parametrize("system_len", [160, 171])  # on and off a block boundary
def test_burst_after_warmup_computes_the_shared_prefix_once(folder, users, system_len):
    rng = random.Random(users * 1000 + system_len)
    llm = LLM(folder, dtype="float32", num_kv_blocks=512, block_size=BLOCK, max_num_batched_tokens=4096)
    engine = llm.engine
    opening = [rng.randrange(100, 40000) for _ in range(5)]
    # warm-up: one unrelated chat that shares only the template opening (fewer tokens than a block)
    llm.generate({"prompt_token_ids": opening + [rng.randrange(100, 40000) for _ in range(40)]}, PARAMS)
    shared, prompts = _burst_prompts(rng, opening, system_len, users)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    before = engine.num_prefill_tokens_computed
    # the first step admits only the first request: everyone else needs the block it is computing
    outs = {out.request_id: out for out in engine.step() if out.finished}
    assert [s.request_id for s in engine.scheduler.running] == ["r0"]
    assert len(engine.scheduler.waiting) == users - 1
    steps = 1
    while engine.has_unfinished_requests() and steps < 200:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
    assert len(outs) == users
    cached = [outs[f"r{i}"].num_cached_tokens for i in range(users)]
    assert cached[0] == 5, cached  # only the opening, copied from the warm-up's block
    assert all(c >= len(shared) - BLOCK for c in cached[1:]), cached
    computed = engine.num_prefill_tokens_computed - before
    private = sum(len(p["prompt_token_ids"]) - len(shared) for p in prompts)
    assert computed <= len(shared) + private + users * BLOCK, (computed, cached)
    engine.check_integrity()


# ---- over HTTP -----------------------------------------------------------------------------------


def test_http_bursts_after_warmup_traffic_share_the_new_prefix(shared_server):
    """8 and 16 users, a system prompt on and off a block boundary, each burst after unrelated traffic
    that cached the shared opening: every request but one is served the shared prefix (less a block).

    On the session's shared server (block size 16, tests/conftest.py): its prefix cache may
    hold other modules' traffic, which shares no tokens with these random prompts."""
    from concurrent.futures import ThreadPoolExecutor


    server = shared_server
    model = HTTP.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()["data"][0]["id"]

    def complete(prompt: list[int]) -> dict:
        r = HTTP.post(f"{server.url}/v1/completions", headers=server.headers, timeout=300,
                       json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    rng = random.Random(22)
    opening = [rng.randrange(100, 30_000) for _ in range(5)]  # the chat template's common opening
    for users, system_len in ((8, 160), (8, 171), (16, 160), (16, 171)):
        complete(opening + [rng.randrange(100, 30_000) for _ in range(40)])  # an unrelated chat first
        shared, prompts = _burst_prompts(rng, opening, system_len, users)
        with ThreadPoolExecutor(users) as pool:
            usages = list(pool.map(lambda p: complete(p["prompt_token_ids"]), prompts))
        cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert all(c >= len(shared) - BLOCK for c in cached[1:]), (users, system_len, cached)
        assert all(u["chatserve"]["matched_tokens"] == u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    server.wait_idle()
