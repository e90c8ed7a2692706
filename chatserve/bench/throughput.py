"""`chatserve bench throughput`: how many requests and tokens per second the engine sustains offline.

vLLM's `vllm bench throughput` on its random dataset: `--num-prompts` prompts of `--input-len`
random token ids, each generating exactly `--output-len` tokens, submitted in one `LLM.generate`
call so the scheduler batches them as it likes (continuous batching, chunked prefill). Prints
`Throughput: X requests/s, Y total tokens/s, Z output tokens/s` and writes vLLM's `--output-json`
keys (`elapsed_time`, `num_requests`, `total_num_tokens`, `requests_per_second`,
`tokens_per_second`). Prompts are distinct random ids, so the prefix cache cannot help.
"""

from __future__ import annotations

import argparse
import time

from chatserve.bench.offline import check_fits, make_llm, random_token_prompts, write_json
from chatserve.bench.serve import _int_at_least


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("throughput benchmark")
    g.add_argument("--input-len", type=_int_at_least(1), default=128, help="prompt tokens [default: 128]")
    g.add_argument("--output-len", type=_int_at_least(1), default=128, help="generated tokens [default: 128]")
    g.add_argument("--num-prompts", type=_int_at_least(1), default=100, help="requests [default: 100]")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature [default: 1.0, as vLLM]")
    g.add_argument("--seed-prompts", type=int, default=0, help="seed of the random prompt ids [default: 0]")
    g.add_argument("--output-json", default=None, help="write the throughput here (vLLM's keys)")


def main(args: argparse.Namespace) -> int:
    from chatserve import SamplingParams

    llm = make_llm(args)
    prompts = random_token_prompts(llm, args.num_prompts, args.input_len, args.seed_prompts)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}\nTotal num output tokens:  {output_tokens}")
    if args.output_json:
        write_json(args.output_json, {
            "elapsed_time": elapsed, "num_requests": len(outs), "total_num_tokens": total,
            "requests_per_second": len(outs) / elapsed, "tokens_per_second": total / elapsed,
            "output_tokens_per_second": output_tokens / elapsed, "total_output_tokens": output_tokens,
            "input_len": args.input_len, "output_len": args.output_len, "model": llm.engine_args.model})
        print(f"Saved result to {args.output_json}")
    return 0


check_args = check_fits
