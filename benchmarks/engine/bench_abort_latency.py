"""How long an abort takes to land while a long prompt prefills (issue: abort latency during prefill).

For a prompt of --prompt-tokens prefilled as one step, measures (through AsyncLLMEngine, as the
server runs it): the step's full duration, and the time from `abort()` to the request's final
output when the abort is issued --at of the way into the step. The engine checks between decoder
layers whether every request of a prefill step is being aborted and stops there, so the abort
latency should be about one layer's time (the step / num_layers), not the rest of the step.

    .venv/bin/python benchmarks/engine/bench_abort_latency.py --prompt-tokens 2000 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import busy_warning, env_info  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--at", type=float, default=0.3, help="fraction of the step after which the abort is issued")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from chatserve import LLM, AsyncLLMEngine, SamplingParams

    llm = LLM(dtype=args.dtype, max_model_len=args.prompt_tokens + 64, max_num_batched_tokens=args.prompt_tokens + 64,
              num_threads=args.threads)
    tok = llm.get_tokenizer()
    words = " ".join(f"w{i}" for i in range(args.prompt_tokens))
    ids = tok.encode(words, add_special_tokens=False)[: args.prompt_tokens]
    params = SamplingParams(max_tokens=1, temperature=0)

    async def one(tag: int, abort_after: float | None) -> tuple[float, float | None, str]:
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        llm.engine.reset_prefix_cache()
        prompt = {"prompt_token_ids": [tag % 1000 + 10, *ids[1:]]}
        t0 = time.perf_counter()
        stream = engine.generate(prompt, params, request_id=f"r{tag}")
        reason = ""
        latency = None

        async def drain() -> None:
            nonlocal reason
            async for out in stream:
                reason = out.outputs[0].finish_reason or ""

        task = asyncio.ensure_future(drain())
        if abort_after is not None:
            await asyncio.sleep(abort_after)
            t_abort = time.perf_counter()
            await engine.abort(f"r{tag}")
            await task
            latency = time.perf_counter() - t_abort
        else:
            await task
        total = time.perf_counter() - t0
        await engine.shutdown()
        return total, latency, reason

    async def run() -> dict:
        await one(-1, None)  # warm-up
        full = [(await one(i, None))[0] for i in range(args.runs)]
        step = statistics.median(full)
        lat, reasons = [], []
        for i in range(args.runs):
            _, latency, reason = await one(100 + i, step * args.at)
            lat.append(latency)
            reasons.append(reason)
        built = llm.engine_info()
        num_layers = built.num_layers
        return {"prompt_tokens": len(ids), "threads": args.threads, "dtype": built.dtype,
                "num_layers": num_layers, "prefill_step_s_median": step,
                "abort_latency_s_median": statistics.median(lat), "abort_latency_s_max": max(lat),
                "one_layer_s": step / num_layers, "finish_reasons": reasons,
                "interrupted_steps": llm.engine.stats()["num_interrupted_steps"], "env": env_info(), "busy": busy_warning()}

    result = asyncio.run(run())
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
