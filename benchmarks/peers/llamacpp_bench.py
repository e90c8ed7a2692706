#!/usr/bin/env python3
"""llama.cpp's side of the family and load benchmarks: one GGUF file, measured the way
benchmarks/models/bench_families.py and benchmarks/models/bench_moe.py measure chatserve.

Runs under the llama-cpp-python virtualenv (.venv-llamacpp, built by
`benchmarks/peers/compare_llamacpp.sh --install-only`), never under chatserve's: it imports nothing of ours.

    .venv-llamacpp/bin/python benchmarks/peers/llamacpp_bench.py FILE.gguf --prefill 1000 --decode 32 --runs 3
    .venv-llamacpp/bin/python benchmarks/peers/llamacpp_bench.py FILE.gguf --first-token   # one start, then exit

What it measures, with `n_threads` = `n_threads_batch` = --threads and llama.cpp's default batch
sizes (n_batch 512), the file mapped (llama.cpp's default, use_mmap):

- load_s: `Llama(...)` construction (map the file, build the context);
- prefill_<N>_s: evaluating N random token ids from an empty KV cache (median of --runs);
- decode_tok_s: greedy decode of --decode tokens after an 8-token prompt, one token per eval
  (batch 1), median of --runs;
- --first-token: the process prints "first token" right after its first generated token and then
  a JSON report (load seconds, /proc/self/smaps_rollup), so a parent can time "process start to
  first token"; with --hold it then waits for a line on stdin, reports smaps again (both replicas
  up), and exits at the next line: benchmarks/models/bench_load.py --llamacpp's child protocol.

Random token ids come from numpy's default_rng(1), the same draw bench_families.py makes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def greedy_next(llm) -> int:
    """The argmax of the last evaluated token's logits, read from the context itself.

    Why not `llm.scores`: with logits_all=False, llama-cpp-python 0.3.x no longer copies the logits
    into `scores` (its rows stay stale, and a prompt longer than n_batch indexes past them); the
    context's logits pointer holds the last token's row (the only row computed)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def smaps() -> dict[str, int]:
    rollup = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                rollup[parts[0].rstrip(":")] = int(parts[1])
    return rollup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--first-token", action="store_true", help="load, generate one token, report, exit")
    ap.add_argument("--hold", action="store_true", help="with --first-token: stay up for a memory reading")
    args = ap.parse_args()

    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=max(2048, args.prefill + args.decode + 16),
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    rng = np.random.default_rng(1)
    prompt = rng.integers(100, vocab - 100, args.prefill).tolist()
    short = rng.integers(100, vocab - 100, 8).tolist()

    if args.first_token:
        llm.eval(short)
        greedy_next(llm)
        print("first token", flush=True)
        print(json.dumps({"engine": "llama.cpp", "load_s": load_s, "status": "llama.cpp", "smaps": smaps()}), flush=True)
        if args.hold:
            sys.stdin.readline()
            print(json.dumps(smaps()), flush=True)
            sys.stdin.readline()
        return 0

    llm.reset()
    llm.eval(short[:4])  # warm-up
    prefill, decode = [], []
    for _ in range(args.runs):  # alternated, as bench_families.py does: a prefill, then a decode run
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        greedy_next(llm)
        prefill.append(time.perf_counter() - t0)
        llm.reset()
        llm.eval(short)
        t0 = time.perf_counter()
        for _ in range(args.decode):
            llm.eval([greedy_next(llm)])
        decode.append(args.decode / (time.perf_counter() - t0))
    print(json.dumps({
        "engine": "llama.cpp", "version": llama_cpp.__version__, "file": args.gguf, "load_s": round(load_s, 2),
        f"prefill_{args.prefill}_s": round(statistics.median(prefill), 2),
        "decode_tok_s": round(statistics.median(decode), 2), "runs": args.runs, "threads": args.threads,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
