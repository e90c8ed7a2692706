"""The CPU kernels as the layers see them: one `CpuKernels` per tier, loaded and proven once.

`load_cpu_kernels(tier=...)` builds the kernels of a tier (kernels/tiers.py) from the one set of
sources over csrc/vec.h (tiered.py), checks each against torch on this machine (the `verify_*`
functions below, shared by every tier), and returns them, or None (no AVX2, no compiler, a failed
check: callers then use torch ops). The result is cached per (tier, amx, build folder): a second
engine in the process neither rebuilds nor re-checks. The tier cap and the build folder are
arguments (`EngineArgs.max_cpu_tier`, `kernel_build_dir`), never read from the environment here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from chatserve.kernels.build import build_root
from chatserve.kernels.tiers import cpu_flags, select_tier

logger = logging.getLogger(__name__)


def cpu_has_flags(*flags: str) -> bool:
    """Every one of `flags` in /proc/cpuinfo's first flags line (False where it cannot be read)."""
    return set(flags) <= cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    return cpu_has_flags("avx512_bf16")


@dataclass(frozen=True)
class AmxMatmul:
    """Intel AMX tile matmul over weights packed once into the tile layout (csrc/amx_gemm.cpp)."""

    pack: Callable[..., torch.Tensor]  # bf16 [N, K] (, out=) -> packed [ceil(N/16), ceil(K/32), 16, 32]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]  # x [M, K], packed, bias, N
    rows: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]  # packed, int64 ids [T], N, K -> rows [T, K]

    @staticmethod
    def packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
        return ((n + 15) // 16, (k + 31) // 32, 16, 32)


@dataclass(frozen=True)
class PackedGemm:
    """The batch-invariant bf16 matmul over weights packed once (csrc/tier_gemm.cpp): every output element is one fixed accumulation chain
    over K, so a row's result has the same bits whatever the row count of the call and the row's
    position in it. The packed layout is the tier's own: `packed_shape` says its bf16 shape."""

    pack: Callable[..., torch.Tensor]  # bf16 [N, K] (, out=) -> packed bf16 of packed_shape(N, K)
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]  # x [M, K], packed, bias, N
    rows: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]  # packed, int64 ids [T], N, K -> rows [T, K]
    peak_gflops: Callable[[int], float]  # iterations -> register-only GFLOP/s of the tier's dot-product step, all threads
    packed_shape: Callable[[int, int], tuple[int, ...]]  # (N, K) -> the packed weight's shape in bf16 elements


@dataclass(frozen=True)
class CpuKernels:
    tier: str  # kernels/tiers.py name: which instruction set these were built for
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # bf16 rows [M, D], weight [D], eps
    # prefill, extend and decode in one kernel: q [T, H, D], k/v cache (as store_kv_paged writes them),
    # block tables [S, nb], query_start [S + 1], start_pos [S], seq_order [S], group_start [G + 1] (all int64),
    # scale -> [T, H, D]
    paged_attention: Callable[..., torch.Tensor]
    # the same as store_kv, into paged_attention's layout within each block (the tier's own)
    store_kv_paged: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    # k, v [T, KVH, D], k/v cache [blocks, block_size, KVH, D], slot mapping [T] int64 (-1: skip)
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]  # bf16 [M, 2I] gate|up -> silu(gate) * up
    rope_inplace: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], None]  # x [T, W], cos, sin, heads, head_dim
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]  # x, residual (+= x), w, eps
    huge_page_zeros: Callable[[int], torch.Tensor]  # numel -> zeroed bf16 [numel] advised for transparent huge pages
    release_free_memory: Callable[[], None]  # glibc malloc_trim: freed heap pages back to the OS
    gemm: PackedGemm | None = None  # the batch-invariant matmul (None only where it failed its check)
    amx: AmxMatmul | None = None  # where the CPU has AMX tiles (and the OS lets us use them)
    # Gemma's ops (every tier builds them; None only for a hand-made CpuKernels): bf16 [M, 2I] gate|up ->
    # gelu_tanh(gate) * up; RMSNorm of bf16 rows with an fp32 weight (1 + w); fp32 x = tanh(x / cap) * cap in place
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    rms_norm_f32w: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    softcap_: Callable[[torch.Tensor, float], None] | None = None
    # the folder these were built in (kernels/build.py build_root), where the same tier's other
    # extensions (the quantized matmul, the decoder-layer runner) are built and found too
    build_dir: Path | None = None


