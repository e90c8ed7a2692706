#!/usr/bin/env python3
"""The tiered quantized matmul (csrc/tier_quant.cpp, issue #30) on this CPU: per SmolLM2-135M shape,
format and row count, beside torch's fp32 F.linear; then one pass over the whole model's weights.

    python benchmarks/kernels/bench_tier_quant.py                          # the best tier this CPU runs, 2 threads
    python benchmarks/kernels/bench_tier_quant.py --tier avx2 --types Q4_1 --rows 1,1000 --no-sweep

Why these numbers: decode (M = 1) should stream the packed weights near the memory's rate (GB/s of
packed bytes per call), prefill (M = 1000) should run near the int8 dot-product peak (GOPS = 2 M N K
per second); the sweep is what one decode step (or a 1000-token prefill) spends in these matmuls
for the model as its GGUF file stores it (Q4_1 layers, the tied Q8_0 lm_head), each weight in its own
memory (cold in cache, as in decode).

Method: per shape the same x and packed weight every call (hot in cache where it fits); best of the
calls made in --seconds. Raw blocks come from gguf's quantizer (Q4_0, Q4_1, Q8_0) or are random valid
blocks (Q4_K, Q6_K): the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from chatserve.config import EngineArgs  # noqa: E402
from chatserve.kernels.cpu_quant import BLOCK_VALUES, QTYPE_INT8_CHANNEL, load_quant_kernels  # noqa: E402
from chatserve.kernels.tiers import supported_tiers  # noqa: E402

# SmolLM2-135M: qkv (q 576 + k, v 192 each), k or v alone, o, gate|up fused, down, the tied lm_head
SHAPES = [(960, 576), (192, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYERS = 30
LAYER_WEIGHTS = [((960, 576), "Q4_1"), ((576, 576), "Q4_1"), ((3072, 576), "Q4_1"), ((576, 1536), "Q4_1")]
LM_HEAD = ((49152, 576), "Q8_0")
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "INT8": QTYPE_INT8_CHANNEL}


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


def packed_weight(quant, qtype: int, n: int, k: int) -> torch.Tensor:
    """A packed [n, k] weight of qtype from random values."""
    rng = np.random.default_rng(n * 31 + k)
    if qtype == QTYPE_INT8_CHANNEL:
        q = torch.from_numpy(rng.integers(-127, 128, size=(n, k), dtype=np.int8))
        return quant.pack_int8(q, torch.from_numpy(rng.random(n, dtype=np.float32) * 0.01))
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    t = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[t]
    if t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
        d = (rng.random((n, k // block)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
        raw[:, :, 0:2] = d
        raw[:, :, 2:4] = d
        if t == GGMLQuantizationType.Q6_K:
            raw[:, :, 208:210] = d
        raw = raw.reshape(n, -1)
    else:
        raw = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), t)
    return quant.pack(torch.from_numpy(raw), qtype, n, k)


def per_shape(quant, types: list[str], rows: list[int], shapes: list[tuple[int, int]], seconds: float) -> None:
    print("| N x K | M | format | us | GB/s of weights | GOPS | fp32 F.linear us | fp32 GOPS | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        w32 = torch.randn(n, k, generator=gen) * 0.05
        packs = {name: packed_weight(quant, TYPES[name], n, k) for name in types if k % BLOCK_VALUES[TYPES[name]] == 0}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x32 = x.float()
            ops = 2 * m * n * k
            tf = best_time(lambda: F.linear(x32, w32), seconds)  # noqa: B023 (called here)
            for name, p in packs.items():
                tq = best_time(lambda: quant.linear(x, p, TYPES[name], n, k, None), seconds)  # noqa: B023
                print(f"| {n} x {k} | {m} | {name} | {tq * 1e6:.1f} | {p.numel() / tq / 1e9:.1f} | {ops / tq / 1e9:.1f} "
                      f"| {tf * 1e6:.1f} | {ops / tf / 1e9:.1f} | {tf / tq:.2f} |", flush=True)


def sweep(quant, rows: list[int], repeats: int) -> None:
    """One pass over the model's weights at M rows (30 layers, each weight its own copy), then the
    lm_head for one row (a prefill needs only the last token's logits)."""
    ones = {}
    for shape, name in [*LAYER_WEIGHTS, LM_HEAD]:
        ones[(shape, name)] = packed_weight(quant, TYPES[name], *shape)
    calls = []
    for _ in range(LAYERS):
        for shape, name in LAYER_WEIGHTS:
            calls.append((ones[(shape, name)].clone(), TYPES[name], *shape))
    head = (ones[LM_HEAD], TYPES[LM_HEAD[1]], *LM_HEAD[0])
    total = sum(c[0].numel() for c in calls) + head[0].numel()
    print(f"\nsweep: {LAYERS} layers of {', '.join(f'{n}x{k} {t}' for (n, k), t in LAYER_WEIGHTS)} + lm_head "
          f"{LM_HEAD[0][0]}x{LM_HEAD[0][1]} {LM_HEAD[1]}: {total / 1e6:.1f} MB of packed weights")
    print("| M | ms per pass | GB/s of weights | GOPS | matmul-only tok/s (M = 1) or s per prefill |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        x1 = xs[576][:1]

        def one_pass(xs=xs, x1=x1) -> None:
            for p, qt, n, k in calls:
                quant.linear(xs[k], p, qt, n, k, None)
            quant.linear(x1, head[0], head[1], head[2], head[3], None)  # the last token's logits

        t = best_time(one_pass, 0.0, at_least=repeats)
        ops = 2 * m * sum(n * k for _, _, n, k in calls) + 2 * head[2] * head[3]
        rate = f"{1 / t:.0f} tok/s" if m == 1 else f"{t:.2f} s"
        print(f"| {m} | {t * 1e3:.2f} | {total / t / 1e9:.1f} | {ops / t / 1e9:.1f} | {rate} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    best = supported_tiers(cap=EngineArgs.from_env().max_cpu_tier)
    ap.add_argument("--tier", default=best[0].name if best else "auto", help="default: the best tier this CPU runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K,INT8")
    ap.add_argument("--rows", default="1,32,1000")
    ap.add_argument("--shapes", default="", help="N x K pairs, e.g. 1536x576,576x1536 (default: the model's)")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--prefetch", type=int, default=0, help="prefetch distance in bytes (0: the kernel's default)")
    ap.add_argument("--no-shapes", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="1,1000")
    ap.add_argument("--sweep-repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quant = load_quant_kernels(args.tier)
    if quant is None:
        print("no quantized kernels for this tier on this machine")
        return 1
    if args.prefetch and quant.prefetch_bytes is not None:
        quant.prefetch_bytes(args.prefetch)
    print(f"tier {quant.tier}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    if not args.no_shapes:
        per_shape(quant, args.types.split(","), [int(r) for r in args.rows.split(",")], shapes, args.seconds)
    if not args.no_sweep:
        sweep(quant, [int(r) for r in args.sweep_rows.split(",")], args.sweep_repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
