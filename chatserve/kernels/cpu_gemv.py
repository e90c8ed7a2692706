"""The AVX512-BF16 tier's kernels, compiled on first use: the batch-invariant bf16 matmul over
packed weights, one kernel for every row count (csrc/bf16_gemm.cpp), the older dot-product matmul
(csrc/bf16_gemv.cpp, kept for CHATSERVE_LINEAR=legacy), the AMX tile matmul over pre-packed
weights for CPUs that have AMX (csrc/amx_gemm.cpp), paged attention for prefill, extend and decode
(csrc/cpu_attention.cpp), and fused rotary, silu*up and RMSNorm (csrc/cpu_fused.cpp).
Why and how fast: BENCHMARKS.md ("Offline runtime").

These are hand-written for vdpbf16ps and AMX; the other tiers (AVX512-VNNI, AVX2) are built from
the tiered sources over csrc/vec.h (kernels/tiered.py). Callers go through `kernels.cpu.load_cpu_kernels`,
which checks what this module builds against torch before anything uses it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from chatserve.kernels.build import CSRC, build_extension
from chatserve.kernels.cpu import (  # noqa: F401 - re-exported: the names scripts and tests know
    MAX_GEMV_ROWS,
    AmxMatmul,
    CpuKernels,
    PackedGemm,
    checked_gemm,
    cpu_has_avx512_bf16,
    cpu_has_flags,
    load_cpu_kernels,
)

logger = logging.getLogger(__name__)

_SOURCES = [CSRC / name for name in ("bf16_gemv.cpp", "bf16_gemm.cpp", "amx_gemm.cpp", "cpu_attention.cpp", "cpu_fused.cpp")]
_HEADERS = [CSRC / "simd.h"]
# -mamx-*: only the AMX functions use tile instructions; they run only where amx_available()
_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]


def _bf16_packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    return ((n + 63) // 64, (k + 1) // 2, 64, 2)


def build_avx512_bf16_kernels(amx: bool = True, build_dir: Path | None = None) -> CpuKernels | None:
    """The AVX512-BF16 extension (built under `build_dir`; None: torch's default folder) as
    `CpuKernels` (unchecked: kernels.cpu checks it), or None where the CPU lacks AVX512-BF16 or the
    build failed. amx=False leaves the AMX matmul out."""
    if not cpu_has_avx512_bf16():
        return None
    ext = build_extension("chatserve_cpu_kernels", _SOURCES, cflags=_CFLAGS, headers=_HEADERS, build_dir=build_dir)
    if ext is None:
        return None
    _check_gemv(ext.bf16_gemv)
    gemm = checked_gemm(PackedGemm(pack=ext.bf16_gemm_pack, linear=ext.bf16_gemm, rows=ext.bf16_gemm_rows,
                                   peak_gflops=ext.bf16_dot_peak_gflops, packed_shape=_bf16_packed_shape))
    return CpuKernels(tier="avx512_bf16", gemv=ext.bf16_gemv, rms_norm=ext.rms_norm_bf16,
                      paged_attention=ext.paged_attention_bf16, store_kv_paged=ext.store_kv_paged_bf16,
                      store_kv=ext.store_kv_bf16, silu_mul=ext.silu_mul_bf16, rope_inplace=ext.rope_inplace_bf16,
                      add_rms_norm=ext.add_rms_norm_bf16, huge_page_zeros=ext.huge_page_zeros,
                      release_free_memory=ext.release_free_memory, gemm=gemm, gelu_tanh_mul=ext.gelu_tanh_mul_bf16,
                      rms_norm_f32w=ext.rms_norm_f32w_bf16, softcap_=ext.softcap_f32_,
                      amx=_load_amx(ext) if amx else None)


def _check_gemv(fn) -> None:
    w = torch.randn(96, 80).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    for m in (1, 3, 8, 13, 32):
        x = torch.randn(m, 80).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        if not torch.allclose(fn(x, w, b).float(), ref, atol=0.05 * float(ref.abs().max()) + 0.05):
            raise RuntimeError("bf16 gemv kernel gave wrong results")


def _load_amx(ext) -> AmxMatmul | None:
    """The AMX matmul, proven on this machine, or None (no AMX, the OS refuses tiles, or wrong results)."""
    if not ext.amx_available():
        return None
    amx = AmxMatmul(pack=ext.amx_pack_weight, linear=ext.amx_linear, rows=ext.amx_packed_rows)
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 64), (17, 40, 80), (35, 96, 64)):  # every chunk and column-block tail
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        packed = amx.pack(w)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        out = amx.linear(x, packed, b, n).float()
        ids = torch.tensor([n - 1, 0, 17])
        if not torch.allclose(out, ref, atol=0.02 * float(ref.abs().max()) + 0.02) or not torch.equal(amx.rows(packed, ids, n, k), w[ids]):
            logger.warning("AMX matmul gave wrong results; using the AVX512-BF16 kernel")
            return None
    return amx