def load_cpu_kernels(amx: bool = True, tier: str = "auto", *, cap: str | None = None,
                     build_dir: str | Path | None = None) -> CpuKernels | None:
    """The compiled kernels of `tier` ("auto": the best this CPU runs up to `cap`, a tier name),
    verified on this machine, or None where the CPU runs no tier (callers then use torch ops) or the
    build or a check failed. `build_dir`: where the extensions are built (None: torch's default folder).

    amx=False leaves the AMX matmul out even where the CPU has tiles (the AVX512-BF16 matmul then runs).
    Forcing a tier the CPU lacks, or one above `cap`, raises ValueError naming the field.
    """
    chosen = select_tier(tier, cap=cap)
    if chosen is None:
        return None
    return _load(chosen.name, amx, build_root(build_dir))


# (tier name, build folder) -> why its kernels are unusable there (a failed build or self-check), for kernel_problem()
_PROBLEMS: dict[tuple[str, Path], str] = {}


def kernel_problem(tier: str = "auto", *, cap: str | None = None, build_dir: str | Path | None = None) -> str | None:
    """Why the kernels of `tier` (a tier this CPU runs) do not give the whole batch-invariant set,
    or None where they do: they failed to build or a self-check (load_cpu_kernels gave None), or the
    batch-invariant matmul failed its own check (the engine would then use oneDNN). For the test
    suite, where such a tier must fail, not skip, and for the engine's start-up log."""
    kernels = load_cpu_kernels(tier=tier, cap=cap, build_dir=build_dir)
    chosen = select_tier(tier, cap=cap)
    if chosen is None:
        return "this CPU runs no kernel tier (needs AVX2 + FMA + F16C)"
    if kernels is None:
        return _PROBLEMS.get((chosen.name, build_root(build_dir)),
                             f"the {chosen.name} kernels could not be built (see the log)")
    if kernels.gemm is None:
        return f"the {chosen.name} batch-invariant matmul failed its self-check (oneDNN would run instead)"
    return None


@functools.cache
def _load(tier: str, amx: bool, root: Path) -> CpuKernels | None:
    from chatserve.kernels.tiers import TIERS

    try:
        from chatserve.kernels.tiered import build_cpu_kernels

        kernels = build_cpu_kernels(TIERS[tier], amx, root)
        if kernels is None:
            _PROBLEMS[tier, root] = f"the {tier} kernels could not be built (no compiler? see the log)"
            return None
        verify_rms_norm(kernels.rms_norm)
        verify_paged_attention(kernels.paged_attention, kernels.store_kv_paged, kernels.store_kv)
        verify_paged_attention_int8(kernels.paged_attention, kernels.store_kv_paged, kernels.store_kv)
        verify_fused(kernels.silu_mul, kernels.rope_inplace, kernels.add_rms_norm)
        verify_gemma_ops(kernels)
        return replace(kernels, build_dir=root)
    except Exception as exc:  # wrong results or an unusual platform: the slower path still works
        logger.warning("%s CPU kernels unusable here (%s); using torch ops", tier, exc)
        _PROBLEMS[tier, root] = f"the {tier} kernels failed their self-check: {exc}"
        return None


