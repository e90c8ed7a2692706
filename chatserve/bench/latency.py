"""`chatserve bench latency`: how long one batch takes, end to end, in-process.

vLLM's `vllm bench latency`: a batch of `--batch-size` prompts of `--input-len` random token ids,
each generating exactly `--output-len` tokens; `--num-iters-warmup` unmeasured runs (kernels warm,
caches allocated), then `--num-iters` timed ones. Prints the average and the 10/25/50/75/90/99th
percentiles of the batch latency and writes vLLM's `--output-json` keys (`avg_latency`,
`latencies`, `percentiles`). The prefix cache is off by default here: every iteration sends the
same prompts, and a cache hit would measure the cache, not the forward pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from chatserve.bench.offline import check_fits, make_llm, random_token_prompts, write_json
from chatserve.bench.progress import Progress
from chatserve.bench.results import percentile
from chatserve.bench.serve import _int_at_least

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("latency benchmark")
    g.add_argument("--input-len", type=_int_at_least(1), default=32, help="prompt tokens [default: 32]")
    g.add_argument("--output-len", type=_int_at_least(1), default=128, help="generated tokens [default: 128]")
    g.add_argument("--batch-size", type=_int_at_least(1), default=8, help="prompts per batch [default: 8]")
    g.add_argument("--num-iters-warmup", type=_int_at_least(0), default=10, help="unmeasured batches first [default: 10]")
    g.add_argument("--num-iters", type=_int_at_least(1), default=30, help="measured batches [default: 30]")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature [default: 1.0, as vLLM]")
    g.add_argument("--seed-prompts", type=int, default=0, help="seed of the random prompt ids [default: 0]")
    g.add_argument("--output-json", default=None, help="write the latencies here (vLLM's keys)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(enable_prefix_caching=False)


def main(args: argparse.Namespace) -> int:
    from chatserve import SamplingParams

    llm = make_llm(args)
    prompts = random_token_prompts(llm, args.batch_size, args.input_len, args.seed_prompts)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)

    def run_once() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        made = [len(o.outputs[0].token_ids) for o in outs]
        if made != [args.output_len] * len(prompts):
            raise RuntimeError(f"expected {args.output_len} tokens per prompt, got {made}")
        return elapsed

    bar = Progress(args.num_iters_warmup, "warmup", disable=args.disable_tqdm or args.num_iters_warmup == 0)
    for _ in range(args.num_iters_warmup):
        run_once()
        bar.update()
    bar.close()
    bar = Progress(args.num_iters, "iterations", disable=args.disable_tqdm)
    latencies = []
    for _ in range(args.num_iters):
        latencies.append(run_once())
        bar.update()
    bar.close()
    avg = statistics.fmean(latencies)
    pcts = {str(p): percentile(latencies, p) for p in PERCENTILES}
    print(f"Avg latency: {avg} seconds")
    for p, v in pcts.items():
        print(f"{p}% percentile latency: {v} seconds")
    if args.output_json:
        payload: dict[str, Any] = {"avg_latency": avg, "latencies": latencies, "percentiles": pcts,
                                   "input_len": args.input_len, "output_len": args.output_len,
                                   "batch_size": args.batch_size, "model": llm.engine_args.model}
        write_json(args.output_json, payload)
        print(f"Saved result to {args.output_json}")
    return 0


check_args = check_fits
