#!/usr/bin/env python3
"""Serving benchmark: chatserve's AsyncLLMEngine under concurrent chat requests vs Hugging Face transformers.

    python benchmarks/peers/bench_engine.py                          # default SmolLM2-135M GGUF, bf16, 2 threads
    python benchmarks/peers/bench_engine.py --threads 1 --levels 1,4 --num-requests 4 --max-tokens 16   # smoke test
    python benchmarks/peers/bench_engine.py --only chatserve         # one engine only (also: --only hf)
    python benchmarks/peers/bench_engine.py --json bench_results/engine.json

Each engine runs in its own subprocess; the parent renders the prompts once, as token ids, so both
engines see identical inputs. A worker prints its results as one JSON line on stdout (stderr passes
through). Debug one engine in-process with `--worker chatserve` (it then builds the workload itself).

Workload: distinct short chat questions (10-40 tokens of user text each), rendered with the model's
chat template (SmolLM2's template adds its default system prompt), greedy, EOS ignored, so every
request makes exactly --max-tokens (default 64) tokens. At each concurrency level C (--levels, default
1,4,16,64) N requests run (N = --num-requests, default max(C, 16)). Every level (and each warm-up) gets
its own prompts, so chatserve's prefix cache (on, the engine default; --no-prefix-caching turns it off)
can only reuse the shared chat-template/system-prompt prefix, never a whole earlier prompt.

Method:
  * chatserve  `AsyncLLMEngine.from_engine_args(EngineArgs.from_env(dtype, num_threads=T, max_num_seqs=max(levels)))`,
               one warm-up round, then per level the N requests under an asyncio.Semaphore(C): a new
               request starts as soon as one finishes (closed loop, C in flight). Each request streams
               `output_kind="delta"`; the client timestamps every delta. tok/s = N*M / wall time of
               the level. TTFT = first delta - generate() call; ITL = gaps between consecutive deltas
               (a gap spanning k tokens counts as k gaps of 1/k). Medians over all requests of the level.
  * HF seq     transformers `generate` (max_new_tokens=min_new_tokens=M, do_sample=False) one request
               after another, i.e. what a naive server does. To keep the run affordable it is timed on
               the first min(N, --hf-seq-requests, default 8) requests of the level and reported as a
               rate (tokens / summed wall time), which is what N requests would give, at any C.
  * HF batched the level's N requests in groups of C, each group one `generate` with left padding
               (only for C > 1; C = 1 is the sequential case). Not continuous batching: a group
               waits for its longest member, which is no loss here since every request makes M tokens.
  * end to end one extra chat prompt, --e2e-tokens (default 128) tokens, a single request on an idle
               engine: chatserve via AsyncLLMEngine.generate (wall time until the final output) vs
               one transformers `generate` call. Both engines are warm; best of --e2e-repeats (default 1).
Both workers warm up first (a short batched call), and load / import times are not counted anywhere.
The headline target: at concurrency 16, chatserve tok/s >= 8x HF sequential tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import time)

RESULT_MARKER = "BENCH_RESULT_JSON: "
ENGINES = ("chatserve", "hf")
TARGET_LEVEL = 16
TARGET_RATIO = 8.0

# Distinct chat questions: every (form, topic) pair. Lengths are checked when the workload is built.
FORMS = [
    "Can you explain {t} in simple terms for a curious ten year old?",
    "What are the three most important things a beginner should know about {t}?",
    "Write a short paragraph describing {t} and why people find it interesting.",
    "I am preparing a school presentation on {t}. Which points should I cover first?",
    "Give me a quick summary of the history of {t}.",
    "What is a common misconception about {t}, and what is actually true?",
    "How would you teach {t} to someone who has never heard of it before?",
    "List some practical tips for getting started with {t} this weekend.",
    "Why does {t} matter in everyday life? Please answer briefly.",
    "Compare {t} with something familiar from daily life, using a simple analogy.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the Roman Empire", "baking bread",
    "learning to play the guitar", "machine learning", "the human heart", "recycling plastic",
    "ocean tides", "the French Revolution", "growing tomatoes", "electric cars", "honey bees",
    "the stock market", "rainbows", "chess openings", "the immune system", "the Great Wall of China",
    "solar panels", "earthquakes", "writing poetry", "the moon landing",
]


# --------------------------------------------------------------------------------------------------
# Workload (parent)
# --------------------------------------------------------------------------------------------------


def chat_prompts(tokenizer: Any, count: int, min_len: int = 10, max_len: int = 40) -> list[list[int]]:
    """`count` distinct chat-template-rendered prompts (token ids), user questions of min_len..max_len tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("the tokenizer has no chat template; this benchmark needs a chat model")
    out: list[list[int]] = []
    # Interleave so consecutive prompts differ in both form and topic.
    pairs = [(f, t) for k in range(len(TOPICS)) for f, t in
             ((FORMS[i], TOPICS[(i + k) % len(TOPICS)]) for i in range(len(FORMS)))]
    for form, topic in pairs:
        q = form.format(t=topic)
        if not min_len <= len(bc.encode(tokenizer, q)) <= max_len:
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(bc.encode(tokenizer, text))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} distinct chat prompts available, {count} needed; lower --num-requests")


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    model = bc.resolve_model(args.model)
    tok = bc.load_hf_tokenizer(model)
    levels = args.levels
    counts = [args.num_requests or max(c, 16) for c in levels]
    n_warm = max(4, min(16, max(levels)))
    prompts = chat_prompts(tok, n_warm + sum(counts) + 1)
    warm, e2e, rest = prompts[:n_warm], prompts[n_warm], prompts[n_warm + 1:]
    per_level, i = [], 0
    for c, n in zip(levels, counts):
        per_level.append({"concurrency": c, "prompts": rest[i:i + n]})
        i += n
    return bc.worker_spec(
        model, args.dtype, args.threads,
        max_tokens=args.max_tokens,
        hf_seq_requests=args.hf_seq_requests,
        e2e_tokens=args.e2e_tokens,
        e2e_repeats=args.e2e_repeats,
        prefix_caching=not args.no_prefix_caching,
        warmup_prompts=warm,
        e2e_prompt=e2e,
        levels=per_level,
    )


