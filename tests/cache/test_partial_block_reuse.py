"""Copy-on-write reuse of a partially matching cached block, through the engine."""

from __future__ import annotations

import random

import pytest

from chatserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_returned(llm: LLM) -> None:
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
    assert not llm.engine.block_manager._pending_copies


def test_shared_prefix_of_two_and_a_half_blocks_is_reused_token_exact(folder):
    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(40)]  # 2.5 blocks of 16
    prompts = [
        {"prompt_token_ids": shared + [1000 + 7 * i] + [rng.randrange(100, 40000) for _ in range(5 + 3 * i)]}
        for i in range(4)
    ]
    results = {}
    for enabled in (True, False):
        llm = LLM(folder, dtype="float32", num_kv_blocks=64, enable_prefix_caching=enabled)
        outs = [llm.generate(p, GREEDY)[0] for p in prompts]  # one at a time: each finds the last cached
        results[enabled] = _tokens(outs)
        if enabled:
            assert outs[0].num_cached_tokens == 0
            assert [o.num_cached_tokens for o in outs[1:]] == [40, 40, 40]  # not 32
            stats = llm.engine.stats()
            assert stats["prefix_cache_hits_tokens"] == 120
        _assert_all_returned(llm)
    assert results[True] == results[False]


def test_partial_reuse_never_covers_the_last_prompt_token(folder):
    rng = random.Random(6)
    cached = [rng.randrange(100, 40000) for _ in range(50)]
    llm = LLM(folder, dtype="float32", num_kv_blocks=64)
    ref = LLM(folder, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.generate({"prompt_token_ids": cached}, GREEDY)[0].num_cached_tokens == 0
    # prompts that are prefixes of the cached one: everything but the last token comes from the cache
    for n in (33, 36, 40, 41, 48):
        prompt = {"prompt_token_ids": cached[:n]}
        out = llm.generate(prompt, GREEDY)[0]
        assert out.num_cached_tokens == n - 1
        assert _tokens([out]) == _tokens(ref.generate(prompt, GREEDY))
        _assert_all_returned(llm)


def test_partial_reuse_is_skipped_when_no_block_is_free_and_undone_on_release(folder):
    rng = random.Random(8)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    llm = LLM(folder, dtype="float32", num_kv_blocks=8, max_num_seqs=4)
    bm = llm.engine.block_manager
    llm.generate({"prompt_token_ids": shared + list(range(200, 210))}, GREEDY)  # caches 3 blocks
    llm.engine.add_request("x", {"prompt_token_ids": shared + [13, 14]}, GREEDY)
    seq = llm.engine.requests["x"].seqs[0]
    # no free block, and the only cached ones are the match (locked) and the copy source (pinned)
    hog = bm.allocator.allocate(bm.num_free_blocks)
    assert bm.match_and_lock(seq) == 32
    assert bm.reuse_partial_block(seq) == 0
    assert not bm._pending_copies and len(seq.block_table) == 2
    bm.release(seq, keep_in_cache=False)
    bm.allocator.decref(hog)
    # with room: the copy is pending; an undone admission gives back the pin and the block
    free = bm.num_free_blocks
    assert bm.match_and_lock(seq) == 32
    assert bm.reuse_partial_block(seq) == 8
    src, dst, k = bm._pending_copies[seq.seq_id]
    assert k == 8 and seq.block_table[-1] == dst and bm.allocator.ref_count(src) == 2
    llm.engine.check_integrity()
    bm.release(seq, keep_in_cache=False)
    assert not bm._pending_copies and bm.allocator.ref_count(src) == 1 and bm.num_free_blocks == free
    llm.engine.abort_request("x")
    _assert_all_returned(llm)


def _run_stepwise(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit in waves and check the cache invariants at every step boundary."""
    engine = llm.engine
    outs: dict[str, list[int]] = {}
    ids = [f"r{i}" for i in range(len(prompts))]
    pending = list(zip(ids, prompts))
    rng = random.Random(len(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4) if engine.has_unfinished_requests() else 1):
            if pending:
                rid, p = pending.pop(0)
                engine.add_request(rid, {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
    return [outs[r] for r in ids]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_matches_cache_off(folder, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 70))] for _ in range(3)]
    prompts = []
    for _ in range(24):
        base = rng.choice(prefixes)
        cut = rng.randrange(1, len(base) + 1)
        prompts.append(base[:cut] + [rng.randrange(100, 40000) for _ in range(rng.randrange(0, 20))])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    on = LLM(folder, dtype="float32", num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    got = _run_stepwise(on, prompts, params)
    assert on.engine.block_manager.num_block_copies > 0
    _assert_all_returned(on)
    off = LLM(folder, dtype="float32", num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    assert got == _run_stepwise(off, prompts, params)
