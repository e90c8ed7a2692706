"""Quantized matmul over weights kept in GGUF block formats (issue #21): Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
and our weight-only int8 per output channel, per kernel tier (issue #30): csrc/tier_quant.cpp, one
source over csrc/vec.h compiled per tier (AVX2 with vpmaddubsw, AVX2 + AVX-VNNI, AVX512 + VNNI, the
last also serving the AVX512-BF16 tier).

How it computes: each row of x is quantised to int8 in blocks of 32 (one fp32 scale each, as
llama.cpp's Q8 activations) and multiplied with the weights' integer quants in exact integers; the
weights' scales and offsets are applied per sub-block in fp32 (tier_quant.cpp's header has the
arithmetic). Why not de-quantise to bf16 in registers: that
costs ~9 instructions per 32 weights and ran compute-bound below the memory's rate; this one streams
the weights (BENCHMARKS.md, issue 21).

What can be trusted, on every tier: every output's arithmetic is the same whatever the row count, the
row's place in the batch or the thread split (batch-invariant, so prefill and decode agree bit for
bit); the weights it multiplies are exactly gguf's de-quantised values (`rows` / `dequantize` return
them, rounded to bf16, bit for bit); the only error against the fp32 product is the activations' int8
rounding (tests/kernels/test_quant_gemm.py states the tolerance and runs every tier this CPU supports).

Each tier is its own extension (kernels/tiers.py build_tier_module: its own name and source/flag
hash, the shared build folder and lock).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from chatserve.kernels.tiers import TIERS, build_tier_family, select_tier

logger = logging.getLogger(__name__)

QTYPE_Q4_0, QTYPE_Q4_1, QTYPE_Q8_0, QTYPE_Q4_K, QTYPE_Q6_K = 2, 3, 8, 12, 14  # GGML type ids
QTYPE_INT8_CHANNEL = 1000  # not a GGUF type: w[n, k] = scale[n] * q[n, k] (fp32 product, then bf16 RNE)
SUPPORTED_QTYPES: frozenset[int] = frozenset({QTYPE_Q4_0, QTYPE_Q4_1, QTYPE_Q8_0, QTYPE_Q4_K, QTYPE_Q6_K, QTYPE_INT8_CHANNEL})
# values per block along K: K must be a multiple of it
BLOCK_VALUES: dict[int, int] = {QTYPE_Q4_0: 32, QTYPE_Q4_1: 32, QTYPE_Q8_0: 32, QTYPE_Q4_K: 256, QTYPE_Q6_K: 256,
                                QTYPE_INT8_CHANNEL: 32}


@dataclass(frozen=True)
class QuantKernels:
    """The compiled quantized matmul of one tier, proven on this machine by load_quant_kernels."""

    pack: Callable[..., torch.Tensor]  # (raw uint8 [N, row_bytes] GGUF blocks, qtype, N, K, out=None) -> packed uint8 1-D
    pack_int8: Callable[..., torch.Tensor]  # (q int8 [N, K], scale float32 [N], out=None) -> packed (QTYPE_INT8_CHANNEL)
    linear: Callable[..., torch.Tensor]  # (x bf16 [M, K], packed, qtype, N, K, bias bf16 [N] | None) -> bf16 [M, N]
    rows: Callable[..., torch.Tensor]  # (packed, qtype, ids int64 [T], N, K) -> bf16 [T, K]
    dequantize: Callable[..., torch.Tensor]  # (packed, qtype, N, K) -> bf16 [N, K]
    packed_nbytes: Callable[[int, int, int], int]  # (qtype, N, K) -> bytes of the packed weight
    # (bytes > 0: set; 0: keep) -> the decode path's prefetch distance before; for benchmarks/kernels/bench_quant.py
    prefetch_bytes: Callable[[int], int] | None = None
    # the kernel tier (kernels/tiers.py) these were built for; a packed weight is only valid for its tier
    tier: str = "avx512_bf16"

    @property
    def description(self) -> str:
        return f"{self.tier} kernels, int8 activations"


def load_quant_kernels(tier: str = "auto", build_dir: str | Path | None = None) -> QuantKernels | None:
    """The compiled kernels of `tier` ("auto": the best this CPU runs), built under `build_dir` (the
    bf16 kernels' folder, `CpuKernels.build_dir`; None: torch's default), verified on this machine, or
    None (no kernel tier on this CPU, no compiler, or a failed self-check: callers then de-quantise at
    load). Built and checked once per tier and folder per process. A tier the CPU lacks is a ValueError naming it."""
    chosen = select_tier(tier)
    return None if chosen is None else _load_tier(chosen.name, None if build_dir is None else Path(build_dir))


@functools.cache
def _load_tier(name: str, build_dir: Path | None) -> QuantKernels | None:
    ext = build_tier_family("quant", TIERS[name], build_dir)
    if ext is None:  # build.py logged why
        return None
    kernels = QuantKernels(pack=ext.quant_pack, pack_int8=ext.quant_pack_int8, linear=ext.quant_linear,
                           rows=ext.quant_rows, dequantize=ext.quant_dequantize,
                           packed_nbytes=ext.quant_packed_nbytes, prefetch_bytes=ext.quant_prefetch_bytes, tier=name)
    try:
        _self_check(kernels)
    except Exception as exc:  # wrong results (or an unusual platform): de-quantise at load
        logger.warning("quantized matmul kernels (%s) unavailable (%s); quantized weights are de-quantised at load", name, exc)
        return None
    return kernels


def _self_check(k: QuantKernels) -> None:
    """int8 per channel (needs no gguf): the matmul is close to the fp32 reference (int8 activations),
    rows alone equal rows in a batch, and the rows read back as scale * q rounded to bf16. The GGUF
    formats share every instruction of the matmul with it except the per-format scale arithmetic,
    which tests/kernels/test_quant_gemm.py checks bit for bit against gguf's numpy de-quantisation."""
    gen = torch.Generator().manual_seed(0)
    n, kdim = 40, 64
    q = torch.randint(-127, 128, (n, kdim), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 0.001
    packed = k.pack_int8(q, scale)
    w = (scale[:, None] * q.float()).to(torch.bfloat16)
    if not torch.equal(k.dequantize(packed, QTYPE_INT8_CHANNEL, n, kdim), w):
        raise RuntimeError("int8 de-quantisation differs from scale * q")
    x = torch.randn(9, kdim, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = k.linear(x, packed, QTYPE_INT8_CHANNEL, n, kdim, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    alone = torch.cat([k.linear(x[i : i + 1], packed, QTYPE_INT8_CHANNEL, n, kdim, b) for i in (0, 8)])
    if not (torch.allclose(out.float(), ref, atol=0.02 * float(ref.abs().max()) + 0.02) and torch.equal(alone, out[[0, 8]])):
        raise RuntimeError("quantized matmul gave wrong results")
