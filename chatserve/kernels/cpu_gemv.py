"""C++ kernels for AVX512-BF16 CPUs, compiled on first use: the batch-invariant bf16 matmul over
packed weights, one kernel for every row count (csrc/bf16_gemm.cpp), the older dot-product matmul
(csrc/bf16_gemv.cpp, kept for CHATSERVE_LINEAR=legacy), the AMX tile matmul over pre-packed
weights for CPUs that have AMX (csrc/amx_gemm.cpp), paged attention for prefill, extend and decode (csrc/cpu_attention.cpp),
and fused rotary, silu*up and RMSNorm (csrc/cpu_fused.cpp). Each is checked against torch here before it is used.
Why and how fast: BENCHMARKS.md ("Offline runtime").

The extension is built once per machine with torch's cpp_extension (ninja and a
C++ compiler) and cached; if anything is missing, `load_cpu_kernels` returns None
and callers use torch ops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_GEMV_ROWS = 128  # the kernel takes any row count; above this oneDNN is as fast (see models/cpu_linear.py)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("bf16_gemv.cpp", "bf16_gemm.cpp", "amx_gemm.cpp", "cpu_attention.cpp", "cpu_fused.cpp")]
_HEADERS = [_CSRC / "simd.h"]


def cpu_has_flags(*flags: str) -> bool:
    """Every one of `flags` in /proc/cpuinfo's first flags line (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(flags) <= set(line.split())
    except OSError:
        pass
    return False


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
    """The batch-invariant AVX512-BF16 matmul over weights packed once (csrc/bf16_gemm.cpp): every
    output element is one fixed accumulation chain over K, so a row's result has the same bits
    whatever the row count of the call and the row's position in it."""

    pack: Callable[..., torch.Tensor]  # bf16 [N, K] (, out=) -> packed [ceil(N/64), ceil(K/2), 64, 2]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]  # x [M, K], packed, bias, N
    rows: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]  # packed, int64 ids [T], N, K -> rows [T, K]
    peak_gflops: Callable[[int], float]  # iterations -> register-only vdpbf16ps GFLOP/s on all threads

    @staticmethod
    def packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
        return ((n + 63) // 64, (k + 1) // 2, 64, 2)


@dataclass(frozen=True)
class CpuKernels:
    gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # x[M, K] . w[N, K]^T (+ bias)
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # bf16 rows [M, D], weight [D], eps
    # prefill, extend and decode in one kernel (csrc/cpu_attention.cpp): q [T, H, D], k/v cache (as
    # store_kv_paged writes them), block tables [S, nb], query_start [S + 1], start_pos [S], seq_order [S],
    # group_start [G + 1] (all int64), scale -> [T, H, D]
    paged_attention: Callable[..., torch.Tensor]
    # the same as store_kv, into paged_attention's layout within each block (K pairs by dim, V pairs by key)
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


def load_cpu_kernels(amx: bool = True) -> CpuKernels | None:
    """The compiled kernels, verified on this machine, or None (callers then use torch ops).

    amx=False leaves the AMX matmul out even where the CPU has tiles (the AVX512-BF16 path).
    """
    if not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"chatserve_cpu_kernels_{_sources_hash()}"
        build_dir = _build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive_build(build_dir):
            ext = load(
                # NOTE: one build folder per checkout and version of the sources (a hash of both in the
                # name): checkouts sharing one name rebuild over each other (torch's build file holds
                # absolute source paths).
                name=name,
                build_directory=str(build_dir),
                sources=[str(p) for p in _SOURCES],
                # -fopenmp: at::parallel_for is inlined from headers and is serial without it
                # the header's hash in the flags: torch rebuilds when sources or flags change, not headers
                # -mamx-*: only the AMX functions use tile instructions; they run only where amx_available()
                # -ffp-contract=off: no multiply fuses with an add unless the source says so, so a kernel's
                # arithmetic is the same in every place it is inlined (batch invariance, issue 20)
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                              "-fopenmp", "-ffp-contract=off", f"-DCHATSERVE_HEADERS={_headers_hash()}"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        fn = ext.bf16_gemv
        _verify_rms_norm(ext.rms_norm_bf16)
        # prove it on this machine before trusting it
        w = torch.randn(96, 80).to(torch.bfloat16)
        b = torch.randn(96).to(torch.bfloat16)
        for m in (1, 3, 8, 13, 32):
            x = torch.randn(m, 80).to(torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
            if not torch.allclose(fn(x, w, b).float(), ref, atol=0.05 * float(ref.abs().max()) + 0.05):
                logger.warning("bf16 gemv kernel gave wrong results; using F.linear")
                return None
        _verify_paged_attention(ext.paged_attention_bf16, ext.store_kv_paged_bf16, ext.store_kv_bf16)
        _verify_fused(ext.silu_mul_bf16, ext.rope_inplace_bf16, ext.add_rms_norm_bf16)
        return CpuKernels(gemv=fn, rms_norm=ext.rms_norm_bf16, paged_attention=ext.paged_attention_bf16,
                          store_kv_paged=ext.store_kv_paged_bf16,
                          store_kv=ext.store_kv_bf16, silu_mul=ext.silu_mul_bf16, rope_inplace=ext.rope_inplace_bf16,
                          add_rms_norm=ext.add_rms_norm_bf16, huge_page_zeros=ext.huge_page_zeros,
                          release_free_memory=ext.release_free_memory, gemm=_load_gemm(ext),
                          amx=_load_amx(ext) if amx else None)
    except Exception as exc:  # no compiler, no ninja, unusual platform: the slower path still works
        logger.info("bf16 gemv kernel unavailable (%s); using F.linear", exc)
        return None


def _load_gemm(ext) -> PackedGemm | None:
    """The batch-invariant matmul, proven on this machine (close to the fp32 matmul, each row the
    same bits alone as in a batch, the packed rows read back exactly), or None."""
    gemm = PackedGemm(pack=ext.bf16_gemm_pack, linear=ext.bf16_gemm, rows=ext.bf16_gemm_rows,
                      peak_gflops=ext.bf16_dot_peak_gflops)
    gen = torch.Generator().manual_seed(0)
    for n, k in ((80, 64), (150, 71)):  # a ragged column group; an odd K
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        x = torch.randn(70, k, generator=gen).to(torch.bfloat16)  # > one register tile, both thread splits
        packed = gemm.pack(w)
        out = gemm.linear(x, packed, b, n)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        alone = torch.cat([gemm.linear(x[i : i + 1], packed, b, n) for i in (0, 37, 69)])
        ids = torch.tensor([n - 1, 0, 17])
        if not (torch.allclose(out.float(), ref, atol=0.02 * float(ref.abs().max()) + 0.02)
                and torch.equal(alone, out[[0, 37, 69]]) and torch.equal(gemm.rows(packed, ids, n, k), w[ids])):
            logger.warning("batch-invariant bf16 matmul gave wrong results; using the older kernels")
            return None
    return gemm


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


def _build_root() -> Path:
    """Where torch's cpp_extension would build (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<py>_cpu)."""
    import os
    import sys

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


@contextlib.contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """One builder at a time, and no stale lock from a builder that died.

    Why: torch's own build lock is a plain file that a killed process leaves behind, and every
    later process then waits on it forever (a test's server killed at its startup timeout while
    compiling stalled the rest of CI). An flock is released by the kernel when its holder dies;
    holding it, nobody else is building, so a leftover torch lock is stale and is removed.
    """
    import fcntl

    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sources_hash() -> str:
    import hashlib

    digest = hashlib.sha1(str(_CSRC.resolve()).encode())
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _headers_hash() -> str:
    import hashlib

    return hashlib.sha1(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:12]


def _verify_fused(silu_mul: Callable[..., torch.Tensor], rope_inplace: Callable[..., None],
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


def _verify_rms_norm(rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
    x = torch.randn(5, 96).to(torch.bfloat16)
    w = (torch.rand(96) + 0.5).to(torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (96,), w.float(), 1e-5)
    if not torch.allclose(rms_norm(x, w, 1e-5).float(), ref, atol=2e-2, rtol=2e-2):
        raise RuntimeError("rms_norm kernel gave wrong results")


def _verify_paged_attention(paged_attention: Callable[..., torch.Tensor], store_kv_paged: Callable[..., None],
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
