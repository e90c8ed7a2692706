#!/usr/bin/env python3
"""The bf16 matmul on this CPU: the batch-invariant kernel of the best tier (csrc/tier_gemm.cpp) next to
the measured peak of its dot-product step (vdpbf16ps on AVX512-BF16, fma elsewhere) and oneDNN
(torch F.linear on bf16), in one run.

    python benchmarks/kernels/bench_matmul.py                  # all threads; hot-cache GFLOP/s per shape and M, then the model sweep
    python benchmarks/kernels/bench_matmul.py --threads 1      # one core (steadier on a busy machine)
    python benchmarks/kernels/bench_matmul.py --rows 1,8,32 --shapes 576x576 --no-sweep

Method:
  * peak      register-only loop of the tier's dot-product instruction (independent accumulators, no
              memory operands) on every thread at once: the best of --peak-runs short runs, before and
              after the table, so moments when another process holds a core do not count.
  * per shape the same x [M, K] and weight every call (hot in cache); best of the calls made in
              --seconds; GFLOP/s = 2 M N K / time.
  * sweep     the default model's weights, 30 layers of qkv/o/gate_up/down plus the tied lm_head (270 MB,
              in one huge-page arena each way: cold in cache, as in decode), one call per weight at M
              rows; best of --sweep-repeats; ms per pass.
Timings on a machine shared with other processes are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatserve.kernels.cpu import load_cpu_kernels

MODEL_SHAPES = [(960, 576), (576, 576), (192, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down of one layer
LAYERS, LM_HEAD = 30, (49152, 576)


def best_time(fn: Callable[[], object], seconds: float, at_least: int = 3) -> float:
    fn()
    best, calls = float("inf"), 0
    end = time.perf_counter() + seconds
    while calls < at_least or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def measure_peak(gemm, runs: int) -> float:
    return max(gemm.peak_gflops(200_000) for _ in range(runs))


def per_shape(kernels, shapes, rows, seconds: float) -> list[list[str]]:
    gemm = kernels.gemm
    table = [["shape N x K", "M", "ours GFLOP/s", "oneDNN GFLOP/s", "ours / oneDNN"]]
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        packed = gemm.pack(w)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            flops = 2 * m * n * k
            ours = flops / best_time(lambda: gemm.linear(x, packed, None, n), seconds) / 1e9  # noqa: B023 (called here)
            onednn = flops / best_time(lambda: F.linear(x, w), seconds) / 1e9  # noqa: B023
            table.append([f"{n} x {k}", str(m), f"{ours:.0f}", f"{onednn:.0f}", f"{ours / onednn:.2f}"])
            print(" | ".join(table[-1]), flush=True)
    return table


def sweep(kernels, rows, repeats: int) -> list[list[str]]:
    """One pass over the model's weights at M rows, each weight once (decode streams them all)."""
    gemm = kernels.gemm
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    gen = torch.Generator().manual_seed(0)
    plain_numel = sum(n * k for n, k in shapes)
    packed_numel = sum(int(torch.tensor(gemm.packed_shape(n, k)).prod()) for n, k in shapes)
    plain_arena, packed_arena = kernels.huge_page_zeros(plain_numel), kernels.huge_page_zeros(packed_numel)
    plain, packed = [], []
    p0 = q0 = 0
    for n, k in shapes:
        w = plain_arena[p0 : p0 + n * k].view(n, k)
        w.copy_((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
        size = int(torch.tensor(gemm.packed_shape(n, k)).prod())
        packed.append(gemm.pack(w, out=packed_arena[q0 : q0 + size].view(gemm.packed_shape(n, k))))
        plain.append(w)
        p0, q0 = p0 + n * k, q0 + size
    flops_per_row = 2 * plain_numel
    table = [["M", "ours ms", "oneDNN ms", "ours GFLOP/s", "oneDNN / ours"]]
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}

        def ours(xs: dict[int, torch.Tensor] = xs) -> None:
            for (n, k), p in zip(shapes, packed):
                gemm.linear(xs[k], p, None, n)

        def onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for (_, k), w in zip(shapes, plain):
                F.linear(xs[k], w)

        t = {name: best_time(fn, 0.0, at_least=repeats) for name, fn in (("ours", ours), ("onednn", onednn))}
        table.append([str(m), f"{t['ours'] * 1e3:.2f}", f"{t['onednn'] * 1e3:.2f}",
                      f"{flops_per_row * m / t['ours'] / 1e9:.0f}", f"{t['onednn'] / t['ours']:.2f}"])
        print(" | ".join(table[-1]), flush=True)
    return table


def markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.rjust(widths[i]) for i, c in enumerate(r)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rows", default="1,8,32,128,256,512,1000", help="row counts M, comma separated")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in MODEL_SHAPES), help="N x K, comma separated")
    ap.add_argument("--seconds", type=float, default=0.4, help="timing window per (shape, M, kernel)")
    ap.add_argument("--peak-runs", type=int, default=200)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="1,2,4,8,16,32")
    ap.add_argument("--sweep-repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(amx=False)
    if kernels is None or kernels.gemm is None:
        print("no kernel tier on this machine (needs AVX2 + FMA)")
        return 1
    rows = [int(v) for v in args.rows.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    print(f"threads {args.threads}, load average at start {os.getloadavg()}")
    peak = measure_peak(kernels.gemm, args.peak_runs)
    print(f"{kernels.tier}: measured dot-product peak {peak:.0f} GFLOP/s on {args.threads} threads")
    table = per_shape(kernels, shapes, rows, args.seconds)
    peak = max(peak, measure_peak(kernels.gemm, args.peak_runs))  # again at the end: the best moment counts
    print(f"measured dot-product peak (best of start and end): {peak:.0f} GFLOP/s")
    table[0].append("ours / peak")
    for r in table[1:]:
        r.append(f"{float(r[2]) / peak:.0%}")
    print(markdown(table))
    if not args.no_sweep:
        print(markdown(sweep(kernels, [int(v) for v in args.sweep_rows.split(",")], args.sweep_repeats)))
    print(f"load average at the end {os.getloadavg()}; peak {peak:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
