"""The batch-invariant bf16 matmul (issue #20; csrc/tier_gemm.cpp for each kernel tier this CPU runs,
issue #30): each row of x @ W.T has the same bits whatever
the row count of the call, the row's position in it and the thread split, for the model's shapes and
ragged ones; close to the fp32 matmul; rounded to bf16 as torch rounds (nearest even, NaN kept); bad
inputs refused by name; and the linear method that serves it (packed weights, a tied embedding read
back from the packed copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels import tiers
from chatserve.kernels.cpu import CpuKernels, PackedGemm
from chatserve.kernels.tiers import TIERS, build_tier_family
from chatserve.layers.linear import Linear, PackedGemmLinearMethod, select_linear_method
from tests.conftest import PROCESS_ENGINE_ARGS
from tests.helpers.tier_compile import compile_tier_object, unrunnable_tiers

# this run's tier cap ($CHATSERVE_MAX_CPU_TIER, read at the edge by EngineArgs.from_env in conftest)
CAP = PROCESS_ENGINE_ARGS.max_cpu_tier

# every row count the blocking treats differently: register tiles of 1-6 rows (wider with fewer
# rows), spread tails, the thread split switching from columns to rows at 64, row cache blocks
ROW_COUNTS = [*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 1000, 1100]
MAX_ROWS = max(ROW_COUNTS)
# each tier this CPU runs (up to the run's cap), csrc/tier_gemm.cpp built for it
GEMM_TIERS = [t.name for t in tiers.tested_tiers(CAP)]


def tiered_gemm(ext) -> PackedGemm:
    """A tier's gemm extension as the PackedGemm the layers see (unchecked: the tests check it)."""
    return PackedGemm(pack=ext.gemm_pack, linear=ext.gemm, rows=ext.gemm_rows, peak_gflops=ext.dot_peak_gflops,
                      packed_shape=lambda n, k: tuple(ext.gemm_packed_shape(n, k)))


@pytest.fixture(scope="module", params=GEMM_TIERS)
def gemm_tier(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gemm(gemm_tier) -> PackedGemm:
    ext = build_tier_family("gemm", TIERS[gemm_tier])
    if ext is None:
        pytest.fail(f"csrc/tier_gemm.cpp did not build for {gemm_tier} (a tier this CPU runs)")
    return tiered_gemm(ext)


@pytest.fixture(scope="module")
def gemm_kernels(gemm_tier, gemm) -> CpuKernels:
    """A `CpuKernels` holding `gemm` (and the huge-page arena's allocator), for the linear method."""
    fused = build_tier_family("fused", TIERS[gemm_tier])
    if fused is None:
        pytest.fail(f"csrc/tier_fused.cpp did not build for {gemm_tier} (a tier this CPU runs)")
    return CpuKernels(tier=gemm_tier, rms_norm=fused.rms_norm_bf16, paged_attention=None, store_kv_paged=None,
                      store_kv=None, silu_mul=fused.silu_mul_bf16, rope_inplace=fused.rope_inplace_bf16,
                      add_rms_norm=fused.add_rms_norm_bf16, huge_page_zeros=fused.huge_page_zeros,
                      release_free_memory=fused.release_free_memory, gemm=gemm)


def _tolerance(ref: torch.Tensor) -> dict[str, float]:
    return dict(atol=1e-2 * float(ref.abs().max()), rtol=8e-3)  # one bf16 rounding of the result


# the model's (o_proj, k/v, MLP halves, fused qkv, fused gate|up, down, the tied lm_head) and ragged
# N (a part-filled group of 64 and of 16) and K (odd: a zero-padded k pair)
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (960, 576),
                                   (3072, 576), (49152, 576), (100, 70), (37, 33), (130, 1)])