# --------------------------------------------------------------------------------------------------
# chatserve worker
# --------------------------------------------------------------------------------------------------


async def _cs_request(engine: Any, SamplingParams: Any, ids: list[int], max_tokens: int, rid: str) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    cached = 0
    async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
        n = sum(len(o.token_ids) for o in out.outputs)
        if n:
            stamps.append((time.perf_counter(), n))
        cached = max(cached, int(getattr(out, "num_cached_tokens", 0) or 0))
    t_end = time.perf_counter()
    ntok = sum(n for _, n in stamps)
    itl: list[float] = []
    for (a, _), (b, n) in zip(stamps, stamps[1:]):
        itl.extend([(b - a) / n] * n)
    return {"ttft": stamps[0][0] - t0 if stamps else None, "itl": itl, "tokens": ntok,
            "latency": t_end - t0, "cached": cached}


async def _cs_level(engine: Any, SamplingParams: Any, prompts: list[list[int]], conc: int, max_tokens: int,
                    tag: str) -> dict[str, Any]:
    sem = asyncio.Semaphore(conc)

    async def one(i: int, ids: list[int]) -> dict[str, Any]:
        async with sem:
            return await _cs_request(engine, SamplingParams, ids, max_tokens, f"{tag}-{i}")

    t0 = time.perf_counter()
    reqs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in reqs)
    return {
        "concurrency": conc,
        "num_requests": len(prompts),
        "wall_s": wall,
        "generated_tokens": tokens,
        "tok_s": tokens / wall,
        "median_ttft_s": bc.median([r["ttft"] for r in reqs if r["ttft"] is not None]),
        "median_itl_s": bc.median([x for r in reqs for x in r["itl"]]),
        "median_latency_s": bc.median([r["latency"] for r in reqs]),
        "short_outputs": sum(1 for r in reqs if r["tokens"] != max_tokens),
        "max_cached_tokens": max((r["cached"] for r in reqs), default=0),
    }


