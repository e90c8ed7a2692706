#!/usr/bin/env python
"""What HTTP + SSE cost over the engine alone, and which thread layout streams smoothest.

Runs one workload (C concurrent streams, distinct prompts, fixed output length) twice:
  1. engine alone: AsyncLLMEngine in this process, consuming delta outputs;
  2. through the server: `chatserve serve` in a subprocess, C concurrent httpx SSE streams;
for each `--num-threads` value (torch compute threads of the engine). Reports output tokens/s,
the server/engine ratio, and inter-token latency p50/p99 as the clients saw it.

    python benchmarks/serving/bench_server_overhead.py --concurrency 16 --max-tokens 128 --num-threads 2 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common
from bench_common import PASSAGE  # noqa: E402  (stdlib-only at import time)

ROOT = Path(__file__).resolve().parents[2]


def prompts(n: int) -> list[str]:
    words = PASSAGE.split()
    return [f"Question {i}: summarise this passage. " + " ".join(words[i * 7 : i * 7 + 40]) for i in range(n)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_engine(engine, texts: list[str], max_tokens: int) -> tuple[int, float, list[float]]:
    from chatserve import SamplingParams
    from chatserve.llm import apply_chat_template  # (re-exported there for scripts)

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind="delta")
    gaps: list[float] = []

    async def one(i: int) -> int:
        n, last = 0, None
        ids = apply_chat_template(engine.get_tokenizer(), [{"role": "user", "content": texts[i]}])
        async for out in engine.generate({"prompt_token_ids": ids}, params.clone(), request_id=f"e{i}-{time.time()}"):
            now = time.perf_counter()
            k = len(out.outputs[0].token_ids)
            if k and last is not None:
                gaps.extend([(now - last) / k] * k)
            if k:
                last = now
            n += k
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(texts))))
    return sum(counts), time.perf_counter() - t0, gaps


def engine_alone(args, threads: int | None) -> dict:
    from chatserve import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(num_threads=threads, max_model_len=2048,
                                                        enable_prefix_caching=False))
    texts = prompts(args.concurrency)

    async def main():
        await run_engine(engine, texts[:2], 8)  # warm-up
        result = await run_engine(engine, texts, args.max_tokens)
        await engine.shutdown()
        return result

    tokens, wall, gaps = asyncio.run(main())
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "itl_p50_ms": pct(gaps, 0.5) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_http(url: str, texts: list[str], max_tokens: int) -> tuple[int, float, list[float]]:
    import httpx

    gaps: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"messages": [{"role": "user", "content": texts[i]}], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        n, last = 0, None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        return n

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(len(texts))))
        return sum(counts), time.perf_counter() - t0, gaps


def through_server(args, threads: int | None) -> dict:
    import httpx
    import psutil

    port = free_port()
    cmd = [sys.executable, "-m", "chatserve", "serve", "--port", str(port), "--log-level", "warning",
           "--max-model-len", "2048", "--no-enable-prefix-caching"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.3)
        texts = prompts(args.concurrency)
        asyncio.run(run_http(url, texts[:2], 8))  # warm-up
        me, srv = psutil.Process(), psutil.Process(proc.pid)
        c0, s0 = me.cpu_times(), srv.cpu_times()
        tokens, wall, gaps = asyncio.run(run_http(url, texts, args.max_tokens))
        c1, s1 = me.cpu_times(), srv.cpu_times()
        client_cpu = (c1.user + c1.system - c0.user - c0.system) / wall
        server_cpu = (s1.user + s1.system - s0.user - s0.system) / wall
    finally:
        proc.terminate()
        proc.wait(30)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "itl_p50_ms": pct(gaps, 0.5) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3, "client_cores": client_cpu, "server_cores": server_cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, nargs="+", default=[0], help="0 = torch's default (all cores)")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--mode", choices=["both", "engine"], default="both", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "engine":  # the child process of one engine-alone measurement
        print(json.dumps(engine_alone(args, args.num_threads[0] or None)))
        return
    rows = []
    for t in args.num_threads:
        # NOTE: the engine runs in a child process, so its threads and memory are gone before the server runs.
        out = subprocess.run([sys.executable, __file__, "--mode", "engine", "--concurrency", str(args.concurrency),
                              "--max-tokens", str(args.max_tokens), "--num-threads", str(t)],
                             capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if out.returncode != 0:
            sys.exit(f"engine-alone run failed:\n{out.stderr[-3000:]}")
        eng = json.loads(out.stdout.strip().splitlines()[-1])
        srv = through_server(args, t or None)
        rows.append((t or "default", eng, srv))
    print(f"\nconcurrency {args.concurrency}, {args.max_tokens} output tokens each, distinct prompts, prefix cache off")
    print(f"{'threads':>8} | {'engine tok/s':>12} | {'HTTP+SSE tok/s':>14} | {'ratio':>6} | "
          f"{'engine ITL p50/p99 ms':>22} | {'HTTP ITL p50/p99 ms':>20} | cores used by client / server")
    for t, eng, srv in rows:
        print(f"{t!s:>8} | {eng['tok_s']:12.1f} | {srv['tok_s']:14.1f} | {srv['tok_s'] / eng['tok_s']:6.2f} | "
              f"{eng['itl_p50_ms']:10.1f} / {eng['itl_p99_ms']:9.1f} | {srv['itl_p50_ms']:9.1f} / {srv['itl_p99_ms']:8.1f} | "
              f"{srv['client_cores']:.2f} / {srv['server_cores']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"threads": str(t), "engine": e, "server": s} for t, e, s in rows], indent=2))


if __name__ == "__main__":
    main()
