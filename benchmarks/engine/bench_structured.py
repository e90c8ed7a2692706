#!/usr/bin/env python3
"""Structured outputs: what a JSON-schema grammar costs at concurrency 16, and what compiling it costs.

    python benchmarks/engine/bench_structured.py                      # default SmolLM2-135M GGUF, float32, 2 threads
    python benchmarks/engine/bench_structured.py --dtype bfloat16 --max-tokens 64 --json bench_results/structured.json

Method (offline, one engine, in process; all greedy):
  * decode     C (default 16) distinct chat prompts asking for a list of people, submitted in one
               `LLM.chat` call: once unconstrained (ignore_eos, so every request makes exactly N
               tokens), once with a JSON schema (`structured_outputs.json`, an array of >= 30 people,
               so the grammar cannot end before N tokens either). Same concurrency all the way through.
               A warm-up of each first, then best of --repeats. Throughput = generated tokens / wall
               time; ITL = per request (finish - first token) / (tokens - 1), the median over requests.
  * TTFT       one request, max_tokens=1, the same schema already in the cache, vs unconstrained;
               best of --ttft-repeats each. "A cached grammar adds no measurable TTFT".
  * compile    the schema compiled cold (cache cleared; the first ever compile also builds xgrammar's
               view of the tokenizer, reported separately) vs a cache hit.
  * mask       the sampler's in-place bitmask fill + apply for C constrained rows alone (no model),
               with the matchers inside the JSON (after '{"people": [{"name": "Jo'), median of 50.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import time)

PEOPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["people"],
}
CITIES = ["Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Perth", "Quito", "Riga",
          "Seoul", "Tunis", "Vienna", "Hanoi", "Dakar", "Bern", "Austin", "Porto"]


def conversations(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"List thirty people who live in {CITIES[i % len(CITIES)]} (request {i}), "
              "as JSON with name, age and city for each."}] for i in range(count)]


def run_batch(llm: Any, convs: list, params: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    wall = time.perf_counter() - t0
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    itls = [
        (o.stats.finish_time - o.stats.first_token_time) / (n - 1)
        for o, n in zip(outs, tokens)
        if n > 1 and o.stats.finish_time is not None and o.stats.first_token_time is not None
    ]
    return {
        "wall_s": wall,
        "tokens": sum(tokens),
        "tok_s": sum(tokens) / wall,
        "itl_ms_median": 1000 * statistics.median(itls) if itls else None,
        "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in outs}),
        "sample_text": outs[0].outputs[0].text[:160],
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: r["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or an HF folder (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    busy = bc.start_parent()

    from chatserve import LLM, SamplingParams
    from chatserve.sampling_params import StructuredOutputsParams
    from chatserve.structured import SequenceMatcher
    from chatserve.structured.bitmask import fill_and_apply_bitmask_

    model = bc.resolve_model(args.model)
    llm = LLM(model=model.path, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(args.concurrency, 16))
    compiler = llm.engine.structured
    spec = StructuredOutputsParams(json=PEOPLE_SCHEMA)
    res: dict[str, Any] = {"env": bc.env_info(), "args": vars(args), "busy_warning": busy}

    # Compile: the first ever (tokenizer view included), cold (cache cleared), cached.
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams(regex="x"))
    res["tokenizer_setup_plus_first_compile_s"] = time.perf_counter() - t
    colds, hits = [], []
    for _ in range(3):
        compiler.clear_cache()
        t = time.perf_counter()
        compiled = compiler.compile(spec)
        colds.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.compile(spec)
        hits.append(time.perf_counter() - t)
    res["compile_cold_ms"] = 1000 * min(colds)
    res["compile_cached_ms"] = 1000 * min(hits)
    bc.log("structured", f"compile cold {res['compile_cold_ms']:.1f} ms, cached {res['compile_cached_ms']:.3f} ms")

    # The mask alone, C rows.
    import torch

    vocab = llm.engine.model_config.vocab_size
    matchers = [SequenceMatcher(compiled) for _ in range(args.concurrency)]
    prefix = llm.get_tokenizer().encode('{"people": [{"name": "Jo', add_special_tokens=False)
    for m in matchers:
        if not all(m.accept(t) for t in prefix):
            raise SystemExit("the schema rejected the mask benchmark's prefix")
    logits = torch.randn(args.concurrency, vocab)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        fill_and_apply_bitmask_(logits, matchers)
        times.append(time.perf_counter() - t)
    res["mask_fill_apply_ms"] = 1000 * statistics.median(times)
    bc.log("structured", f"bitmask fill + apply, {args.concurrency} rows: {res['mask_fill_apply_ms']:.2f} ms")

    convs = conversations(args.concurrency)
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=spec)
    for name, params in (("unconstrained", plain), ("json_schema", constrained)):
        bc.log("structured", f"{name}: warm-up, then {args.repeats} timed run(s) of {args.concurrency} x {args.max_tokens}")
        run_batch(llm, convs[:2], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=params.structured_outputs))
        res[name] = best([run_batch(llm, convs, params) for _ in range(args.repeats)])
        bc.log("structured", f"  {res[name]['tok_s']:.1f} tok/s, ITL {res[name]['itl_ms_median']:.1f} ms, {res[name]['finish_reasons']}")
    res["throughput_ratio"] = bc.ratio(res["json_schema"]["tok_s"], res["unconstrained"]["tok_s"])

    # TTFT with a cached grammar vs none.
    one = conversations(1)
    ttft: dict[str, float] = {}
    for name, so in (("unconstrained", None), ("json_schema_cached", spec)):
        params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=so)
        runs = []
        for _ in range(args.ttft_repeats):
            out = llm.chat(one, params)[0]
            assert out.stats.time_to_first_token is not None
            runs.append(out.stats.time_to_first_token)
        ttft[name] = 1000 * min(runs)
    res["ttft_ms"] = ttft
    bc.log("structured", f"TTFT unconstrained {ttft['unconstrained']:.1f} ms, cached grammar {ttft['json_schema_cached']:.1f} ms")

    rows = [
        ["metric", "unconstrained", "json_schema", "ratio"],
        ["throughput tok/s", bc.fmt(res["unconstrained"]["tok_s"], "{:.1f}"), bc.fmt(res["json_schema"]["tok_s"], "{:.1f}"),
         bc.fmt(res["throughput_ratio"], "{:.3f}")],
        ["ITL median (ms)", bc.fmt(res["unconstrained"]["itl_ms_median"], "{:.1f}"), bc.fmt(res["json_schema"]["itl_ms_median"], "{:.1f}"),
         bc.fmt(bc.ratio(res["json_schema"]["itl_ms_median"], res["unconstrained"]["itl_ms_median"]), "{:.3f}")],
        ["TTFT, 1 request (ms)", bc.fmt(ttft["unconstrained"], "{:.1f}"), bc.fmt(ttft["json_schema_cached"], "{:.1f}"),
         bc.fmt(bc.ratio(ttft["json_schema_cached"], ttft["unconstrained"]), "{:.3f}")],
        ["grammar compile cold / cached (ms)", "-", f"{res['compile_cold_ms']:.1f} / {res['compile_cached_ms']:.3f}", "-"],
        ["tokenizer setup + first compile (s)", "-", bc.fmt(res["tokenizer_setup_plus_first_compile_s"], "{:.2f}"), "-"],
        [f"bitmask fill + apply, {args.concurrency} rows (ms)", "-", bc.fmt(res["mask_fill_apply_ms"], "{:.2f}"), "-"],
    ]
    print(bc.markdown_table(rows))
    print(f"\nhost: {res['env']['cpu']}, {res['env']['cpu_count']} CPUs, load {res['env']['loadavg'][0]:.1f}; "
          f"{args.dtype}, {args.threads} threads; {args.concurrency} requests x {args.max_tokens} tokens")
    if busy:
        print(f"\nWARNING: {busy}")
    if args.json:
        bc.write_json(args.json, res)


if __name__ == "__main__":
    main()
