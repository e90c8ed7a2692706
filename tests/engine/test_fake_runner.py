"""The scripted worker (tests/helpers/fake_runner.py) under the real engine: what the server tests rely on.

Its replies go through the real output processor (end token, max_tokens, n, logprobs), its grammar
choices through the real matcher, its KV pool checks the real block manager's bookkeeping, and its
hold is a step that counts for nothing until released or aborted.
"""

from __future__ import annotations

import asyncio
import re
import struct

import pytest

from chatserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.fake_runner import CHOSEN_LOGPROB, scripted_engine

REPLY = "Hello there, friend."


def run_all(engine, limit: int = 200) -> dict:
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def test_replies_end_with_the_end_token_and_honour_n_max_tokens_and_logprobs(smollm_tokenizer) -> None:
    engine = scripted_engine(smollm_tokenizer, reply=REPLY)
    reply_ids = smollm_tokenizer.encode(REPLY, add_special_tokens=False)
    engine.add_request("whole", "Hi", SamplingParams(n=2, logprobs=3))
    engine.add_request("cut", "Hi", SamplingParams(max_tokens=2))
    outs = run_all(engine)
    for choice in outs["whole"].outputs:
        assert choice.text == REPLY and choice.finish_reason == "stop"
        assert choice.token_ids == reply_ids + [smollm_tokenizer.eos_token_id]
        for token, entry in zip(choice.token_ids, choice.logprobs):
            assert len(entry) == 3 and entry[token].rank == 1 and entry[token].logprob == CHOSEN_LOGPROB
            assert max(entry.values(), key=lambda lp: lp.logprob) is entry[token]
    (cut,) = outs["cut"].outputs
    assert cut.token_ids == reply_ids[:2] and cut.finish_reason == "length" and cut.logprobs is None


def test_a_grammar_chooses_among_what_the_real_matcher_allows(smollm_tokenizer) -> None:
    spec = StructuredOutputsParams(regex="[a-z]+")
    obeys = scripted_engine(smollm_tokenizer, reply=REPLY)
    obeys.add_request("r", "Hi", SamplingParams(structured_outputs=spec))
    (out,) = run_all(obeys)["r"].outputs
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]+", out.text), out.text
    ignores = scripted_engine(smollm_tokenizer, reply=REPLY, follow_grammar=False)
    ignores.add_request("r", "Hi", SamplingParams(structured_outputs=spec))
    (out,) = run_all(ignores)["r"].outputs
    assert out.finish_reason == "error" and "the grammar rejected token" in out.error


def test_the_kv_it_reads_checks_the_prefix_cache(smollm_tokenizer) -> None:
    engine = scripted_engine(smollm_tokenizer, reply="Yes.", block_size=16)
    prompt = "one two three " * 12  # several whole blocks
    engine.add_request("first", prompt, SamplingParams())
    run_all(engine)
    engine.add_request("again", prompt, SamplingParams())
    assert run_all(engine)["again"].stats.num_cached_tokens >= 32  # served from the cache, and the KV checked out
    # a cached block that does not hold what the tree says it does (written back wrong, as from a KV
    # tier): the next hit fails its step
    worker = engine.worker
    blocks = worker.read_kv_blocks(range(worker.pool.num_blocks))
    written = next(b for b, kv in enumerate(blocks) if struct.unpack_from("<i", kv)[0] != -1)
    slots = list(struct.unpack(f"<{worker.pool.block_size}i", blocks[written]))
    slots[3] += 1
    worker.write_kv_blocks([written], [struct.pack(f"<{worker.pool.block_size}i", *slots)])
    engine.add_request("wrong", prompt, SamplingParams())
    with pytest.raises(RuntimeError, match="KV slot"):
        run_all(engine)


def test_hold_stops_after_the_first_token_until_release_and_an_abort_lands_meanwhile(smollm_tokenizer) -> None:
    async def main() -> None:
        engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True)
        held = engine.generate("Hi", SamplingParams(), "held")
        first = await held.__anext__()
        assert first.outputs[0].text == "Hello"
        await asyncio.sleep(0.05)
        assert engine.requests[0].num_sent == 1 and not engine.requests[0].finished
        metrics = await engine.abort("held")
        assert metrics is not None and metrics.finish_reason == "abort" and metrics.aborted_in_state == "decoding"
        engine.release()
        outs = [out async for out in engine.generate("Hi", SamplingParams(), "free")]
        assert outs[-1].outputs[0].text == REPLY and outs[-1].finished
        await engine.shutdown()

    asyncio.run(main())
