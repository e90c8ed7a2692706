#!/usr/bin/env python3
"""Start-up time and shared memory with and without the repacked-weight cache (issue #33).

    python benchmarks/models/bench_load.py                                  # the default model, 5 alternated rounds
    python benchmarks/models/bench_load.py --model /tmp/llama-1b-q4_0.gguf --rounds 3
    python benchmarks/models/bench_load.py --model /tmp/llama-1b-q4_0.gguf --replicas-only

Each start is a fresh process (`python -c ...`: interpreter, imports, `LLM(...)`, one greedy token);
"process start to first token" is the parent's wall clock from spawning it to reading the line the
child prints after its first token. The rounds alternate cache off / cache on (so both see the same
machine load), after one start that writes the entry (reported as the first start). The page cache
is warm for every start (the GGUF and the entry were read by earlier rounds): a warm start, as a
restarted server or a second replica gets.

Replicas: two processes of the same model held side by side after their first token; each reports
its /proc/self/smaps_rollup (Rss, Pss, Shared_Clean, Private_*): with the cache the weights are
file-backed pages of the one entry, counted half in each Pss and as Shared_Clean.

With `--llamacpp PYTHON` (e.g. .venv-llamacpp/bin/python), llama.cpp on the same file joins every
round (benchmarks/peers/llamacpp_bench.py --first-token: interpreter, `import llama_cpp`, `Llama(...)` with
the file mapped, one greedy token) and its two replicas are measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from chatserve import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(model=sys.argv[1] or None, weight_cache=sys.argv[2] == "1", num_threads=int(sys.argv[3]),
          max_model_len=256, num_kv_blocks=32)
t2 = time.perf_counter()
llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0.0))
t3 = time.perf_counter()
print("first token", flush=True)
llm.generate("Tell me a story", SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
t4 = time.perf_counter()


def smaps():
    rollup = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            rollup[parts[0].rstrip(":")] = int(parts[1])
    return rollup


info = llm.engine_info()
print(json.dumps({"imports_s": t1 - t0, "engine_s": t2 - t1, "load_s": info.weights_load_seconds,
                  "first_token_s": t3 - t2,
                  "decode_tok_s": 32 / (t4 - t3), "status": info.weight_cache_status, "smaps": smaps()}), flush=True)
if sys.argv[4] == "hold":  # both replicas are up: report memory now, then wait to be told to exit
    sys.stdin.readline()
    print(json.dumps(smaps()), flush=True)
    sys.stdin.readline()
"""


LLAMACPP = "llama.cpp"  # the `cache` value of a llama.cpp start
# llama.cpp's side of a start (it runs under llama.cpp's own interpreter, imports nothing of ours)
LLAMACPP_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers", "llamacpp_bench.py")


def start(model: str, cache: bool | str, threads: int, hold: bool, env: dict) -> tuple[subprocess.Popen, float]:
    if cache == LLAMACPP:
        cmd = [env["BENCH_LLAMACPP_PYTHON"], LLAMACPP_BENCH,
               model or env["BENCH_DEFAULT_MODEL"], "--first-token", "--threads", str(threads), *(["--hold"] if hold else [])]
    else:
        cmd = [sys.executable, "-c", CHILD, model, "1" if cache else "0", str(threads), "hold" if hold else "run"]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    return proc, t


def read_report(proc: subprocess.Popen, t_start: float) -> dict:
    line = proc.stdout.readline()
    wall = time.perf_counter() - t_start
    if not line:
        raise RuntimeError(f"child exited with {proc.wait()} before its first token")
    report = json.loads(proc.stdout.readline())
    report["wall_s"] = wall
    return report


def one_start(model: str, cache: bool | str, threads: int, env: dict) -> dict:
    proc, t = start(model, cache, threads, False, env)
    report = read_report(proc, t)
    proc.wait()
    return report


