"""Quantized matmul for AVX512-VNNI + AVX512-BF16 CPUs over weights kept in GGUF block formats
(csrc/quant_gemm.cpp, issue #21): Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and our weight-only int8 per output channel.

How it computes: each row of x is quantised to int8 in blocks of 32 (one fp32 scale each, as
llama.cpp's Q8 activations) and multiplied with the weights' integer quants by vpdpbusd; the
weights' scales and offsets are applied per sub-block in fp32 (the header of quant_gemm.cpp has the
arithmetic). Why not de-quantise to bf16 in registers: that costs ~9 instructions per 32 weights and
ran compute-bound below the memory's rate; this one streams the weights (BENCHMARKS.md, issue 21).

What can be trusted: every output's arithmetic is the same whatever the row count, the row's place
in the batch or the thread split (batch-invariant, so prefill and decode agree bit for bit); the
weights it multiplies are exactly gguf's de-quantised values (`rows` / `dequantize` return them,
rounded to bf16, bit for bit); the only error against the fp32 product is the activations' int8
rounding (tests/test_quant_gemm.py states the tolerance).

A separate extension from cpu_gemv's (its own name and source hash, the same build folder, lock and
compiler flags), so editing this kernel does not rebuild the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from chatserve.kernels.cpu_gemv import _build_root, _exclusive_build, cpu_has_flags

logger = logging.getLogger(__name__)

QTYPE_Q4_0, QTYPE_Q4_1, QTYPE_Q8_0, QTYPE_Q4_K, QTYPE_Q6_K = 2, 3, 8, 12, 14  # GGML type ids
QTYPE_INT8_CHANNEL = 1000  # not a GGUF type: w[n, k] = scale[n] * q[n, k] (fp32 product, then bf16 RNE)
SUPPORTED_QTYPES: frozenset[int] = frozenset({QTYPE_Q4_0, QTYPE_Q4_1, QTYPE_Q8_0, QTYPE_Q4_K, QTYPE_Q6_K, QTYPE_INT8_CHANNEL})
# values per block along K: K must be a multiple of it
BLOCK_VALUES: dict[int, int] = {QTYPE_Q4_0: 32, QTYPE_Q4_1: 32, QTYPE_Q8_0: 32, QTYPE_Q4_K: 256, QTYPE_Q6_K: 256,
                                QTYPE_INT8_CHANNEL: 32}

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "quant_gemm.cpp"]


@dataclass(frozen=True)
class QuantKernels:
    """The compiled quantized matmul, proven on this machine by load_quant_kernels."""

    pack: Callable[..., torch.Tensor]  # (raw uint8 [N, row_bytes] GGUF blocks, qtype, N, K, out=None) -> packed uint8 1-D
    pack_int8: Callable[..., torch.Tensor]  # (q int8 [N, K], scale float32 [N], out=None) -> packed (QTYPE_INT8_CHANNEL)
    linear: Callable[..., torch.Tensor]  # (x bf16 [M, K], packed, qtype, N, K, bias bf16 [N] | None) -> bf16 [M, N]
    rows: Callable[..., torch.Tensor]  # (packed, qtype, ids int64 [T], N, K) -> bf16 [T, K]
    dequantize: Callable[..., torch.Tensor]  # (packed, qtype, N, K) -> bf16 [N, K]
    packed_nbytes: Callable[[int, int, int], int]  # (qtype, N, K) -> bytes of the packed weight
    # (bytes > 0: set; 0: keep) -> the decode path's prefetch distance before; for scripts/bench_quant.py
    prefetch_bytes: Callable[[int], int] | None = None


def load_quant_kernels() -> QuantKernels | None:
    """The compiled kernels, verified on this machine, or None (no AVX512-BF16 or AVX512-VNNI, no
    compiler, or a failed self-check: callers then de-quantise at load)."""
    if not cpu_has_flags("avx512_bf16", "avx512_vnni"):
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"chatserve_quant_kernels_{_sources_hash()}"
        build_dir = _build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive_build(build_dir):
            ext = load(
                name=name,
                build_directory=str(build_dir),
                sources=[str(p) for p in _SOURCES],
                # the flags of cpu_gemv's extension (less the AMX ones, plus VNNI): -ffp-contract=off keeps
                # every multiply and add as written, which the exact de-quantisation relies on
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-fopenmp",
                              "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        kernels = QuantKernels(pack=ext.quant_pack, pack_int8=ext.quant_pack_int8, linear=ext.quant_linear,
                               rows=ext.quant_rows, dequantize=ext.quant_dequantize,
                               packed_nbytes=ext.quant_packed_nbytes, prefetch_bytes=ext.quant_prefetch_bytes)
        _self_check(kernels)
        return kernels
    except Exception as exc:  # no compiler, no ninja, unusual platform, wrong results: de-quantise at load
        logger.warning("quantized matmul kernels unavailable (%s); quantized weights are de-quantised at load", exc)
        return None


def _self_check(k: QuantKernels) -> None:
    """int8 per channel (needs no gguf): the matmul is close to the fp32 reference (int8 activations),
    rows alone equal rows in a batch, and the rows read back as scale * q rounded to bf16. The GGUF
    formats share every instruction of the matmul with it except the per-format scale arithmetic,
    which tests/test_quant_gemm.py checks bit for bit against gguf's numpy de-quantisation."""
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


def _sources_hash() -> str:
    import hashlib

    digest = hashlib.sha1(str(_CSRC.resolve()).encode())
    for path in _SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]
