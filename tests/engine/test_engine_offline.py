"""Behaviour of the offline API (`LLM.generate` / `LLM.chat`) and of `LLMEngine` driven step by step.

Most tests run a tiny random Llama checkpoint (fast, float32); only those where real text matters
(stop strings, EOS, CJK / emoji) use the session's default model `llm_default` (default dtype and
quantization; the assertions hold whatever the numerics phrase).
"""

from __future__ import annotations

import random

import pytest

from chatserve import LLM, SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# A step cap for loops that drive the engine by hand: a livelock fails the test instead of hanging it.
MAX_STEPS = 2000


def random_prompts(rng: random.Random, count: int, lo: int, hi: int) -> list[dict]:
    """Random token-id prompts; ids from the plain (non-special) part of the SmolLM2 vocabulary."""
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]} for _ in range(count)]


def assert_engine_idle(llm: LLM) -> None:
    """Nothing in flight, every block free or cached (evictable), no lock left, invariants hold."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]


def drive(engine, *, check_every_step: bool = True) -> dict[str, list]:
    """Step the engine until idle; return every output per request id, in order."""
    seen: dict[str, list] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        if check_every_step:
            engine.check_integrity()
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps (livelock?): {engine.stats()}")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(str(tiny), dtype="float32")


# ---------------------------------------------------------------------------------------------
# 1. seeded sampling
# ---------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_llm):
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(23)]}
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)

    alone = tiny_llm.generate(prompt, seeded)[0].outputs[0].token_ids
    again = tiny_llm.generate(prompt, seeded)[0].outputs[0].token_ids
    assert len(alone) == 12
    assert again == alone

    # Same request among neighbours: unseeded sampling, greedy, other seeds, other lengths; at
    # different rows of the batch.
    others = random_prompts(rng, 5, 3, 40)
    neighbour_params = [
        SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=15),
        SamplingParams(temperature=0.7, top_p=0.9, seed=99, max_tokens=5),
        SamplingParams(temperature=1.3, top_k=20, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=3),
    ]
    batch = [others[0], others[1], prompt, others[2], others[3], others[4]]
    params = neighbour_params[:2] + [seeded] + neighbour_params[2:]
    outs = tiny_llm.generate(batch, params)
    assert outs[2].outputs[0].token_ids == alone
    outs = tiny_llm.generate([prompt] + others, [seeded] + neighbour_params)
    assert outs[0].outputs[0].token_ids == alone

    # Different seeds: (almost surely) different continuations.
    variants = {
        tuple(tiny_llm.generate(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True))[0]
              .outputs[0].token_ids)
        for s in (1, 2)
    }
    variants.add(tuple(alone))
    assert len(variants) == 3
    assert_engine_idle(tiny_llm)


def test_seeded_n3_gives_indexes_0_to_2_reproducibly(tiny_llm):
    prompt = {"prompt_token_ids": list(range(500, 517))}
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = tiny_llm.generate(prompt, params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in first.outputs)
    assert len({tuple(o.token_ids) for o in first.outputs}) >= 2  # the 3 samples are not copies
    second = tiny_llm.generate([{"prompt_token_ids": [300, 301, 302]}, prompt], [SamplingParams(max_tokens=4), params])[1]
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    assert_engine_idle(tiny_llm)


# ---------------------------------------------------------------------------------------------
# 2. stopping: stop strings, stop tokens, max_tokens, EOS, ignore_eos (real text: default model)
# ---------------------------------------------------------------------------------------------

SKY = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
SHORT = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]


@pytest.fixture(scope="module")
def sky_runs(llm_default):
    """The greedy answer to SKY, then (in one batch) the same prompt with each way of stopping."""
    tok = llm_default.get_tokenizer()
    # ignore_eos: 24 tokens whatever the dtype's answer (a short one must not fail the stop tests)
    base = llm_default.chat(SKY, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    full, toks = base.text, base.token_ids
    assert len(toks) == 24 and base.finish_reason == "length"
    mid = len(full) // 2
    stop = full[mid : mid + 6]
    assert stop.strip(), f"pick a stop string with visible text, got {stop!r}"
    stop_id = toks[4]
    variants = {
        "stop_str": SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True),
        "stop_str_incl": SamplingParams(temperature=0.0, max_tokens=24, stop=stop, include_stop_str_in_output=True,
                                        ignore_eos=True),
        "stop_token": SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
        "length": SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    }
    outs = llm_default.chat([SKY] * len(variants), list(variants.values()))
    runs = {name: out.outputs[0] for name, out in zip(variants, outs)}
    return {"tok": tok, "full": full, "toks": toks, "stop": stop, "stop_id": stop_id, **runs}


def test_stop_string_cuts_text_before_it(sky_runs):
    full, stop, toks, tok = sky_runs["full"], sky_runs["stop"], sky_runs["toks"], sky_runs["tok"]
    at = full.find(stop)
    out = sky_runs["stop_str"]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:at]
    # The same greedy tokens, up to the token that completed the stop string.
    n = len(out.token_ids)
    assert out.token_ids == toks[:n]
    assert stop in tok.decode(toks[:n]) and stop not in tok.decode(toks[: n - 1])

    incl = sky_runs["stop_str_incl"]
    assert incl.finish_reason == "stop" and incl.stop_reason == stop
    assert incl.text == full[: at + len(stop)]
    assert incl.token_ids == out.token_ids


def test_stop_token_id_ends_generation_there(sky_runs):
    toks, stop_id = sky_runs["toks"], sky_runs["stop_id"]
    k = toks.index(stop_id)  # its first occurrence (it is the 5th token, maybe also earlier)
    out = sky_runs["stop_token"]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == toks[: k + 1]  # the stop token is kept in token_ids, as in vLLM
    assert sky_runs["full"].startswith(out.text)


def test_stop_token_text_excluded_like_vllm(sky_runs):
    toks, tok = sky_runs["toks"], sky_runs["tok"]
    k = toks.index(sky_runs["stop_id"])
    assert sky_runs["stop_token"].text == tok.decode(toks[:k], skip_special_tokens=True)


def test_max_tokens_finishes_with_length(sky_runs):
    out, toks, tok = sky_runs["length"], sky_runs["toks"], sky_runs["tok"]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == toks[:7]
    assert out.text == tok.decode(toks[:7], skip_special_tokens=True)


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(llm_default):
    eos_ids = llm_default.engine.eos_token_ids
    base = llm_default.chat(SHORT, SamplingParams(temperature=0.0, max_tokens=200))[0].outputs[0]
    assert base.finish_reason == "stop" and base.stop_reason is None
    assert base.token_ids[-1] in eos_ids and not set(base.token_ids[:-1]) & eos_ids
    assert base.text == llm_default.get_tokenizer().decode(base.token_ids, skip_special_tokens=True)
    n = len(base.token_ids)
    out = llm_default.chat(SHORT, SamplingParams(temperature=0.0, max_tokens=n + 4, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == n + 4
    assert out.token_ids[:n] == base.token_ids  # ran straight through the EOS token
    assert_engine_idle(llm_default)


def test_min_tokens_masks_eos(llm_default):
    eos_ids = llm_default.engine.eos_token_ids
    out = llm_default.chat(SHORT, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10))[0].outputs[0]
    assert not set(out.token_ids[:10]) & eos_ids


# ---------------------------------------------------------------------------------------------
# 3. CJK and emoji text through the chat template
# ---------------------------------------------------------------------------------------------


def test_chinese_and_emoji_text_is_clean_utf8(llm_default):
    tok = llm_default.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "介绍一下北京的旅游景点"}],
        [{"role": "user", "content": "Reply only with emoji: how do you feel today? 😀🎉🌍"}],
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40),
    ]
    outs = llm_default.chat(conversations, params)
    for out in outs:
        o = out.outputs[0]
        # the final text is the decode of every token; a budget that cuts a character leaves its
        # partial bytes as trailing U+FFFD (as vLLM does); anywhere else one means a split character
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        body = o.text.rstrip(REPLACEMENT_CHAR) if o.finish_reason == "length" else o.text
        assert REPLACEMENT_CHAR not in body
    assert any("\u4e00" <= ch <= "\u9fff" for ch in outs[0].outputs[0].text)
    assert_engine_idle(llm_default)


# ---------------------------------------------------------------------------------------------
# 4. errors
# ---------------------------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len(tiny):
    llm = LLM(str(tiny), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
        llm.generate({"prompt_token_ids": list(range(100, 140))})
    with pytest.raises(ValueError, match="no room for a reply"):  # one position must stay free for the reply
        llm.generate({"prompt_token_ids": list(range(100, 132))})
    out = llm.generate({"prompt_token_ids": list(range(100, 131))}, SamplingParams(max_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # the context is full after one token
    assert_engine_idle(llm)


def test_prompt_needing_more_blocks_than_the_pool(tiny):
    prompt = {"prompt_token_ids": list(range(100, 140))}
    # Without max_model_len, the context is capped by the pool (2 x 16 = 32 tokens).
    llm = LLM(str(tiny), dtype="float32", num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match=r"maximum context length is 32 tokens \(limited by the KV pool"):
        llm.generate(prompt)
    # With a larger max_model_len, the block check itself speaks (at load or at admission).
    with pytest.raises(ValueError, match="(?i)blocks"):
        llm = LLM(str(tiny), dtype="float32", num_kv_blocks=2, block_size=16, max_model_len=512)
        llm.generate(prompt)


def test_request_outgrowing_the_pool_does_not_hang(tiny):
    try:
        llm = LLM(str(tiny), dtype="float32", num_kv_blocks=2, block_size=16, max_model_len=512)
        llm.engine.add_request(
            "grow", {"prompt_token_ids": list(range(100, 120))}, SamplingParams(temperature=0.0, max_tokens=30)
        )
    except ValueError:
        return  # rejected up front: also fine
    engine = llm.engine
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), engine.stats()


def test_invalid_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_unsupported_architecture(tmp_path, smollm_tokenizer):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(smollm_tokenizer), architectures=["GPT2LMHeadModel"])
    config.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), dtype="float32")
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg


def test_missing_model_path_says_it_never_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM("SomeOrg/some-model-that-is-not-here")


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown_option"):
        LLM(unknown_option=1)


def test_bad_prompt_token_ids_leave_the_engine_clean(tiny_llm):
    vocab = tiny_llm.engine.model_config.vocab_size
    for bad in ([1, 2, vocab], [5, -1], [], [1.5], "not a list"):
        with pytest.raises(ValueError):
            tiny_llm.generate({"prompt_token_ids": bad})
    # A bad prompt later in a batch: the good ones already added are withdrawn.
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm.generate([{"prompt_token_ids": [100, 101]}, {"prompt_token_ids": [100, vocab + 5]}])
    assert_engine_idle(tiny_llm)
    with pytest.raises(ValueError, match="already"):
        tiny_llm.engine.add_request("dup", {"prompt_token_ids": [100]}, SamplingParams(max_tokens=1))
        tiny_llm.engine.add_request("dup", {"prompt_token_ids": [100]}, SamplingParams(max_tokens=1))
    drive(tiny_llm.engine)
    out = tiny_llm.generate({"prompt_token_ids": [vocab - 1]}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    assert_engine_idle(tiny_llm)


# ---------------------------------------------------------------------------------------------
# 5. KV accounting under preemption
# ---------------------------------------------------------------------------------------------


def test_preemption_keeps_outputs_and_kv_accounting(tiny):
    rng = random.Random(5)
    prompts = random_prompts(rng, 30, 4, 48)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 16), ignore_eos=True) for _ in prompts]

    small = LLM(str(tiny), dtype="float32", num_kv_blocks=8, block_size=16)  # 128 tokens for ~1,000 of demand
    kv_numel = small.engine.runner.kv_cache.numel()
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0, "the workload must force preemption"
    assert small.engine.runner.kv_cache.numel() == kv_numel
    for out, p in zip(outs, params):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == p.max_tokens
    assert_engine_idle(small)

    # References with a big pool (no preemption): all together, and a sample one at a time.
    big = LLM(str(tiny), dtype="float32", num_kv_blocks=512, block_size=16)
    refs = big.generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
    for i in range(0, len(prompts), 6):
        alone = big.generate(prompts[i], params[i])[0].outputs[0]
        assert outs[i].outputs[0].token_ids == alone.token_ids
    assert big.engine.scheduler.num_preemptions == 0
    assert_engine_idle(big)


def test_aborts_mid_flight_keep_kv_accounting(tiny):
    rng = random.Random(11)
    llm = LLM(str(tiny), dtype="float32", num_kv_blocks=12, block_size=16, max_num_batched_tokens=64)
    engine = llm.engine
    prompts = random_prompts(rng, 10, 10, 50)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    aborted = [f"a{i}" for i in (0, 4, 9)]  # running, maybe mid-prefill, maybe still waiting
    for rid in aborted:
        out = engine.abort_request(rid)
        assert out is not None and out.finished
        assert all(o.finish_reason == "abort" for o in out.outputs)
        engine.check_integrity()
    assert engine.abort_request("a0") is None  # idempotent
    assert engine.abort_request("never-added") is None
    seen = drive(engine)
    assert not set(seen) & set(aborted), "no output after an abort"
    for i in range(10):
        rid = f"a{i}"
        if rid in aborted:
            continue
        final = seen[rid][-1]
        assert final.finished and len(final.outputs[0].token_ids) == 20
    assert_engine_idle(llm)


# ---------------------------------------------------------------------------------------------
# 6. prefix caching
# ---------------------------------------------------------------------------------------------


def test_prefix_caching_on_off_same_tokens(tiny):
    rng = random.Random(21)
    block_size = 16
    shared = [rng.randrange(100, 40000) for _ in range(50)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(100, 40000) for _ in range(5)]} for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    results = {}
    for caching in (True, False):
        llm = LLM(str(tiny), dtype="float32", enable_prefix_caching=caching, block_size=block_size)
        first = llm.generate(prompts[0], params)[0]
        second = llm.generate(prompts[1], params)[0]
        batch = llm.generate(prompts, params)
        assert first.num_cached_tokens == 0
        if caching:
            assert second.num_cached_tokens >= len(shared) - block_size
            assert second.num_cached_tokens <= len(shared)
            assert all(o.num_cached_tokens >= len(shared) - block_size for o in batch)
            assert llm.engine.stats()["prefix_cache_hits_tokens"] > 0
        else:
            assert second.num_cached_tokens == 0
            assert all(o.num_cached_tokens == 0 for o in batch)
            assert llm.engine.stats()["prefix_cache_hits_tokens"] == 0
        results[caching] = [first.outputs[0].token_ids, second.outputs[0].token_ids] + [
            o.outputs[0].token_ids for o in batch
        ]
        assert results[caching][:2] == results[caching][2:4]
        assert_engine_idle(llm)
    assert results[True] == results[False]


# ---------------------------------------------------------------------------------------------
# 7. logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_greedy_and_sampled(tiny_llm):
    prompt = {"prompt_token_ids": list(range(1000, 1012))}
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert len(greedy.logprobs) == len(greedy.token_ids) == 8
    for token, entry in zip(greedy.token_ids, greedy.logprobs):
        assert token in entry and len(entry) == 3  # the chosen token is the top one
        assert entry[token].rank == 1
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert all(lp.decoded_token is not None for lp in entry.values())
    assert greedy.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(greedy.token_ids, greedy.logprobs)))

    sampled = tiny_llm.generate(
        prompt, SamplingParams(temperature=1.5, seed=4, max_tokens=16, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    for token, entry in zip(sampled.token_ids, sampled.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        if len(entry) == 4:
            assert entry[token].rank > 3

    only_chosen = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))[0].outputs[0]
    assert [list(e) for e in only_chosen.logprobs] == [[t] for t in only_chosen.token_ids]
    assert tiny_llm.generate(prompt, SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
    assert_engine_idle(tiny_llm)


# ---------------------------------------------------------------------------------------------
# 8. delta outputs through the engine
# ---------------------------------------------------------------------------------------------


def test_delta_outputs_concatenate_to_cumulative(tiny_llm):
    engine = tiny_llm.engine
    prompt = {"prompt_token_ids": list(range(2000, 2020))}
    sampled = dict(n=2, temperature=1.0, seed=17, max_tokens=14, ignore_eos=True, logprobs=1)
    engine.add_request("delta-req", prompt, SamplingParams(output_kind="delta", **sampled))
    engine.add_request("cum-req", prompt, SamplingParams(output_kind="cumulative", **sampled))
    seen = drive(engine)

    finals = {o.index: o for o in seen["cum-req"][-1].outputs}
    assert seen["cum-req"][-1].finished and sorted(finals) == [0, 1]
    text: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for out in seen["delta-req"]:
        for o in out.outputs:
            if o.index in finish:  # see test_delta_finished_sequence_is_reported_once
                assert not o.text and not o.token_ids and o.finish_reason == finish[o.index]
                continue
            assert o.text or o.token_ids or o.finished
            text[o.index] += o.text
            tokens[o.index] += o.token_ids
            logprobs[o.index] += o.logprobs
            if o.finished:
                finish[o.index] = o.finish_reason
    assert seen["delta-req"][-1].finished
    for i in (0, 1):
        assert tokens[i] == finals[i].token_ids and len(tokens[i]) == 14
        assert text[i] == finals[i].text
        assert [sorted(e) for e in logprobs[i]] == [sorted(e) for e in finals[i].logprobs]
        assert finish[i] == finals[i].finish_reason == "length"
    assert_engine_idle(tiny_llm)


def test_delta_finished_sequence_is_reported_once(tiny_llm):
    engine = tiny_llm.engine
    prompt = {"prompt_token_ids": list(range(3000, 3015))}
    base = dict(n=2, temperature=1.0, seed=23, max_tokens=10, ignore_eos=True)
    ref = tiny_llm.generate(prompt, SamplingParams(**base))[0].outputs
    # A stop token that ends sibling 0 early while sibling 1 runs on (seeded: the same tokens again).
    stop_id = ref[0].token_ids[2]
    assert stop_id not in ref[1].token_ids, "pick another seed"
    engine.add_request("delta-once", prompt, SamplingParams(output_kind="delta", stop_token_ids=[stop_id], **base))
    outs = drive(engine)["delta-once"]
    finishes = [o.index for out in outs for o in out.outputs if o.finished]
    assert sorted(finishes) == [0, 1]


def test_delta_stream_of_chinese_never_splits_a_character(llm_default):
    from chatserve.llm import apply_chat_template

    engine = llm_default.engine
    tok = llm_default.get_tokenizer()
    ids = apply_chat_template(tok, [{"role": "user", "content": "介绍一下北京的旅游景点"}])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind="delta")
    engine.add_request("zh-delta", {"prompt_token_ids": ids}, params)
    outs = drive(engine, check_every_step=False)["zh-delta"]
    deltas = [o.outputs[0] for o in outs]
    assert all(REPLACEMENT_CHAR not in d.text for d in deltas)
    token_ids = [t for d in deltas for t in d.token_ids]
    assert len(token_ids) == 24
    assert "".join(d.text for d in deltas) == tok.decode(token_ids, skip_special_tokens=True)
    assert_engine_idle(llm_default)


def test_bf16_chunked_prefill_steps_without_sampling(tmp_path):
    """A step made only of prefill chunks samples nothing; the bf16 CPU path (gemv lm_head) must cope
    with zero rows. Regression: it raised 'M must be in [1, 8]' and killed the server's engine loop."""
    from chatserve import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=1024, num_kv_blocks=128, max_num_batched_tokens=16)
    prompt = "Summarise this: " + "the quick brown fox jumps over the lazy dog " * 8
    chunked = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(chunked.outputs[0].token_ids) == 4
    assert len(chunked.prompt_token_ids) > 48  # several chunk-only steps before the first sample