def checked_gemm(gemm: PackedGemm) -> PackedGemm | None:
    """`gemm` if it proves itself on this machine (close to the fp32 matmul, each row the same bits
    alone as in a batch, the packed rows read back exactly), else None with a warning."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((80, 64), (150, 71)):  # a ragged column group; an odd K
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        x = torch.randn(70, k, generator=gen).to(torch.bfloat16)  # > one register tile, both thread splits
        packed = gemm.pack(w)
        if tuple(packed.shape) != tuple(gemm.packed_shape(n, k)):
            logger.warning("batch-invariant bf16 matmul packs to %s, not the %s it announces", tuple(packed.shape),
                           tuple(gemm.packed_shape(n, k)))
            return None
        out = gemm.linear(x, packed, b, n)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        alone = torch.cat([gemm.linear(x[i : i + 1], packed, b, n) for i in (0, 37, 69)])
        ids = torch.tensor([n - 1, 0, 17])
        if not (torch.allclose(out.float(), ref, atol=0.02 * float(ref.abs().max()) + 0.02)
                and torch.equal(alone, out[[0, 37, 69]]) and torch.equal(gemm.rows(packed, ids, n, k), w[ids])):
            logger.warning("batch-invariant bf16 matmul gave wrong results; not using it")
            return None
    return gemm


def verify_fused(silu_mul: Callable[..., torch.Tensor], rope_inplace: Callable[..., None],
                  add_rms_norm: Callable[..., torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 64, generator=gen) * 4).to(torch.bfloat16)
    ref = torch.nn.functional.silu(x[:, :32].float()) * x[:, 32:].float()
    if not torch.allclose(silu_mul(x).float(), ref, atol=2e-2, rtol=2e-2):
        raise RuntimeError("silu_mul kernel gave wrong results")
    qkv = torch.randn(3, 5 * 32, generator=gen).to(torch.bfloat16)
    angles = torch.randn(3, 1, 16, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    qk = qkv[:, :96].float().view(3, 3, 32)
    ref = qk * cos.float() + torch.cat((-qk[..., 16:], qk[..., :16]), dim=-1) * sin.float()  # rotate-half
    rope_inplace(qkv, cos, sin, 3, 32)
    if not torch.allclose(qkv[:, :96].float().view(3, 3, 32), ref, atol=3e-2, rtol=2e-2):
        raise RuntimeError("rope kernel gave wrong results")
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    residual = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    w = (torch.rand(32, generator=gen) + 0.5).to(torch.bfloat16)
    summed = residual + x
    ref = torch.nn.functional.rms_norm(summed.float(), (32,), w.float(), 1e-5)
    out = add_rms_norm(x, residual, w, 1e-5)
    if not (torch.equal(residual, summed) and torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)):
        raise RuntimeError("add_rms_norm kernel gave wrong results")


def verify_gemma_ops(kernels: CpuKernels) -> None:
    """GeGLU, the fp32-weight RMSNorm and the soft-cap against torch, at widths with a partial vector
    (every width is a kernel shape), and each the same bits for a row alone as in the batch."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    if kernels.gelu_tanh_mul is not None:
        x = (torch.randn(5, 2 * 37, generator=gen) * 3).to(torch.bfloat16)
        out = kernels.gelu_tanh_mul(x)
        ref = F.gelu(x[:, :37].float(), approximate="tanh") * x[:, 37:].float()
        if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2) or not torch.equal(kernels.gelu_tanh_mul(x[3:4]), out[3:4]):
            raise RuntimeError("gelu_tanh_mul kernel gave wrong results")
    if kernels.rms_norm_f32w is not None:
        x = (torch.randn(5, 53, generator=gen) * 3).to(torch.bfloat16)
        w = torch.rand(53, generator=gen) + 0.5
        out = kernels.rms_norm_f32w(x, w, 1e-6)
        ref = F.rms_norm(x.float(), (53,), w, 1e-6)
        if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2) or not torch.equal(kernels.rms_norm_f32w(x[2:3], w, 1e-6), out[2:3]):
            raise RuntimeError("rms_norm_f32w kernel gave wrong results")
    if kernels.softcap_ is not None:
        x = torch.randn(3, 1001, generator=gen) * 40
        ref = torch.tanh(x / 30.0) * 30.0
        out = x.clone()
        kernels.softcap_(out, 30.0)
        row = x[1:2].clone()
        kernels.softcap_(row, 30.0)
        if not torch.allclose(out, ref, atol=1e-4, rtol=1e-5) or not torch.equal(row, out[1:2]):
            raise RuntimeError("softcap kernel gave wrong results")