async def _cs_main(spec: dict[str, Any], res: dict[str, Any]) -> None:
    from chatserve import AsyncLLMEngine, EngineArgs, SamplingParams

    model = bc.ModelRef(**spec["model"])
    max_level = max(lv["concurrency"] for lv in spec["levels"])
    t0 = time.perf_counter()
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(
        model=model.path, dtype=spec["dtype"], num_threads=spec["threads"], max_num_seqs=max_level,
        enable_prefix_caching=spec["prefix_caching"]))
    res["load_s"] = time.perf_counter() - t0
    bc.log("chatserve", f"loaded in {res['load_s']:.2f}s; max_num_seqs={max_level}")
    try:
        m = spec["max_tokens"]
        warm = spec["warmup_prompts"]
        bc.log("chatserve", f"warm-up: {len(warm)} requests, concurrency {len(warm)}, 8 tokens")
        await _cs_level(engine, SamplingParams, warm, len(warm), 8, "warm")
        res["levels"] = []
        for lv in spec["levels"]:
            r = await _cs_level(engine, SamplingParams, lv["prompts"], lv["concurrency"], m, f"c{lv['concurrency']}")
            res["levels"].append(r)
            bc.log("chatserve", f"concurrency {r['concurrency']}: {r['num_requests']} requests x {m} tokens in "
                              f"{r['wall_s']:.2f}s = {r['tok_s']:.1f} tok/s, TTFT {r['median_ttft_s'] or 0:.3f}s, "
                              f"ITL {1000 * (r['median_itl_s'] or 0):.1f}ms")
        # End to end: one request on an idle engine.
        runs = [await _cs_level(engine, SamplingParams, [spec["e2e_prompt"]], 1, spec["e2e_tokens"], f"e2e{k}")
                for k in range(spec["e2e_repeats"])]
        best = min(runs, key=lambda r: r["wall_s"])
        res["e2e"] = {"wall_s": best["wall_s"], "tokens": best["generated_tokens"],
                      "ttft_s": best["median_ttft_s"], "max_cached_tokens": best["max_cached_tokens"]}
        bc.log("chatserve", f"end to end: {best['generated_tokens']} tokens in {best['wall_s']:.2f}s")
        res["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float, bool))}
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------------------------------
# transformers worker
# --------------------------------------------------------------------------------------------------


def _hf_main(spec: dict[str, Any], res: dict[str, Any]) -> None:
    model = bc.ModelRef(**spec["model"])
    t0 = time.perf_counter()
    eng = bc.HFEngine(model, spec["dtype"])
    res["load_s"] = time.perf_counter() - t0
    res["attn_implementation"] = eng.info["attn_implementation"]
    bc.log("hf", f"loaded in {res['load_s']:.2f}s")
    m = spec["max_tokens"]
    warnings: list[str] = res.setdefault("warnings", [])

    def timed(prompts: list[list[int]], n: int) -> float:
        t = time.perf_counter()
        outs = eng.generate(prompts, n)
        dt = time.perf_counter() - t
        bad = [len(o) for o in outs if len(o) != n]
        if bad:
            warnings.append(f"{len(bad)} outputs of lengths {sorted(set(bad))}, expected {n}")
        return dt

    warm = spec["warmup_prompts"]
    bc.log("hf", "warm-up")
    timed(warm[:1], 4)
    timed(warm[:4], 4)
    res["levels"] = []
    for lv in spec["levels"]:
        c, prompts = lv["concurrency"], lv["prompts"]
        r: dict[str, Any] = {"concurrency": c, "num_requests": len(prompts)}
        seq = prompts[: min(len(prompts), spec["hf_seq_requests"])]
        wall = sum(timed([p], m) for p in seq)
        r.update(seq_requests=len(seq), seq_wall_s=wall, seq_tok_s=len(seq) * m / wall)
        msg = f"concurrency {c}: sequential {len(seq)} requests in {wall:.2f}s = {r['seq_tok_s']:.1f} tok/s"
        if c > 1:
            groups = [prompts[i:i + c] for i in range(0, len(prompts), c)]
            wall = sum(timed(g, m) for g in groups)
            r.update(batched_groups=len(groups), batched_wall_s=wall, batched_tok_s=len(prompts) * m / wall)
            msg += f"; batched {len(groups)} group(s) of <= {c} in {wall:.2f}s = {r['batched_tok_s']:.1f} tok/s"
        res["levels"].append(r)
        bc.log("hf", msg)
    n = spec["e2e_tokens"]
    wall = min(timed([spec["e2e_prompt"]], n) for _ in range(spec["e2e_repeats"]))
    res["e2e"] = {"wall_s": wall, "tokens": n}
    bc.log("hf", f"end to end: {n} tokens in {wall:.2f}s")


def worker_main(engine_name: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> int:
    res: dict[str, Any] = {"engine": engine_name}
    try:
        import torch

        threads = args.threads if spec is None else spec["threads"]
        torch.set_num_threads(threads)
        if spec is None:
            spec = make_spec(args)
        if engine_name == "hf":
            import transformers

            transformers.utils.logging.disable_progress_bar()
            res["version"] = transformers.__version__
            _hf_main(spec, res)
        else:
            import chatserve

            res["version"] = getattr(chatserve, "__version__", None)
            asyncio.run(_cs_main(spec, res))
        res["torch"] = torch.__version__
        res["torch_threads"] = torch.get_num_threads()
    except BaseException as e:  # report, then let the parent print what it has
        return bc.finish_worker(RESULT_MARKER, res, e)
    return bc.finish_worker(RESULT_MARKER, res)


# --------------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------------


def build_report(results: dict[str, dict[str, Any]], spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    cs, hf = results.get("chatserve") or {}, results.get("hf") or {}
    cs_lv = {r["concurrency"]: r for r in cs.get("levels", [])}
    hf_lv = {r["concurrency"]: r for r in hf.get("levels", [])}
    header = ["concurrency", "chatserve tok/s", "HF sequential tok/s", "HF batched tok/s",
              "chatserve / HF-seq", "chatserve / HF-batched", "chatserve median TTFT", "chatserve median ITL"]
    rows = [header]
    summary: dict[str, Any] = {"levels": []}
    for lv in spec["levels"]:
        c = lv["concurrency"]
        a, b = cs_lv.get(c, {}), hf_lv.get(c, {})
        r_seq = bc.ratio(a.get("tok_s"), b.get("seq_tok_s"))
        r_bat = bc.ratio(a.get("tok_s"), b.get("batched_tok_s"))
        summary["levels"].append({"concurrency": c, "vs_hf_seq": r_seq, "vs_hf_batched": r_bat})
        rows.append([
            str(c), bc.fmt(a.get("tok_s"), "{:.1f}"), bc.fmt(b.get("seq_tok_s"), "{:.1f}"),
            bc.fmt(b.get("batched_tok_s"), "{:.1f}") if c > 1 else "(= sequential)",
            bc.fmt(r_seq, "{:.2f}x"), bc.fmt(r_bat, "{:.2f}x"),
            bc.fmt(a.get("median_ttft_s"), "{:.3f} s"),
            bc.fmt(None if a.get("median_itl_s") is None else 1000 * a["median_itl_s"], "{:.1f} ms"),
        ])
    lines = [bc.markdown_table(rows)]

    ce, he = cs.get("e2e") or {}, hf.get("e2e") or {}
    speed = bc.ratio(he.get("wall_s"), ce.get("wall_s"))
    summary["e2e_speedup"] = speed
    n_e2e = spec["e2e_tokens"]
    lines += ["", bc.markdown_table([
        [f"single prompt end to end ({len(spec['e2e_prompt'])}-token chat prompt, {n_e2e} new tokens)",
         "chatserve (AsyncLLMEngine)", "transformers generate", "speed-up"],
        ["wall time", bc.fmt(ce.get("wall_s"), "{:.2f} s"), bc.fmt(he.get("wall_s"), "{:.2f} s"), bc.fmt(speed, "{:.2f}x")],
        ["tok/s", bc.fmt(bc.ratio(n_e2e, ce.get("wall_s")), "{:.1f}"), bc.fmt(bc.ratio(n_e2e, he.get("wall_s")), "{:.1f}"), ""],
    ])]
    target = next((s for s in summary["levels"] if s["concurrency"] == TARGET_LEVEL), None)
    if target is None:
        verdict = f"concurrency {TARGET_LEVEL} >= {TARGET_RATIO:g}x transformers one-after-another: " \
                  f"NOT MEASURED (level {TARGET_LEVEL} not in --levels)"
        summary["target_pass"] = None
    elif target["vs_hf_seq"] is None:
        verdict = f"concurrency {TARGET_LEVEL} >= {TARGET_RATIO:g}x transformers one-after-another: " \
                  f"NOT MEASURED (an engine failed or was skipped)"
        summary["target_pass"] = None
    else:
        ok = target["vs_hf_seq"] >= TARGET_RATIO
        summary["target_pass"] = ok
        verdict = (f"concurrency {TARGET_LEVEL} >= {TARGET_RATIO:g}x transformers one-after-another: "
                   f"{'PASS' if ok else 'FAIL'} ({target['vs_hf_seq']:.2f}x)")
    summary["target_line"] = verdict
    return "\n".join(lines), summary


def _parse_levels(s: str) -> list[int]:
    try:
        levels = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels: expected comma-separated integers, got {s!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--levels: need at least one level, all >= 1")
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    p.add_argument("--levels", type=_parse_levels, default=[1, 4, 16, 64], help="concurrency levels, e.g. 1,4,16,64")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default max(C, 16))")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--hf-seq-requests", type=int, default=8,
                   help="HF one-after-another is timed on at most this many requests per level, reported as a rate")
    p.add_argument("--e2e-tokens", type=int, default=128, help="new tokens in the single-prompt end-to-end case")
    p.add_argument("--e2e-repeats", type=int, default=1, help="end-to-end runs per engine (best taken)")
    p.add_argument("--no-prefix-caching", action="store_true", help="chatserve: enable_prefix_caching=False")
    p.add_argument("--only", choices=ENGINES, default=None, help="run one engine only")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine worker")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.e2e_tokens < 1 or args.hf_seq_requests < 1 or args.e2e_repeats < 1:
        p.error("--max-tokens, --e2e-tokens, --hf-seq-requests and --e2e-repeats must be >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")

    if args.worker:
        return worker_main(args.worker, bc.load_spec(args.spec), args)

    busy_before = bc.start_parent()
    t_start = time.perf_counter()
    spec = make_spec(args)
    plens = [len(x) for lv in spec["levels"] for x in lv["prompts"]]
    bc.log("main", f"model {spec['model']['path']}, dtype {args.dtype}, threads {args.threads}; levels "
                 f"{[(lv['concurrency'], len(lv['prompts'])) for lv in spec['levels']]} (concurrency, requests); "
                 f"chat prompts {min(plens)}-{max(plens)} tokens; {args.max_tokens} new tokens each")

    engines = (args.only,) if args.only else ENGINES
    results = bc.run_engine_workers(__file__, engines, spec, result_marker=RESULT_MARKER, threads=args.threads,
                                    timeout=args.timeout, extra_args=["--threads", str(args.threads)])

    table, summary = build_report(results, spec)
    print()
    print(f"model: {spec['model']['path']}  dtype: {args.dtype}  threads: {args.threads}  cpu: {bc.env_info()['cpu']}")
    print(f"{args.max_tokens} new tokens per request (greedy, EOS ignored); HF sequential timed on "
          f"min(N, {args.hf_seq_requests}) requests per level and reported as a rate; "
          f"chatserve prefix caching {'on' if spec['prefix_caching'] else 'off'} (distinct prompts per level)")
    print(table)
    print(summary["target_line"])
    if busy_before:
        print("WARNING: " + busy_before)
    status = bc.print_problems(results)
    for engine, res in results.items():
        for lv in res.get("levels", []):
            if lv.get("short_outputs"):
                print(f"WARNING [{engine}]: concurrency {lv['concurrency']}: {lv['short_outputs']} requests "
                      f"did not produce exactly {args.max_tokens} tokens")
                status = 1
    total = time.perf_counter() - t_start
    print(f"total benchmark time {total:.0f}s")

    if args.json:
        cfg = {k: v for k, v in spec.items() if k not in ("warmup_prompts", "e2e_prompt", "levels")}
        cfg["levels"] = [{"concurrency": lv["concurrency"], "prompt_lengths": [len(x) for x in lv["prompts"]]}
                         for lv in spec["levels"]]
        cfg["e2e_prompt_length"] = len(spec["e2e_prompt"])
        bc.write_json(args.json, {"config": cfg, "env": bc.env_info(), "results": results, "summary": summary,
                                  "table": table, "total_s": total})
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
