"""The CPU kernels of every tier, built from one set of sources (csrc/tier_*.cpp over csrc/vec.h).

Each tier (kernels/tiers.py) compiles the same sources with its own flags into one extension
(csrc/tier_kernels.cpp): fused ops, the batch-invariant bf16 matmul, paged attention, the quantized
matmul (loaded by cpu_quant.py) and the decoder-layer runner; the AVX512-BF16 tier adds the AMX tile
matmul (csrc/amx_gemm.cpp), used where the CPU has AMX. What comes back is the same `CpuKernels` on
every tier, so the layers cannot tell the tiers apart: only their speed and the bits of their (per
tier fixed) rounding differ. Callers go through `kernels.cpu.load_cpu_kernels`, which checks the
rest against torch before anything uses them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from chatserve.kernels.cpu import AmxMatmul, CpuKernels, PackedGemm, checked_gemm
from chatserve.kernels.tiers import KernelTier, build_tier_module

logger = logging.getLogger(__name__)


def build_cpu_kernels(tier: KernelTier, amx: bool = True, build_dir: Path | None = None) -> CpuKernels | None:
    """The tier's extension (built under `build_dir`; None: torch's default folder) as `CpuKernels`
    (the matmuls checked here, the rest by kernels.cpu), or None where it could not be built.
    amx=False leaves the AMX matmul out even where the CPU has tiles."""
    ext = build_tier_module(tier, build_dir)
    if ext is None:
        return None
    packed = checked_gemm(PackedGemm(pack=ext.gemm_pack, linear=ext.gemm, rows=ext.gemm_rows,
                                     peak_gflops=ext.dot_peak_gflops,
                                     packed_shape=lambda n, k: tuple(ext.gemm_packed_shape(n, k))))
    return CpuKernels(tier=tier.name, rms_norm=ext.rms_norm_bf16, add_rms_norm=ext.add_rms_norm_bf16,
                      silu_mul=ext.silu_mul_bf16, rope_inplace=ext.rope_inplace_bf16,
                      huge_page_zeros=ext.huge_page_zeros, release_free_memory=ext.release_free_memory,
                      paged_attention=ext.paged_attention_bf16, store_kv_paged=ext.store_kv_paged_bf16,
                      store_kv=ext.store_kv_bf16, gemm=packed, gelu_tanh_mul=ext.gelu_tanh_mul_bf16,
                      rms_norm_f32w=ext.rms_norm_f32w_bf16, softcap_=ext.softcap_f32_,
                      amx=load_amx(ext) if amx else None)


def load_amx(ext: Any) -> AmxMatmul | None:
    """The AMX matmul of `ext`, proven on this machine, or None (a tier without it, no AMX, the OS
    refuses tiles, or wrong results)."""
    if not hasattr(ext, "amx_available") or not ext.amx_available():
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