def verify_rms_norm(rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
    x = torch.randn(5, 96).to(torch.bfloat16)
    w = (torch.rand(96) + 0.5).to(torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (96,), w.float(), 1e-5)
    if not torch.allclose(rms_norm(x, w, 1e-5).float(), ref, atol=2e-2, rtol=2e-2):
        raise RuntimeError("rms_norm kernel gave wrong results")


def verify_paged_attention_int8(paged_attention: Callable[..., torch.Tensor], store_kv_paged: Callable[..., None],
                                store_kv: Callable[..., None]) -> None:
    """The int8 KV path: store_kv's bytes are the contract's formula; decodes and a chunk over int8
    caches in the kernel's layout match the fp32 reference over the dequantized values; one row
    alone gives the same bits as in the batch."""
    from chatserve.kernels.kv_quant import dequantize_kv_rows, quantize_kv_rows
    from chatserve.kernels.reference import paged_extend_attention

    gen = torch.Generator().manual_seed(1)
    k_src = (torch.randn(24, 2, 32, generator=gen) * 2).to(torch.bfloat16)
    v_src = torch.randn(24, 2, 32, generator=gen).to(torch.bfloat16)
    k_src[3, 1] = 0  # a zero row: scale 0
    k_plain = torch.zeros(6, 4, 2, 36, dtype=torch.int8)
    v_plain = torch.zeros_like(k_plain)
    store_kv(k_src, v_src, k_plain, v_plain, torch.arange(24))
    if not (torch.equal(k_plain.view(24, 2, 36), quantize_kv_rows(k_src))
            and torch.equal(v_plain.view(24, 2, 36), quantize_kv_rows(v_src))):
        raise RuntimeError("store_kv kernel wrote int8 K/V that differ from the KV contract's formula")
    q = torch.randn(8, 6, 32, generator=gen).to(torch.bfloat16)
    tables = torch.tensor([[5, 1, 0, 3, 4], [2, 2, 2, 2, 2], [4, 3, 0, 1, 5]])
    query_start, start_pos = torch.tensor([0, 1, 2, 8]), torch.tensor([8, 0, 13])  # two decodes, a 6-token chunk
    order, groups = torch.arange(3), torch.tensor([0, 1, 3])
    k_ref, v_ref = dequantize_kv_rows(k_plain, torch.float32), dequantize_kv_rows(v_plain, torch.float32)
    ref = paged_extend_attention(q.float(), k_ref, v_ref, tables, query_start, torch.tensor([9, 1, 19]), 0.2)
    k_paged, v_paged = torch.empty_like(k_plain), torch.empty_like(v_plain)
    store_kv_paged(k_src, v_src, k_paged, v_paged, torch.arange(24))
    out = paged_attention(q, k_paged, v_paged, tables, query_start, start_pos, order, groups, 0.2)
    alone = paged_attention(q[5:6], k_paged, v_paged, tables[2:], torch.tensor([0, 1]), torch.tensor([16]),
                            torch.tensor([0]), torch.tensor([0, 1]), 0.2)
    if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2) or not torch.equal(alone, out[5:6]):
        raise RuntimeError("paged attention kernel gave wrong results over an int8 KV cache")


def verify_paged_attention(paged_attention: Callable[..., torch.Tensor], store_kv_paged: Callable[..., None],
                            store_kv: Callable[..., None]) -> None:
    """Decodes and chunks over cached keys in one call against the torch reference (the caches
    written in the kernel's layout), and one row alone giving the same bits as in the batch."""
    from chatserve.kernels.reference import paged_extend_attention, store_kv_cache

    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 4, 2, 32, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(6, 4, 2, 32, generator=gen).to(torch.bfloat16)
    q = torch.randn(8, 6, 32, generator=gen).to(torch.bfloat16)
    tables = torch.tensor([[5, 1, 0, 3, 4], [2, 2, 2, 2, 2], [4, 3, 0, 1, 5]])
    query_start, start_pos = torch.tensor([0, 1, 2, 8]), torch.tensor([8, 0, 13])  # two decodes, a 6-token chunk
    order, groups = torch.arange(3), torch.tensor([0, 1, 3])
    ref = paged_extend_attention(q.float(), k_cache.float(), v_cache.float(), tables, query_start, torch.tensor([9, 1, 19]), 0.2)
    k_paged, v_paged = torch.empty_like(k_cache), torch.empty_like(v_cache)
    store_kv_paged(k_cache.view(24, 2, 32), v_cache.view(24, 2, 32), k_paged, v_paged, torch.arange(24))
    out = paged_attention(q, k_paged, v_paged, tables, query_start, start_pos, order, groups, 0.2)
    alone = paged_attention(q[5:6], k_paged, v_paged, tables[2:], torch.tensor([0, 1]), torch.tensor([16]),
                            torch.tensor([0]), torch.tensor([0, 1]), 0.2)
    if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2) or not torch.equal(alone, out[5:6]):
        raise RuntimeError("paged attention kernel gave wrong results")
    kv = torch.randn(3, 2 * 2 * 32, generator=gen).to(torch.bfloat16).view(3, 4, 32)  # strided K and V views
    slots = torch.tensor([5, -1, 22])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    store_kv_cache(kv[:, :2], kv[:, 2:], expect_k, expect_v, slots)
    store_kv(kv[:, :2], kv[:, 2:], k_cache, v_cache, slots)
    if not (torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)):
        raise RuntimeError("store_kv kernel gave wrong results")
