"""Prefix reuse through the engine: shared system prompts, multi-turn chats, bursts, eviction."""

from __future__ import annotations

import random

import pytest

from chatserve import LLM, SamplingParams
from chatserve.llm import apply_chat_template

SYSTEM = " ".join(
    f"Rule {i}: when the user asks about topic {i}, answer politely, cite source {i * 7 % 13}, and keep it short."
    for i in range(40)
)


def _system_ids(tok) -> list[int]:
    return apply_chat_template(tok, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)


def test_shared_system_prompt_is_reused(llm_default):
    llm = llm_default
    tok = llm.get_tokenizer()
    bs = llm.engine.block_manager.block_size
    assert llm.engine.reset_prefix_cache()
    prefix = _system_ids(tok)
    assert len(prefix) >= 700
    questions = ["What is topic 3?", "Tell me about topic 11.", "Summarise rule 7.", "Which source for topic 20?"]
    outs = []
    for q in questions:
        conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        outs.append(llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=4))[0])
    assert outs[0].num_cached_tokens == 0
    for out in outs[1:]:
        assert out.prompt_token_ids[: len(prefix)] == prefix
        assert out.num_cached_tokens >= len(prefix) - bs
    llm.engine.check_integrity()


def test_three_turn_conversation_reuses_whole_history(llm_default):
    llm = llm_default
    tok = llm.get_tokenizer()
    bs = llm.engine.block_manager.block_size
    assert llm.engine.reset_prefix_cache()
    ids = apply_chat_template(tok, [{"role": "user", "content": "Name a fruit."}])
    history_len = 0  # prompt + reply tokens of the previous turn
    for turn, msg in enumerate(["And a vegetable?", "And a colour?", "Thanks!"]):
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=12))[0]
        if turn > 0:
            # the whole previous turn (its prompt and its reply) came from the cache
            assert out.num_cached_tokens >= history_len - bs
        reply = out.outputs[0].token_ids
        follow = tok.encode(f"<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        if reply and reply[-1] == tok.convert_tokens_to_ids("<|im_end|>"):
            follow = follow[1:]  # the reply already ended the assistant turn
        history_len = len(ids) + len(reply)
        ids = ids + reply + follow
    llm.engine.check_integrity()


def test_cache_on_and_off_give_identical_tokens(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 40))]} for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for enabled in (True, False):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=256, enable_prefix_caching=enabled)
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
        results[enabled] = [o.outputs[0].token_ids for o in first + rest]
        cached = [o.num_cached_tokens for o in rest]
        if enabled:
            assert all(c >= 64 for c in cached)
        else:
            assert all(c == 0 for c in cached)
        llm.engine.check_integrity()
    assert results[True] == results[False]


def test_burst_with_new_shared_prefix_computes_it_once(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=512, max_num_batched_tokens=4096)
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(300)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(100, 40000) for _ in range(30)]} for _ in range(16)]
    before = llm.engine.stats()["num_prefill_tokens_computed"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    computed = llm.engine.stats()["num_prefill_tokens_computed"] - before
    # one prefill of the shared part plus the 16 private suffixes (and partial blocks), not 16 prefills
    assert computed <= 330 + 16 * (30 + 16)
    assert sum(o.num_cached_tokens >= 288 for o in outs) == 15
    # and the outputs are those of the requests run one at a time without a cache
    alone = LLM(str(folder), dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    ref = alone.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_tiny_budget_evicts_and_never_leaks(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=20, block_size=16, max_num_seqs=4)
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(10, 90))]} for _ in range(40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    stats = llm.engine.stats()
    assert stats["prefix_cache_evicted_blocks"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
    assert stats["num_locked_blocks"] == 0
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="blocks"):
        llm.generate({"prompt_token_ids": list(range(100, 100 + 20 * 16))}, SamplingParams(max_tokens=1))


def test_reset_prefix_cache_empties_the_tree_but_refuses_while_a_request_runs(tiny_checkpoint):
    """Benchmarks start each scenario cold through this public call (no reaching into the block
    manager); while a request runs its blocks are in use, so the reset must change nothing."""
    folder = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=16)
    engine = llm.engine
    rng = random.Random(5)
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(50)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    assert first.num_cached_tokens == 0
    cached = engine.stats()["num_cached_blocks"]
    assert cached >= 3  # the prompt's full blocks stay in the tree

    engine.add_request("running", prompt, params)
    engine.step()
    before = engine.stats()
    assert before["num_running"] == 1
    assert engine.reset_prefix_cache() is False
    assert engine.stats() == before, "a refused reset must change nothing"
    while engine.has_unfinished_requests():
        engine.step()

    assert engine.reset_prefix_cache() is True
    stats = engine.stats()
    assert stats["num_cached_blocks"] == stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.check_integrity()
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0, "the prompt's blocks must be gone from the cache"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
