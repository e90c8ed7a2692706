#!/usr/bin/env python3
"""KV tiers below the radix tree (issue 31): TTFT after a restart (disk) and on a second replica (Redis).

    python benchmarks/engine/bench_kv_offload.py                          # SmolLM2-135M GGUF, 2 threads, Redis on :6379/9
    python benchmarks/engine/bench_kv_offload.py --repeats 1 --system-tokens 500 --mt-sessions 3   # a quick smoke run
    python benchmarks/engine/bench_kv_offload.py --json bench_results/kv_offload.json

Every phase runs in a fresh process, with the same engine flags, so a "restart" is one:

  (a) one 2,000-token shared system prompt (--system-tokens) + a distinct ~12-token question per request:
      * ``cold``: a fresh engine with the tiers on (disk dir + Redis), first request: the whole prefill;
      * ``warm memory``: the same engine, the next request: the system prompt is in the radix tree;
        the engine then closes (write-back of the tree to disk and Redis);
      * ``restart (disk)``: a fresh process, same disk dir, Redis off: its first request loads the prompt
        from disk;
      * ``replica (redis)``: a fresh process, an empty disk dir, same Redis: its first request loads the
        prompt from Redis.
      Repeated --repeats times (new dir and Redis prefix each time), phases alternated; medians printed.
      Targets: disk and Redis TTFT <= 1.5x the warm memory hit and <= 0.25x cold.
  (b) multi-turn larger than the KV pool: --mt-sessions sessions x --mt-turns turns over a --mt-system-tokens
      shared system prompt, round robin (turn k of every session, then turn k+1), one request at a time,
      on a pool of --mt-kv-blocks blocks (far less than the sessions' histories): each session's history
      is evicted before its next turn. Tiers off vs on (disk, write-back): cached fraction of prompt
      tokens (turns 2+), TTFT p50 / p90 (turns 2+).

TTFT = wall time from ``add_request`` to the return of the first ``step()`` whose output has a token
(engine-level, no HTTP); it includes the tier lookup and load, which run on the engine's loader thread.
Greedy, ignore_eos. The machine may be shared: the busy warning says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402

MARKER = "BENCH_KV_OFFLOAD_RESULT_JSON: "


def _text_ids(tok: Any, n: int, seed: int) -> list[int]:
    words = ["rule", "answer", "politely", "cite", "source", "topic", "keep", "short", "check", "facts", "always",
             "never", "guess", "explain", "steps", "clearly", "user", "asks", "about", "when"]
    out: list[int] = []
    i = seed
    while len(out) < n:
        sentence = f"Rule {i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(10)) + "."
        out += tok.encode(" " + sentence, add_special_tokens=False)
        i += 1
    return out[:n]


def _ttft(engine: Any, rid: str, ids: list[int], max_tokens: int) -> tuple[float, Any]:
    from chatserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    ttft = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                if ttft is None and out.outputs and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                final = out
    assert ttft is not None and final is not None
    return ttft, final


def _llm(spec: dict[str, Any], **tiers: Any) -> Any:
    from chatserve import LLM

    return LLM(spec["model"], num_threads=spec["threads"], max_model_len=spec["max_model_len"],
               num_kv_blocks=spec.get("num_kv_blocks"), **tiers)


def _engine(spec: dict[str, Any], **tiers: Any) -> Any:
    return _llm(spec, **tiers).engine


def _warm_up(engine: Any, tok: Any) -> None:
    _ttft(engine, "warmup", _text_ids(tok, 300, 10_000), 2)
    assert engine.reset_prefix_cache()


def worker(phase: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One phase in this process; returns its measurements."""
    from chatserve.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(spec["model"]))
    system = _text_ids(tok, spec["system_tokens"], 0)

    def question(k: int) -> list[int]:
        return tok.encode(f" Question {k}: what does rule {k} say about sources?", add_special_tokens=False)

    res: dict[str, Any] = {"phase": phase}
    if phase == "writer":
        e = _engine(spec, kv_offload_dir=spec["dir"], kv_offload_redis_url=spec["redis_url"],
                    kv_offload_redis_prefix=spec["prefix"])
        _warm_up(e, tok)
        res["cold"], out = _ttft(e, "cold", system + question(1), spec["max_tokens"])
        res["cold_cached"] = out.num_cached_tokens
        res["warm_memory"], out = _ttft(e, "warm", system + question(2), spec["max_tokens"])
        res["warm_cached"] = out.num_cached_tokens
        t0 = time.perf_counter()
        e.close()
        res["close_seconds"] = time.perf_counter() - t0
    elif phase in ("restart", "replica"):
        tiers = ({"kv_offload_dir": spec["dir"]} if phase == "restart" else
                 {"kv_offload_dir": spec["empty_dir"], "kv_offload_redis_url": spec["redis_url"],
                  "kv_offload_redis_prefix": spec["prefix"]})
        e = _engine(spec, **tiers)
        _warm_up(e, tok)
        res["ttft"], out = _ttft(e, phase, system + question(3), spec["max_tokens"])
        res["cached"] = out.num_cached_tokens
        res["from_disk"], res["from_redis"] = out.stats.num_disk_cached_tokens, out.stats.num_redis_cached_tokens
        res["load_seconds"] = out.stats.kv_load_seconds
        e.close()
    elif phase in ("mt_off", "mt_on"):
        tiers = {"kv_offload_dir": spec["dir"]} if phase == "mt_on" else {}
        # (max_model_len: the pool's, so one session's history always fits the pool, just not all of them)
        llm = _llm({**spec, "num_kv_blocks": spec["mt_kv_blocks"], "max_model_len": None}, **tiers)
        e = llm.engine
        _warm_up(e, tok)
        msys = _text_ids(tok, spec["mt_system_tokens"], 0)
        hist = [msys + _text_ids(tok, 24, 500 + s) for s in range(spec["mt_sessions"])]
        ttfts, cached, prompt = [], 0, 0
        for turn in range(spec["mt_turns"]):
            for s in range(spec["mt_sessions"]):
                ids = hist[s] + question(100 * s + turn)
                t, out = _ttft(e, f"s{s}t{turn}", ids, spec["mt_max_tokens"])
                if turn > 0:
                    ttfts.append(t)
                    cached += out.num_cached_tokens
                    prompt += len(ids)
                hist[s] = ids + list(out.outputs[0].token_ids)
        res["ttft_p50"] = statistics.median(ttfts)
        res["ttft_p90"] = sorted(ttfts)[max(0, int(0.9 * len(ttfts) + 0.5) - 1)]
        res["cached_fraction"] = cached / max(1, prompt)
        res["history_tokens"] = sum(len(h) for h in hist)
        res["pool_tokens"] = llm.engine_info().kv_pool_tokens
        offload = e.stats()["kv_offload"]  # None without a tier
        res["kv_offload"] = None if offload is None else {
            k: offload[k] for k in ("num_lookups", "num_loaded_blocks", "dropped_blocks")}
        e.close()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    p.add_argument("--mt-sessions", type=int, default=6)
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-system-tokens", type=int, default=300)
    p.add_argument("--mt-max-tokens", type=int, default=16)
    p.add_argument("--mt-kv-blocks", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        spec = bc.load_spec(a.spec)
        assert spec is not None
        try:
            return bc.finish_worker(MARKER, worker(a.worker, spec))
        except Exception as exc:  # noqa: BLE001 - reported in the result line
            return bc.finish_worker(MARKER, {"phase": a.worker}, exc)
    busy = bc.start_parent()
    import redis

    base = {"model": a.model or bc.default_gguf_path(), "threads": a.threads, "system_tokens": a.system_tokens,
            "max_tokens": a.max_tokens, "max_model_len": max(a.system_tokens + 128, 1024), "redis_url": a.redis_url,
            "mt_sessions": a.mt_sessions, "mt_turns": a.mt_turns, "mt_system_tokens": a.mt_system_tokens,
            "mt_max_tokens": a.mt_max_tokens, "mt_kv_blocks": a.mt_kv_blocks}

    def run(phase: str, spec: dict[str, Any]) -> dict[str, Any]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", phase, "--spec", f.name]
            out = bc.run_worker_process(cmd, phase, result_marker=MARKER, timeout=1800, threads=a.threads)
        finally:
            os.unlink(f.name)
        if "error" in out:
            raise SystemExit(f"{phase} failed: {out['error']}")
        return out

    rows: list[dict[str, Any]] = []
    for r in range(a.repeats):
        tmp = tempfile.mkdtemp(prefix="chatserve-kvbench-")
        prefix = f"chatserve-bench-kv-{uuid.uuid4().hex}:"
        spec = {**base, "dir": os.path.join(tmp, "disk"), "empty_dir": os.path.join(tmp, "empty"), "prefix": prefix}
        try:
            w = run("writer", spec)
            order = ("restart", "replica") if r % 2 == 0 else ("replica", "restart")
            got = {ph: run(ph, spec) for ph in order}
            rows.append({"cold": w["cold"], "warm_memory": w["warm_memory"], "disk": got["restart"]["ttft"],
                         "redis": got["replica"]["ttft"], "warm_cached": w["warm_cached"],
                         "disk_tokens": got["restart"]["from_disk"], "redis_tokens": got["replica"]["from_redis"],
                         "disk_load": got["restart"]["load_seconds"], "redis_load": got["replica"]["load_seconds"]})
            bc.log("main", f"repeat {r + 1}: {rows[-1]}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with redis.Redis.from_url(a.redis_url) as client:
                keys = list(client.scan_iter(f"{prefix}*"))
                if keys:
                    client.delete(*keys)

    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    table = [["", "TTFT (s)", "x warm memory", "x cold", "prompt tokens cached"],
             ["cold (first request)", bc.fmt(med["cold"]), bc.fmt(med["cold"] / med["warm_memory"], "{:.2f}"), "1.00", "0"],
             ["warm memory hit", bc.fmt(med["warm_memory"]), "1.00", bc.fmt(med["warm_memory"] / med["cold"], "{:.3f}"),
              bc.fmt(med["warm_cached"], "{:.0f}")],
             ["after a restart (disk)", bc.fmt(med["disk"]), bc.fmt(med["disk"] / med["warm_memory"], "{:.2f}"),
              bc.fmt(med["disk"] / med["cold"], "{:.3f}"), bc.fmt(med["disk_tokens"], "{:.0f}")],
             ["second replica (redis)", bc.fmt(med["redis"]), bc.fmt(med["redis"] / med["warm_memory"], "{:.2f}"),
              bc.fmt(med["redis"] / med["cold"], "{:.3f}"), bc.fmt(med["redis_tokens"], "{:.0f}")]]
    print(f"\n(a) {a.system_tokens}-token shared system prompt, medians of {a.repeats} repeats "
          f"(disk load {med['disk_load'] * 1000:.0f} ms, Redis load {med['redis_load'] * 1000:.0f} ms of the TTFT)\n")
    print(bc.markdown_table(table))

    tmp = tempfile.mkdtemp(prefix="chatserve-kvbench-mt-")
    try:
        mt = {m: run(m, {**base, "dir": os.path.join(tmp, "disk")}) for m in ("mt_off", "mt_on")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n(b) multi-turn: {a.mt_sessions} sessions x {a.mt_turns} turns, {mt['mt_on']['history_tokens']} history "
          f"tokens over a pool of {mt['mt_on']['pool_tokens']} tokens; turns 2+\n")
    print(bc.markdown_table([
        ["tiers", "cached fraction", "TTFT p50 (s)", "TTFT p90 (s)"],
        *[[name, bc.fmt(mt[m]["cached_fraction"], "{:.3f}"), bc.fmt(mt[m]["ttft_p50"]), bc.fmt(mt[m]["ttft_p90"])]
          for name, m in (("off", "mt_off"), ("on (disk)", "mt_on"))]]))
    if busy:
        print(f"\nWARNING: {busy}")
    if a.json:
        bc.write_json(a.json, {"env": bc.env_info(), "runs": rows, "medians": med, "multi_turn": mt, "busy": busy})
    return 0


if __name__ == "__main__":
    sys.exit(main())