def test_engine_info_and_step_layout_counters_are_public(tiny_llm):
    """Benchmarks read what an engine was built with (LLM.engine_info) and how steps were mixed
    (stats) instead of walking into the runner; both must describe the engine that actually ran."""
    info = tiny_llm.engine_info()
    assert info.kv_pool_tokens == info.num_kv_blocks * info.block_size > 0
    assert info.num_layers > 0 and info.max_model_len > 0 and info.plain_parameters > 0
    assert info.attention_backend in ("torch", "cpu", "triton") and info.kernels
    assert 0 < info.weights_load_seconds <= info.load_seconds
    before = tiny_llm.engine.stats()
    block = info.block_size
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    shared = list(range(10, 10 + 3 * block))
    tiny_llm.generate([{"prompt_token_ids": shared + [5, 6]}], params)
    # the second prompt starts past a cached prefix: its first prefill chunk continues a prompt
    tiny_llm.generate([{"prompt_token_ids": shared + [7, 8]}], params)
    after = tiny_llm.engine.stats()
    assert after["num_prefill_chunks_continued"] >= before["num_prefill_chunks_continued"] + 1
    # a prompt admitted while another decodes runs its prefill beside that decode
    engine = tiny_llm.engine
    engine.add_request("decoding", {"prompt_token_ids": list(range(300, 340))}, params)
    engine.step()  # its prefill
    engine.add_request("arriving", {"prompt_token_ids": list(range(400, 440))}, params)
    engine.step()  # one decode beside the new prefill
    assert engine.stats()["num_mixed_steps"] == after["num_mixed_steps"] + 1
    drive(engine)
