"""A 4,000-token prompt is prefilled in chunks while other streams keep their pace (default model)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from chatserve import AsyncLLMEngine, EngineArgs, SamplingParams


def test_long_prompt_does_not_stall_running_streams():
    async def main() -> tuple[list[float], list[float], dict]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(dtype="bfloat16", max_model_len=4600))
        rng = random.Random(0)
        stamps: dict[str, list[float]] = {"a": [], "b": []}
        long_done = asyncio.Event()

        async def stream(rid: str) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, output_kind="delta")
            ids = [rng.randrange(1000, 40000) for _ in range(20)]
            async for _ in engine.generate({"prompt_token_ids": ids}, params, rid):
                stamps[rid].append(time.perf_counter())
                if long_done.is_set() and len(stamps[rid]) > 5:
                    break  # leaving early aborts it

        async def long_prompt() -> dict:
            await asyncio.sleep(0.5)  # the two streams are decoding by now
            ids = [rng.randrange(1000, 40000) for _ in range(4000)]
            t0 = time.perf_counter()
            async for _ in engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), "long"):
                pass
            long_done.set()
            return {"start": t0, "end": time.perf_counter()}

        try:
            results = await asyncio.wait_for(asyncio.gather(stream("a"), stream("b"), long_prompt()), timeout=120)
        finally:
            await engine.shutdown()
            stats = engine.engine.stats()
        window = results[2]
        return stamps["a"], stamps["b"], {"window": window, "stats": stats}

    a, b, info = asyncio.run(main())
    window = info["window"]
    for stamps in (a, b):
        gaps = [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])]
        during = [t1 - t0 for t0, t1 in zip(stamps, stamps[1:]) if window["start"] <= t1 <= window["end"]]
        assert len(during) >= 10, "the stream must keep producing tokens during the long prefill"
        median = statistics.median(gaps)
        assert max(gaps) < 3 * median, (max(gaps), median)
    assert info["stats"]["num_running"] == 0
