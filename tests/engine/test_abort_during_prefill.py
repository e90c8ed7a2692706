"""An abort that arrives while a long prompt prefills stops the step at the next layer.

Without this a client that disconnects during a long prefill holds the engine for the whole
chunk (seconds on a CPU) for nobody. The mechanism is checked, not the clock: how many layers ran
after the abort was announced, that the step counted for nothing (no token, no published block),
that every block came back, and that the prefix cache holds no half-computed KV afterwards (the
same prompt then gives the same greedy tokens as on an untouched engine).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from chatserve import LLM, SamplingParams
from chatserve.engine.async_engine import AsyncLLMEngine

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The default dtype (the host's fast path): the mechanism is the same in any dtype, and float32
    # through torch ops prefilled these prompts ~10x slower.
    return LLM(max_model_len=2048, num_kv_blocks=256, max_num_batched_tokens=2048)


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"item{i}" for i in range(100))  # ~400 tokens: one step


def abort_after_layer(engine, request_ids: list[str], layer: int) -> list[int]:
    """Wrap the runner so the abort of request_ids is announced after `layer` layers of the next
    prefill step (as the async engine does from its thread); returns a list that counts layers run."""
    counted: list[int] = []
    original = engine.runner.execute

    def execute(scheduled, copies=(), between_layers=None):
        if between_layers is None:
            return original(scheduled, copies=copies)

        def hook() -> None:
            counted.append(1)
            if len(counted) == layer:
                for rid in request_ids:
                    engine.request_abort_soon(rid)
            between_layers()

        return original(scheduled, copies=copies, between_layers=hook)

    engine.runner.execute = execute
    return counted


def test_a_prefill_of_only_aborted_requests_stops_at_the_next_layer(llm) -> None:
    engine = llm.engine
    prompt = long_prompt("alpha")
    expected = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    engine.reset_prefix_cache()
    free_before = engine.block_manager.num_free_blocks
    try:
        counted = abort_after_layer(engine, ["victim"], layer=3)
        engine.add_request("victim", prompt, GREEDY)
        outputs = engine.step()
    finally:
        del engine.runner.execute  # back to the class's method
    num_layers = len(engine.runner.model.layers)
    assert engine.num_interrupted_steps == 1
    assert len(counted) == 3 < num_layers  # stopped right after the layer the abort arrived in
    assert outputs == []
    seq = engine.requests["victim"].seqs[0]
    assert seq.num_computed_tokens == 0 and seq.num_published_blocks == 0  # the step counted for nothing
    final = engine.abort_request("victim")
    assert final is not None and final.outputs[0].finish_reason == "abort"
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == free_before  # nothing cached from the cut step
    assert engine.abort_requested == set()
    again = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert again == expected


def test_a_step_that_still_serves_someone_is_not_cut(llm) -> None:
    engine = llm.engine
    engine.reset_prefix_cache()
    interrupted_before = engine.num_interrupted_steps
    try:
        counted = abort_after_layer(engine, ["gone"], layer=2)
        engine.add_request("gone", long_prompt("beta"), GREEDY)
        engine.add_request("stays", long_prompt("gamma"), GREEDY)
        engine.step()
    finally:
        del engine.runner.execute
    assert engine.num_interrupted_steps == interrupted_before
    assert len(counted) == len(engine.runner.model.layers)  # the whole pass ran: "stays" needs it
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_the_async_engine_announces_aborts_to_the_step_in_flight(llm) -> None:
    """Through AsyncLLMEngine: abort() while the long prefill step runs on the executor thread."""

    async def run() -> tuple[int, str | None]:
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        started = asyncio.Event()
        loop = asyncio.get_running_loop()
        original = llm.engine.runner.execute

        def execute(scheduled, copies=(), between_layers=None):
            loop.call_soon_threadsafe(started.set)
            # Hold the step (on the executor thread) until abort() has announced itself, so the
            # announcement provably arrives while the step is in flight, whatever the host's speed.
            deadline = time.monotonic() + 60
            while "async-victim" not in llm.engine.abort_requested and time.monotonic() < deadline:
                time.sleep(0.005)
            return original(scheduled, copies=copies, between_layers=between_layers)

        llm.engine.runner.execute = execute
        try:
            llm.engine.reset_prefix_cache()
            before = llm.engine.num_interrupted_steps
            stream = engine.generate(long_prompt("delta"), GREEDY, request_id="async-victim")
            consumer = asyncio.ensure_future(_drain(stream))
            await asyncio.wait_for(started.wait(), 120)
            metrics = await engine.abort("async-victim")
            reason = await asyncio.wait_for(consumer, 120)
            assert metrics is not None
            return llm.engine.num_interrupted_steps - before, reason
        finally:
            del llm.engine.runner.execute
            await engine.shutdown()

    interrupted, reason = asyncio.run(run())
    assert reason == "abort"
    assert interrupted == 1  # the step in flight heard the abort and stopped at its first layer
    llm.engine.check_integrity()


async def _drain(stream) -> str | None:
    reason = None
    async for out in stream:
        reason = out.outputs[0].finish_reason
    return reason
