"""The CPU kernels of the tiers built from the tiered sources (csrc/tier_*.cpp over csrc/vec.h):
AVX512-VNNI without BF16, AVX2 + AVX-VNNI and AVX2 + FMA (kernels/tiers.py).

Each family is its own extension per tier (fused ops, the batch-invariant bf16 matmul, paged
attention; the quantized matmul is loaded by cpu_quant.py), so editing one kernel rebuilds only
its family. What comes back is the same `CpuKernels` the AVX512-BF16 tier gives, so the layers
cannot tell the tiers apart: only their speed and the bits of their (per tier fixed) rounding differ.
"""

from __future__ import annotations

from pathlib import Path

from chatserve.kernels.cpu import CpuKernels, PackedGemm, checked_gemm
from chatserve.kernels.tiers import KernelTier, build_tier_family


def build_tiered_cpu_kernels(tier: KernelTier, build_dir: Path | None = None) -> CpuKernels | None:
    """The tier's fused, matmul and attention extensions (built under `build_dir`; None: torch's
    default folder) as `CpuKernels` (the matmul checked here, the rest by kernels.cpu), or None where
    one of them could not be built."""
    fused, gemm, attention = (build_tier_family(f, tier, build_dir) for f in ("fused", "gemm", "attention"))
    if fused is None or gemm is None or attention is None:
        return None
    packed = checked_gemm(PackedGemm(pack=gemm.gemm_pack, linear=gemm.gemm, rows=gemm.gemm_rows,
                                     peak_gflops=gemm.fma_peak_gflops,
                                     packed_shape=lambda n, k: tuple(gemm.gemm_packed_shape(n, k))))
    return CpuKernels(tier=tier.name, rms_norm=fused.rms_norm_bf16, add_rms_norm=fused.add_rms_norm_bf16,
                      silu_mul=fused.silu_mul_bf16, rope_inplace=fused.rope_inplace_bf16,
                      huge_page_zeros=fused.huge_page_zeros, release_free_memory=fused.release_free_memory,
                      paged_attention=attention.paged_attention_bf16, store_kv_paged=attention.store_kv_paged_bf16,
                      store_kv=attention.store_kv_bf16, gemm=packed, gelu_tanh_mul=fused.gelu_tanh_mul_bf16,
                      rms_norm_f32w=fused.rms_norm_f32w_bf16, softcap_=fused.softcap_f32_)
