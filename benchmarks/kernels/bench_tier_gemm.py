"""Speed of the tiered batch-invariant bf16 matmul (csrc/tier_gemm.cpp, issue #30) against torch.

For each tier this CPU runs (or --tier), over SmolLM2-135M's projection shapes: milliseconds,
GFLOP/s, the share of the register-only peak of the tier's step (`dot_peak_gflops`: fma, vdpbf16ps
on AVX512-BF16; all threads), and for decode the weights' bytes streamed per second; next to torch's
F.linear in fp32 (weights kept fp32: twice the bytes) and in bf16. "decode step" runs M rows through
all 30 layers' weights (212 MB, past the L3 cache) in the huge-page arena the engine uses, so M = 1
measures streaming from memory.

    python benchmarks/kernels/bench_tier_gemm.py [--threads 2] [--tier avx2] [--define GEMM_PF_STEPS=16 ...]

--define rebuilds the kernel with its tuning macros changed (GEMM_ROW_BLOCK_BYTES, GEMM_COL_BLOCK_BYTES,
GEMM_SPLIT_ROWS_MIN, GEMM_SPLIT_COLS_MIN, GEMM_PF_STEPS), to compare settings.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from chatserve.config import EngineArgs
from chatserve.kernels.build import CSRC, build_extension
from chatserve.kernels.tiers import TIERS, build_tier_family, supported_tiers, tier_source

HIDDEN, INTER, LAYERS = 576, 1536, 30
# (name, N, K): fused qkv (9 + 2 x 3 heads of 64), o_proj, fused gate|up, down, the tied lm_head
SHAPES = [("qkv", 960, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER),
          ("mlp_half", INTER, HIDDEN), ("lm_head", 49152, HIDDEN)]
ROWS = [1, 4, 32, 1000]


def timed(fn, min_seconds: float = 0.3, repeats: int = 3) -> float:
    """The best of `repeats` mean times of fn() (seconds), each over >= min_seconds."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    iters = max(1, int(min_seconds / once))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def load(tier_name: str, defines: list[str]):
    tier = TIERS[tier_name]
    if not defines:
        return build_tier_family("gemm", tier), build_tier_family("fused", tier)
    flags = tuple(f"-D{d}" for d in defines)
    gemm = build_extension(f"bench_gemm_{tier.name}", [tier_source("gemm")], cflags=tier.cflags + flags,
                           headers=[CSRC / "vec.h"])
    return gemm, build_tier_family("fused", tier)


def bench_tier(tier_name: str, defines: list[str], rows: list[int]) -> None:
    gemm, fused = load(tier_name, defines)
    if gemm is None:
        print(f"{tier_name}: tier_gemm.cpp did not build")
        return
    peak = max(gemm.dot_peak_gflops(20_000_000) for _ in range(3))
    print(f"\n## {tier_name} ({torch.get_num_threads()} threads){' ' + ' '.join(defines) if defines else ''}: "
          f"dot-product peak {peak:.1f} GFLOP/s")
    print(f"{'shape':>9} {'M':>5} | {'tier ms':>8} {'GFLOP/s':>8} {'% peak':>6} {'GB/s W':>7} | "
          f"{'fp32 ms':>8} {'bf16 ms':>8} | {'vs fp32':>7}")
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        packed = gemm.gemm_pack(w)
        w32 = w.float()
        for m in rows:
            if name == "lm_head" and m > 32:
                continue
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x32 = x.float()
            t = timed(lambda: gemm.gemm(x, packed, None, n))  # noqa: B023 - called at once
            t32 = timed(lambda: F.linear(x32, w32))  # noqa: B023
            t16 = timed(lambda: F.linear(x, w), repeats=1) if m * n * k < 2e9 else float("nan")  # noqa: B023
            flops = 2 * m * n * k
            print(f"{name:>9} {m:>5} | {t * 1e3:8.3f} {flops / t / 1e9:8.1f} {100 * flops / t / 1e9 / peak:5.0f}% "
                  f"{2 * n * k / t / 1e9:7.1f} | {t32 * 1e3:8.3f} {t16 * 1e3:8.3f} | {t32 / t:6.2f}x")
    decode_step(gemm, fused, rows)


def decode_step(gemm, fused, rows: list[int]) -> None:
    """M rows through every layer's four projections, weights packed into one huge-page arena."""
    gen = torch.Generator().manual_seed(1)
    layer = [(n, k) for name, n, k in SHAPES if name in ("qkv", "o_proj", "gate_up", "down")]
    shapes = [tuple(gemm.gemm_packed_shape(n, k)) for n, k in layer]
    sizes = [torch.Size(s).numel() for s in shapes]
    total = sum(sizes) * LAYERS
    arena = fused.huge_page_zeros(total) if fused is not None else torch.zeros(total, dtype=torch.bfloat16)
    weights, offset = [], 0
    for _ in range(LAYERS):
        for (n, k), shape, size in zip(layer, shapes, sizes):
            w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
            weights.append((gemm.gemm_pack(w, out=arena[offset : offset + size].view(shape)), n, k))
            offset += size
    print(f"decode step: {LAYERS} layers x 4 projections, {2 * total / 1e6:.0f} MB of packed weights")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (HIDDEN, INTER)}

        def step() -> None:
            for packed, n, k in weights:
                gemm.gemm(xs[k], packed, None, n)  # noqa: B023 - called at once

        t = timed(step, repeats=3)
        flops = 2 * m * sum(n * k for _, n, k in weights)
        print(f"  M = {m:>4}: {t * 1e3:8.2f} ms  {flops / t / 1e9:6.1f} GFLOP/s  {2 * total / t / 1e9:5.1f} GB/s of weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tier", choices=list(TIERS), action="append")
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE tuning macro (rebuilds)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.tier or [t.name for t in supported_tiers(cap=EngineArgs.from_env().max_cpu_tier)]
    for name in names:
        bench_tier(name, args.define, args.rows)


if __name__ == "__main__":
    main()