def label_of(cache: bool | str) -> str:
    return cache if isinstance(cache, str) else f"cache {'on' if cache else 'off'}"


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a .gguf or HF folder (default: the default model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=None, help="CHATSERVE_CACHE_DIR for the children (default: a fresh temp dir)")
    p.add_argument("--replicas-only", action="store_true")
    p.add_argument("--llamacpp", default="", metavar="PYTHON", help="also start llama.cpp on the same file in every "
                   "round and as two replicas (benchmarks/peers/llamacpp_bench.py under this interpreter)")
    args = p.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="bench-load-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATSERVE_CACHE_DIR": cache_dir}
    kinds: list[bool | str] = [False, True]
    if args.llamacpp:
        from chatserve.models.loader import default_model_path

        env["BENCH_LLAMACPP_PYTHON"], env["BENCH_DEFAULT_MODEL"] = args.llamacpp, str(default_model_path())
        kinds.append(LLAMACPP)
    name = os.path.basename(args.model) or "default model"

    first = one_start(args.model, True, args.threads, env)  # converts the metadata (if new) and writes the entry
    if first["status"] != "built":  # the metadata conversion ran too: time a clean first start
        print(f"note: first start status {first['status']}")
    print(f"{name}: first start (writes the entry): wall {first['wall_s']:.2f} s, load {first['load_s']:.2f} s, "
          f"status {first['status']}", flush=True)
    if not args.replicas_only:
        runs: dict[bool | str, list[dict]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for cache in kinds:
                r = one_start(args.model, cache, args.threads, env)
                runs[cache].append(r)
                print(f"  {label_of(cache)}: wall {r['wall_s']:.2f} load {r['load_s']:.2f} ({r['status']})", flush=True)
        llamacpp_col = " llama.cpp (mapped GGUF) |" if args.llamacpp else ""
        print(f"\n| {name}, {args.threads} threads | cache off (today) | cache on (mapped) |{llamacpp_col}\n"
              f"|---|---|---|{'---|' if args.llamacpp else ''}")
        for key, label in (("wall_s", "process start to first token (s)"), ("engine_s", "LLM(...) (s)"),
                           ("load_s", "model weights load (s)"), ("first_token_s", "first token after load (s)"),
                           ("decode_tok_s", "then decode, 1 stream (tok/s, incl. a short prefill)")):
            cells = [fmt([r[key] for r in runs[k]]) if key in runs[k][0] else "" for k in kinds]
            if key == "load_s" and args.llamacpp:
                cells[-1] += " (`Llama(...)`)"
            print(f"| {label} | {' | '.join(cells)} |")
        for cache in kinds:
            rss = [r["smaps"]["Rss"] / 1024 for r in runs[cache]]
            print(f"  RSS after the first token, {label_of(cache)}: {statistics.median(rss):.0f} MiB")

    for cache in kinds:
        procs = [start(args.model, cache, args.threads, True, env) for _ in range(2)]
        reports = [read_report(proc, t) for proc, t in procs]
        for (proc, _), r in zip(procs, reports):
            proc.stdin.write("\n")
            proc.stdin.flush()
            r["smaps"] = json.loads(proc.stdout.readline())
        for proc, _ in procs:
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.wait()
        print(f"\ntwo replicas, {label_of(cache)} ({', '.join(r['status'] for r in reports)}), MiB each:")
        print("| replica | Rss | Pss | Shared_Clean | Private_Clean | Private_Dirty |\n|---|---|---|---|---|---|")
        for i, r in enumerate(reports):
            s = r["smaps"]
            print(f"| {i + 1} | {s['Rss'] / 1024:.0f} | {s['Pss'] / 1024:.0f} | {s['Shared_Clean'] / 1024:.0f} | "
                  f"{s['Private_Clean'] / 1024:.0f} | {s['Private_Dirty'] / 1024:.0f} |")
        total_pss = sum(r["smaps"]["Pss"] for r in reports) / 1024
        print(f"sum of Pss (what the two cost the machine): {total_pss:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