def test_each_row_has_the_same_bits_at_every_row_count(gemm, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(MAX_ROWS, k, generator=gen).to(torch.bfloat16)
    packed = gemm.pack(w)
    assert packed.shape == gemm.packed_shape(n, k)
    full = gemm.linear(x, packed, b, n)
    assert full.shape == (MAX_ROWS, n) and full.dtype == torch.bfloat16
    big = n * k >= 10**7  # the lm_head: fewer row counts, the fp32 reference on a sample of rows
    sample = torch.arange(0, MAX_ROWS, 7 if big else 1)
    ref = F.linear(x[sample].float(), w.float(), b.float())
    torch.testing.assert_close(full[sample].float(), ref, **_tolerance(ref))

    counts = [1, 2, 3, 7, 8, 9, 33, 65, 129, 257, 1000] if big else ROW_COUNTS
    for m in counts:
        assert torch.equal(gemm.linear(x[:m], packed, b, n), full[:m]), f"rows 0..{m} differ from the same rows in {MAX_ROWS}"
    # at another position: the last rows of a call, or its rows in reverse order
    tail = MAX_ROWS - 300
    assert torch.equal(gemm.linear(x[tail:], packed, b, n), full[tail:])
    assert torch.equal(gemm.linear(x.flip(0), packed, b, n), full.flip(0))
    # alone (M = 1), sampled rows: first, tile and block edges, last
    for i in (0, 1, 5, 6, 63, 64, 95, 96, 500, MAX_ROWS - 1):
        assert torch.equal(gemm.linear(x[i : i + 1], packed, b, n), full[i : i + 1]), f"row {i} alone differs"
    # without a bias: the same invariance, close to the bias-free fp32 matmul
    plain = gemm.linear(x, packed, None, n)
    torch.testing.assert_close(plain[sample].float(), F.linear(x[sample].float(), w.float()), **_tolerance(ref))
    for i in (0, 7, MAX_ROWS - 1):
        assert torch.equal(gemm.linear(x[i : i + 1], packed, None, n), plain[i : i + 1])


# threads splitting the columns (few rows; many columns), the rows (many rows, few columns), and
# column cache blocks (3072 x 576: 4 blocks of weights per thread); a prefill over each split
@pytest.mark.parametrize("n,m", [(1000, 5), (1000, 40), (1000, 300), (3072, 300), (1536, 1000), (576, 1000)])
def test_thread_count_never_changes_a_bit(gemm, n, m):
    torch.manual_seed(m)
    w = torch.randn(n, 576).to(torch.bfloat16)
    x = torch.randn(m, 576).to(torch.bfloat16)
    packed = gemm.pack(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(gemm.linear(x, packed, None, n))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_strided_rows_are_read_in_place_and_bad_inputs_refused(gemm):
    torch.manual_seed(3)
    w = torch.randn(64, 96).to(torch.bfloat16)
    packed = gemm.pack(w)
    wide = torch.randn(40, 200).to(torch.bfloat16)
    x = wide[:, 7:103]  # a row-strided view, as a slice of a fused projection is
    assert torch.equal(gemm.linear(x, packed, None, 64), gemm.linear(x.contiguous(), packed, None, 64))
    assert gemm.linear(x[:0], packed, None, 64).shape == (0, 64)
    with pytest.raises(RuntimeError, match="unit stride"):
        gemm.linear(torch.randn(96, 40).to(torch.bfloat16).t(), packed, None, 64)
    with pytest.raises(RuntimeError, match="columns"):
        gemm.linear(torch.randn(3, 128).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="N = 80"):
        gemm.linear(x, packed, None, 80)
    with pytest.raises(RuntimeError, match="bias"):
        gemm.linear(x, packed, torch.randn(63).to(torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="bias"):
        gemm.linear(x, packed, torch.randn(64), 64)  # float32
    with pytest.raises(RuntimeError, match="x must be bf16"):
        gemm.linear(x.float(), packed, None, 64)
    with pytest.raises(RuntimeError, match="2-D"):
        gemm.linear(x[0], packed, None, 64)
    with pytest.raises(RuntimeError, match="gemm_pack"):
        gemm.linear(x, w, None, 64)  # a plain weight, not a packed one
    with pytest.raises(RuntimeError, match="out must be"):
        gemm.pack(w, out=torch.empty(1, 47, 64, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(49, 576), (64, 32), (5, 71)])
def test_packed_rows_give_back_the_exact_weight_rows(gemm, shape):
    """A tied embedding looks tokens up in the lm_head's packed copy: bit for bit the original rows."""
    torch.manual_seed(4)
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = gemm.pack(w)
    ids = torch.tensor([0, n - 1, n // 2, 0, n - 1])
    assert torch.equal(gemm.rows(packed, ids, n, k), w[ids])
    assert torch.equal(gemm.rows(packed, torch.arange(n), n, k), w)
    for bad in (-1, n):  # n: inside the zero padding of the last group, still not a row
        with pytest.raises(RuntimeError, match="out of range"):
            gemm.rows(packed, torch.tensor([bad]), n, k)


def test_linear_method_packs_once_and_serves_a_tied_embedding(gemm_kernels):
    method = select_linear_method(torch.bfloat16, torch.device("cpu"), gemm_kernels)
    assert isinstance(method, PackedGemmLinearMethod) and "batch-invariant" in method.description
    torch.manual_seed(5)
    head = Linear(96, 200, False, method)
    embedding = nn.Embedding(200, 96)
    with torch.no_grad():
        head.weight.copy_(torch.randn(200, 96))
        head.weight.data = head.weight.data.to(torch.bfloat16)
    plain = head.weight.detach().clone()
    head.process_weights()
    assert not hasattr(head, "weight") or head.weight is None  # only the packed copy is kept
    x = torch.randn(9, 96).to(torch.bfloat16)
    ref = F.linear(x.float(), plain.float())
    torch.testing.assert_close(head(x).float(), ref, **_tolerance(ref))
    tied = method.tied_embedding(head, embedding)
    ids = torch.tensor([3, 199, 0, 3])
    assert torch.equal(tied(ids), plain[ids])
    # a transposed input is made contiguous by the method (the kernel itself refuses it)
    assert torch.equal(head(x.t().contiguous().t()), head(x))


def test_peak_probe_reports_a_rate(gemm):
    assert gemm.peak_gflops(10_000) > 0


def test_rounding_is_torchs_nearest_even_and_nan_is_kept(gemm):
    """With K = 2 every product of two bf16 is exact in fp32, so acc = x0 w0 + x1 w1 is rounded once
    whatever the kernel's order; + bias and the bf16 rounding must then give torch's bits exactly:
    ties to even (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), overflow to inf, and NaN for NaN or
    inf * 0: 0x7FC0 on every tier (vec.h's store_bf16, c10's scalar rounding; torch's vectorised one
    writes 0xFFFF)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(64, 2, generator=gen).to(torch.bfloat16)
    w = torch.randn(48, 2, generator=gen).clamp(-1, 1).to(torch.bfloat16)  # |x w| stays finite: exact
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    b[:6] = 0
    x[0], w[0] = torch.tensor([1.0, 2.0**-8]), torch.tensor([1.0, 1.0])  # a tie: to 1.0 (even)
    x[1], w[1] = torch.tensor([1.0 + 2.0**-7, 2.0**-8]), torch.tensor([1.0, 1.0])  # a tie: to 1 + 2^-6
    x[2], w[2] = torch.tensor([3e38, 3e38]), torch.tensor([1.0, 1.0])  # the sum overflows: inf
    x[3, 0], x[4, 1] = float("nan"), float("inf")  # NaN; inf * w
    w[5] = torch.tensor([1.0, 0.0])  # inf * 0 in row 4: NaN
    packed = gemm.pack(w)
    for bias in (b, None):
        out = gemm.linear(x, packed, bias, 48)
        xf, wf = x.float(), w.float()
        ref = xf[:, :1] * wf[:, 0] + xf[:, 1:] * wf[:, 1]
        if bias is not None:
            ref = ref + bias.float()
        ref = ref.to(torch.bfloat16)
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))
        assert bool((out[nan].view(torch.int16) == 0x7FC0).all())  # vec.h's store_bf16: c10's quiet NaN
    assert float(gemm.linear(x[:2], packed, None, 48)[0, 0]) == 1.0
    assert float(gemm.linear(x[:2], packed, None, 48)[1, 1]) == 1.0 + 2.0**-6


def test_every_thread_count_and_row_position_gives_one_result(gemm):
    """Rows alone, in prefixes of every length up to 300 and the whole 1,000, at 1 and 2 threads:
    each row one set of bits (the column split of decode, the row split of prefill, spread tiles)."""
    gen = torch.Generator().manual_seed(21)
    n, k = 576, 200
    w = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(1000, k, generator=gen).to(torch.bfloat16)
    packed = gemm.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = gemm.linear(x, packed, b, n)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(gemm.linear(x, packed, b, n), full)
            for m in range(1, 301, 1 if threads == 1 else 7):
                assert torch.equal(gemm.linear(x[:m], packed, b, n), full[:m]), (threads, m)
            for i in range(0, 1000, 37):
                assert torch.equal(gemm.linear(x[i : i + 1], packed, b, n), full[i : i + 1]), (threads, i)
    finally:
        torch.set_num_threads(before)


UNRUNNABLE_TIERS = unrunnable_tiers()


# slow: ~50 s a tier on 2 cores (torch/extension.h alone), so `make test-all` runs it; a host of that
# width runs the tier itself in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("tier", UNRUNNABLE_TIERS)
def test_tier_gemm_compiles_for_tiers_this_cpu_cannot_run(tier, tmp_path):
    """tier_gemm.cpp's instantiations for a vector width this CPU lacks still compile (with that
    tier's flags; the object is not loaded: it would die of SIGILL here)."""
    result = compile_tier_object("gemm", TIERS[tier], tmp_path)
    if result is None:
        pytest.skip("no C++ compiler")
    assert result.returncode == 0, result.stderr[-4000:]
