#!/usr/bin/env python3
"""The quantized matmul (csrc/tier_quant.cpp, issue #21) beside the bf16 one (csrc/tier_gemm.cpp) of the
best kernel tier on this CPU, per layer shape of SmolLM2-135M and per format, and the whole model's weight sweep.

    python benchmarks/kernels/bench_quant.py --threads 1                 # steadier on a shared machine
    python benchmarks/kernels/bench_quant.py --types Q4_1,Q8_0 --rows 1,8 --no-sweep

Method:
  * per shape the same x [M, K] and packed weight every call (hot in cache at small N, not for the
    lm_head); best of the calls made in --seconds; GFLOP/s = 2 M N K / time; GB/s = bytes of the
    packed weight / time (what decode streams per call).
  * sweep: the default model's weights (30 layers of qkv/o/gate_up/down, the tied lm_head), each in
    its own place of one huge-page arena (cold in cache, as in decode), one call per weight at M rows;
    best of --sweep-repeats; ms per pass, and GB/s of weights.
Raw blocks come from gguf's quantizer (Q4_0, Q4_1, Q8_0) or random valid blocks (Q4_K, Q6_K): the
kernels' speed does not depend on the values. The load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_matmul import LAYER_SHAPES, LAYERS, LM_HEAD, best_time, markdown  # noqa: E402

from chatserve.kernels.cpu import load_cpu_kernels  # noqa: E402
from chatserve.kernels.cpu_quant import BLOCK_VALUES, QTYPE_INT8_CHANNEL, load_quant_kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), LM_HEAD, (1536, 1536)]  # the last: K-quants' shape
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "INT8": QTYPE_INT8_CHANNEL}


def packed_weight(quant, qtype: int, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A packed [n, k] weight of qtype (into `out` when given)."""
    rng = np.random.default_rng(n * 31 + k)
    if qtype == QTYPE_INT8_CHANNEL:
        q = torch.from_numpy(rng.integers(-127, 128, size=(n, k), dtype=np.int8))
        return quant.pack_int8(q, torch.from_numpy(rng.random(n, dtype=np.float32) * 0.01), out=out)
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
    return quant.pack(torch.from_numpy(raw), qtype, n, k, out=out)


def per_shape(quant, gemm, types: list[str], rows: list[int], seconds: float) -> list[list[str]]:
    table = [["shape N x K", "M", "format", "GFLOP/s", "GB/s of weights", "bf16 GFLOP/s", "bf16 GB/s", "speedup vs bf16"]]
    for n, k in SHAPES:
        gen = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        bf16_packed = gemm.pack(w)
        bf16_bytes = bf16_packed.numel() * 2
        # K-quants need K to be a multiple of 256 (SmolLM2's 576 is not: llama.cpp's Q4_K_M files use
        # other types for those tensors); shapes they cannot take are left out
        packs = {name: packed_weight(quant, TYPES[name], n, k) for name in types if k % BLOCK_VALUES[TYPES[name]] == 0}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            flops = 2 * m * n * k
            tb = best_time(lambda: gemm.linear(x, bf16_packed, None, n), seconds)  # noqa: B023 (called here)
            for name, p in packs.items():
                tq = best_time(lambda: quant.linear(x, p, TYPES[name], n, k, None), seconds)  # noqa: B023
                table.append([f"{n} x {k}", str(m), name, f"{flops / tq / 1e9:.0f}", f"{p.numel() / tq / 1e9:.1f}",
                              f"{flops / tb / 1e9:.0f}", f"{bf16_bytes / tb / 1e9:.1f}", f"{tb / tq:.2f}"])
                print(" | ".join(table[-1]), flush=True)
    return table


def sweep(cpu, quant, types: list[str], rows: list[int], repeats: int) -> list[list[str]]:
    """One pass over the model's weights at M rows, each weight once, cold in cache (decode)."""
    gemm = cpu.gemm
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    gen = torch.Generator().manual_seed(0)
    passes: dict[str, tuple[int, list]] = {}
    # bf16: one random weight per shape, packed into its place for every layer
    sizes = [int(torch.tensor(gemm.packed_shape(n, k)).prod()) for n, k in shapes]
    arena = cpu.huge_page_zeros(sum(sizes))
    plain = {s: (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16) for s in set(shapes)}
    packed, o = [], 0
    for (n, k), size in zip(shapes, sizes):
        packed.append(gemm.pack(plain[(n, k)], out=arena[o : o + size].view(gemm.packed_shape(n, k))))
        o += size
    passes["bf16"] = (2 * sum(sizes), [(lambda x, p=p, n=n: gemm.linear(x, p, None, n), k) for p, (n, k) in zip(packed, shapes)])
    for name in types:
        qtype = TYPES[name]
        if any(k % BLOCK_VALUES[qtype] for _, k in shapes):
            print(f"sweep: {name} left out (K = 576 is not a multiple of its {BLOCK_VALUES[qtype]}-value block)")
            continue
        qsizes = [quant.packed_nbytes(qtype, n, k) for n, k in shapes]
        qarena = cpu.huge_page_zeros((sum(qsizes) + 1) // 2).view(torch.uint8)
        ones = {s: packed_weight(quant, qtype, *s) for s in set(shapes)}
        calls, o = [], 0
        for (n, k), size in zip(shapes, qsizes):
            p = qarena[o : o + size]
            p.copy_(ones[(n, k)])
            calls.append((lambda x, p=p, n=n, k=k, qtype=qtype: quant.linear(x, p, qtype, n, k, None), k))
            o += size
        passes[name] = (sum(qsizes), calls)
    table = [["M", *(f"{name} ms" for name in passes), *(f"{name} GB/s" for name in passes)]]
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}
        times = {}
        for name, (_, calls) in passes.items():
            def one_pass(calls=calls, xs=xs) -> None:
                for fn, k in calls:
                    fn(xs[k])
            times[name] = best_time(one_pass, 0.0, at_least=repeats)
        table.append([str(m), *(f"{times[name] * 1e3:.2f}" for name in passes),
                      *(f"{passes[name][0] / times[name] / 1e9:.1f}" for name in passes)])
        print(" | ".join(table[-1]), flush=True)
    print("weights per pass: " + ", ".join(f"{name} {b / 1e6:.0f} MB" for name, (b, _) in passes.items()))
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K,INT8")
    ap.add_argument("--rows", default="1,2,4,8,32,256,1000")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--no-shapes", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--sweep-repeats", type=int, default=5)
    ap.add_argument("--prefetch", default="", help="decode prefetch distances in bytes to sweep, comma separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu, quant = load_cpu_kernels(amx=False), load_quant_kernels()
    if cpu is None or cpu.gemm is None or quant is None:
        print("no AVX512-BF16 kernels on this machine")
        return 1
    types = [t for t in args.types.split(",") if t]
    print(f"threads {args.threads}, load average at start {os.getloadavg()}")
    if not args.no_shapes:
        print(markdown(per_shape(quant, cpu.gemm, types, [int(v) for v in args.rows.split(",")], args.seconds)))
    if not args.no_sweep:
        for pf in [int(v) for v in args.prefetch.split(",")] if args.prefetch else [0]:
            if pf:
                quant.prefetch_bytes(pf)
            print(f"decode prefetch distance {quant.prefetch_bytes(0)} bytes")
            print(markdown(sweep(cpu, quant, types, [int(v) for v in args.sweep_rows.split(",")], args.sweep_repeats)))
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
