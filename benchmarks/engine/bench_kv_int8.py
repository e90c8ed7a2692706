#!/usr/bin/env python3
"""The 8-bit KV cache against bfloat16 KV (issue 56): capacity, accuracy, decode speed, the prefix cache
and restarts from disk.

    python benchmarks/engine/bench_kv_int8.py                                   # the full run (tens of minutes)
    python benchmarks/engine/bench_kv_int8.py --random-gguf /tmp/llama-1b.gguf  # + the 1B-class random GGUF
    python benchmarks/engine/bench_kv_int8.py --short                           # a quick check that it works
    python benchmarks/engine/bench_kv_int8.py --json bench_results/kv_int8.json

Every measurement runs the same engine flags twice, ``--kv-cache-dtype bf16`` (auto: the model's dtype)
and ``int8``, alternated where timed (medians of --repeats):

  (1) tokens cached per GiB: the KV pool's own accounting (``plan_kv_pool``, ``EngineInfo.kv_pool_tokens``
      at --kv-cache-memory-gb 1) for the default model and, if given, the random GGUF;
  (2) accuracy: greedy decoding of --gen-tokens tokens after prompts of --lengths tokens (2,000 and 8,000:
      the default model's context is 8,192) with logprobs: the fraction of identical tokens, the first
      divergence (the index of the first different token; "-" if none), and the mean / max |logprob
      drift| of the chosen tokens over the positions before the first divergence (where both runs
      decode the same context); per model (the default; the 1B-class file of
      benchmarks/models/make_random_gguf.py with --random-gguf, made with --context 8704 or more);
  (3) decode tok/s at the longest of --lengths tokens of context (batch 1; from the first token to the
      last, so the prefill is not in it);
  (4) the shared-prefix workload: 3N sessions, each its own --session-tokens prefix, on a pool whose
      memory budget holds N sessions' prefixes in bf16 (plus one running request); each session asks
      once, then all ask again most recent first (what an LRU pool still holds); sessions served from
      the cache on the second round (every full block of the prefix a hit; the hit tokens from the
      engine's stats): bf16 ~N, int8 >= 1.85N;
  (5) restart-from-disk TTFT: an engine writes a --disk-tokens prompt through to a disk tier (a tmp dir)
      and closes; a new engine on that directory serves the prompt again: its TTFT, the bytes the tier
      holds, int8 vs bf16 blocks.

Engine-level timings (no HTTP), --threads compute threads; the machine may be shared (the warning says so).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402

KV_DTYPES = ("bf16", "int8")


def _prompt_ids(tok: Any, n: int, seed: int) -> list[int]:
    """n tokens of prose (the shared passage from a seed-dependent offset, repeated as needed)."""
    words = bc.PASSAGE.split()
    out: list[int] = []
    i = seed * 37
    while len(out) < n:
        out += tok.encode(" " + " ".join(words[(i + j) % len(words)] for j in range(60)), add_special_tokens=False)
        i += 61
    return out[:n]


def _llm(model: str, kv: str, threads: int, **kw: Any) -> Any:
    from chatserve import LLM

    return LLM(model, kv_cache_dtype="auto" if kv == "bf16" else kv, num_threads=threads, **kw)


def _close(llm: Any) -> None:
    llm.engine.close()
    del llm
    gc.collect()


def _generate(engine: Any, rid: str, ids: list[int], n: int, logprobs: bool = False) -> dict[str, Any]:
    """Greedy, ignore_eos, step by step: tokens, chosen logprobs, TTFT and the decode rate after it."""
    from chatserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1 if logprobs else None)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    first = last = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            now = time.perf_counter()
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = now
            last, final = now, out
    assert final is not None and first is not None and last is not None
    c = final.outputs[0]
    chosen = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] if logprobs else []
    ntok = len(c.token_ids)
    return {"tokens": list(c.token_ids), "logprobs": chosen, "ttft": first - t0,
            "decode_tok_s": (ntok - 1) / (last - first) if ntok > 1 and last > first else None,
            "cached": final.num_cached_tokens, "stats": final.stats}


# ---- (1) ------------------------------------------------------------------------------------------------
def capacity(model: str) -> dict[str, Any]:
    import torch

    from chatserve.config import CacheConfig
    from chatserve.models.config import ModelConfig
    from chatserve.models.loader import load_hf_config, resolve_model
    from chatserve.worker.kv_pool import plan_kv_pool

    cfg = ModelConfig.from_hf(load_hf_config(resolve_model(model)))
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=1.0)
    res: dict[str, Any] = {"head_dim": cfg.head_dim, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads}
    for kv, dt in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        pool = plan_kv_pool(cfg, cache, dt)
        res[kv] = {"tokens_per_gib": pool.num_tokens, "bytes_per_token": pool.bytes_per_block // pool.block_size}
    res["ratio"] = res["int8"]["tokens_per_gib"] / res["bf16"]["tokens_per_gib"]
    return res


# ---- (2) and (3) ----------------------------------------------------------------------------------------
def accuracy_and_decode(model: str, a: argparse.Namespace) -> dict[str, Any]:
    from chatserve.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    longest = max(a.lengths)
    runs: dict[str, dict[int, dict[str, Any]]] = {kv: {} for kv in KV_DTYPES}
    rates: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    info: dict[str, Any] = {}
    for rep in range(a.repeats):
        for kv in (KV_DTYPES if rep % 2 == 0 else KV_DTYPES[::-1]):
            llm = _llm(model, kv, a.threads, max_model_len=longest + a.gen_tokens + 16, enable_prefix_caching=False)
            info[kv] = {"kv_cache_dtype": llm.engine_info().kv_cache_dtype, "kernels": llm.engine_info().kernels}
            for n in a.lengths:
                r = _generate(llm.engine, f"{kv}-{n}-{rep}", _prompt_ids(tok, n, 1), a.gen_tokens, logprobs=True)
                runs[kv][n] = r  # (greedy: the same tokens every repeat)
                if n == longest and r["decode_tok_s"] is not None:
                    rates[kv].append(r["decode_tok_s"])
                bc.log("accuracy", f"{os.path.basename(model)} {kv} {n} tokens: decode {bc.fmt(r['decode_tok_s'], '{:.1f}')} tok/s")
            _close(llm)
    acc = {}
    for n in a.lengths:
        ref, got = runs["bf16"][n], runs["int8"][n]
        same = [x == y for x, y in zip(ref["tokens"], got["tokens"])]
        first_div = same.index(False) if not all(same) else None
        upto = len(same) if first_div is None else first_div + 1  # the diverging token's context is shared too
        drift = [abs(x - y) for x, y in zip(ref["logprobs"][:upto], got["logprobs"][:upto])]
        acc[n] = {"identical_fraction": sum(same) / len(same), "first_divergence": first_div,
                  "mean_abs_logprob_drift": statistics.fmean(drift) if drift else None,
                  "max_abs_logprob_drift": max(drift) if drift else None, "tokens": len(same)}
    return {"accuracy": acc, "decode_context": longest,
            "decode_tok_s": {kv: statistics.median(v) if v else None for kv, v in rates.items()}, "engines": info}


# ---- (4) ------------------------------------------------------------------------------------------------
def shared_prefix(model: str, a: argparse.Namespace) -> dict[str, Any]:
    from chatserve.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    n, p = a.sessions, a.session_tokens
    total = 3 * n
    prefixes = [_prompt_ids(tok, p, 100 + s) for s in range(total)]
    bytes_per_token = capacity(model)["bf16"]["bytes_per_token"]
    budget_tokens = n * p + p + 128  # N sessions' prefixes and one running request, in bf16
    gb = budget_tokens * bytes_per_token / 2**30
    res: dict[str, Any] = {"sessions": total, "bf16_sessions_budget": n, "session_tokens": p, "kv_cache_memory_gb": gb}
    for kv in KV_DTYPES:
        llm = _llm(model, kv, a.threads, kv_cache_memory_gb=gb, max_model_len=p + 64)
        e = llm.engine
        for s in range(total):
            _generate(e, f"{kv}-a{s}", prefixes[s] + tok.encode(f" Question {s}?", add_special_tokens=False), 1)
        before = e.stats()
        served = 0
        block = llm.engine_info().block_size
        for s in reversed(range(total)):  # most recent first: what an LRU pool still holds
            r = _generate(e, f"{kv}-b{s}", prefixes[s] + tok.encode(f" Again {s}?", add_special_tokens=False), 1)
            served += r["cached"] >= p // block * block  # every full block of the prefix from the cache
        after = e.stats()
        res[kv] = {"pool_tokens": llm.engine_info().kv_pool_tokens, "sessions_served_from_cache": served,
                   "hit_tokens": after["prefix_cache_hits_tokens"] - before["prefix_cache_hits_tokens"],
                   "query_tokens": after["prefix_cache_queries_tokens"] - before["prefix_cache_queries_tokens"]}
        bc.log("prefix", f"{kv}: {res[kv]}")
        _close(llm)
    res["ratio"] = res["int8"]["sessions_served_from_cache"] / max(1, res["bf16"]["sessions_served_from_cache"])
    return res


# ---- (5) ------------------------------------------------------------------------------------------------
def restart_from_disk(model: str, a: argparse.Namespace) -> dict[str, Any]:
    from chatserve.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    ids = _prompt_ids(tok, a.disk_tokens, 7)
    ttfts: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    res: dict[str, Any] = {"prompt_tokens": len(ids)}
    for rep in range(a.repeats):
        for kv in (KV_DTYPES if rep % 2 == 0 else KV_DTYPES[::-1]):
            tmp = tempfile.mkdtemp(prefix="chatserve-kv8-")
            try:
                kw = {"max_model_len": len(ids) + 64, "kv_offload_dir": tmp}
                writer = _llm(model, kv, a.threads, kv_offload_policy="write_through", **kw)
                _generate(writer.engine, "w", ids, 2)
                _close(writer)
                disk_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*.kv"))
                reader = _llm(model, kv, a.threads, **kw)
                _generate(reader.engine, "warmup", _prompt_ids(tok, 200, 99), 2)
                r = _generate(reader.engine, "r", ids, 2)
                _close(reader)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            ttfts[kv].append(r["ttft"])
            res[kv] = {"disk_bytes": disk_bytes, "from_disk_tokens": r["stats"].num_disk_cached_tokens,
                       "kv_load_seconds": r["stats"].kv_load_seconds}
            bc.log("restart", f"{kv}: ttft {r['ttft']:.3f} s, {res[kv]}")
    for kv in KV_DTYPES:
        res[kv]["ttft_s"] = statistics.median(ttfts[kv])
    return res


def _print(results: dict[str, Any], a: argparse.Namespace) -> None:
    rows = [["model", "head_dim", "bf16 tokens/GiB", "int8 tokens/GiB", "x"]]
    for name, r in results["capacity"].items():
        rows.append([name, str(r["head_dim"]), str(r["bf16"]["tokens_per_gib"]), str(r["int8"]["tokens_per_gib"]),
                     bc.fmt(r["ratio"], "{:.3f}")])
    print("\n(1) tokens cached per GiB (the pool's accounting)\n")
    print(bc.markdown_table(rows))
    print(f"\n(2) int8 vs bf16 KV, greedy {a.gen_tokens} tokens (identical fraction, first divergence, |logprob drift| "
          "of the chosen tokens before it)\n")
    rows = [["model", "prompt tokens", "identical", "first divergence", "mean drift", "max drift"]]
    for name, r in results["accuracy"].items():
        for n, x in r["accuracy"].items():
            rows.append([name, str(n), bc.fmt(x["identical_fraction"], "{:.3f}"), bc.fmt(x["first_divergence"], "{}"),
                         bc.fmt(x["mean_abs_logprob_drift"], "{:.4f}"), bc.fmt(x["max_abs_logprob_drift"], "{:.4f}")])
    print(bc.markdown_table(rows))
    print("\n(3) decode tok/s, batch 1 (medians)\n")
    rows = [["model", "context", "bf16", "int8", "int8 / bf16"]]
    for name, r in results["accuracy"].items():
        d = r["decode_tok_s"]
        rows.append([name, str(r["decode_context"]), bc.fmt(d["bf16"], "{:.2f}"), bc.fmt(d["int8"], "{:.2f}"),
                     bc.fmt(bc.ratio(d["int8"], d["bf16"]), "{:.2f}")])
    print(bc.markdown_table(rows))
    sp = results["shared_prefix"]
    print(f"\n(4) shared prefixes: {sp['sessions']} sessions of {sp['session_tokens']} tokens, a budget of "
          f"{sp['kv_cache_memory_gb'] * 1024:.1f} MiB (N = {sp['bf16_sessions_budget']} sessions in bf16)\n")
    print(bc.markdown_table([["KV", "pool tokens", "sessions served from the cache", "prefix hit tokens"],
                             *[[kv, str(sp[kv]["pool_tokens"]), str(sp[kv]["sessions_served_from_cache"]),
                                str(sp[kv]["hit_tokens"])] for kv in KV_DTYPES]]))
    print(f"int8 / bf16 sessions served: {sp['ratio']:.2f}")
    rd = results["restart"]
    print(f"\n(5) restart from disk, a {rd['prompt_tokens']}-token prompt (medians of {a.repeats})\n")
    print(bc.markdown_table([["KV", "TTFT (s)", "tokens from disk", "bytes on disk", "load (s)"],
                             *[[kv, bc.fmt(rd[kv]["ttft_s"]), str(rd[kv]["from_disk_tokens"]), str(rd[kv]["disk_bytes"]),
                                bc.fmt(rd[kv]["kv_load_seconds"])] for kv in KV_DTYPES]]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--random-gguf", default=None, help="the 1B-class random GGUF (make_random_gguf.py --context 8704)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sessions", type=int, default=8, help="N: sessions the bf16 pool holds (3N run)")
    p.add_argument("--session-tokens", type=int, default=1000)
    p.add_argument("--disk-tokens", type=int, default=2000)
    p.add_argument("--short", action="store_true",
                   help="a quick check: lengths 300 and 600, 8 tokens, 1 repeat, N=3 of 256 tokens, a 500-token restart")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.short:
        a.lengths, a.gen_tokens, a.repeats, a.sessions, a.session_tokens, a.disk_tokens = [300, 600], 8, 1, 3, 256, 500
    busy = bc.start_parent()
    model = a.model or bc.default_gguf_path()
    models = {os.path.basename(model): model}
    if a.random_gguf:
        models[os.path.basename(a.random_gguf)] = a.random_gguf
    results: dict[str, Any] = {"capacity": {name: capacity(m) for name, m in models.items()}}
    results["accuracy"] = {name: accuracy_and_decode(m, a) for name, m in models.items()}
    results["shared_prefix"] = shared_prefix(model, a)
    results["restart"] = restart_from_disk(model, a)
    _print(results, a)
    if busy:
        print(f"\nWARNING: {busy}")
    if a.json:
        bc.write_json(a.json, {"env": bc.env_info(), "args": vars(a), "results": results, "busy": busy})
    return 0


if __name__ == "__main__":
    sys.exit(main())
