"""The batch-invariant bf16 matmul (csrc/bf16_gemm.cpp, issue #20): each row of x @ W.T has the same
bits whatever the row count of the call, the row's position in it and the thread split, for the
model's shapes and ragged ones; close to the fp32 matmul; bad inputs refused by name; and the
linear method that serves it (packed weights, a tied embedding read back from the packed copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu_gemv import load_cpu_kernels
from chatserve.layers.linear import (
    GemvLinearMethod,
    Linear,
    PackedGemmLinearMethod,
    kernel_linear,
    select_linear_method,
)

# every row count the blocking treats differently: register tiles of 1-6 rows (8 columns wide up
# to 3 rows), spread tails, the thread split switching from columns to rows at 64, cache blocks of 96
ROW_COUNTS = [*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 1000, 1100]
MAX_ROWS = max(ROW_COUNTS)


@pytest.fixture(scope="module")
def gemm():
    kernels = load_cpu_kernels(amx=False)
    if kernels is None or kernels.gemm is None:
        pytest.skip("no AVX512-BF16 CPU or no compiler: the engine uses torch ops instead")
    return kernels.gemm


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
# column cache blocks (3072 x 576: 4 blocks of weights per thread)
@pytest.mark.parametrize("n,m", [(1000, 5), (1000, 40), (1000, 300), (3072, 300)])
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


def test_the_old_split_is_what_this_replaces(gemm):
    """Why the kernel exists: the older dot-product kernel + oneDNN split rounds the same row
    differently at different row counts (this guards the invariance tests above: the same check
    does see a difference on a path that has one)."""
    kernels = load_cpu_kernels(amx=False)
    torch.manual_seed(11)
    w = torch.randn(576, 576).to(torch.bfloat16)
    x = torch.randn(300, 576).to(torch.bfloat16)
    full = kernel_linear(x, w, None, kernels.gemv)
    alone = torch.cat([kernel_linear(x[i : i + 1], w, None, kernels.gemv) for i in range(0, 300, 10)])
    assert not torch.equal(alone, full[::10])
    packed = gemm.pack(w)
    full = gemm.linear(x, packed, None, 576)
    assert torch.equal(torch.cat([gemm.linear(x[i : i + 1], packed, None, 576) for i in range(0, 300, 10)]), full[::10])


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
    with pytest.raises(RuntimeError, match="bf16_gemm_pack"):
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


def test_linear_method_packs_once_and_serves_a_tied_embedding(gemm, monkeypatch):
    monkeypatch.delenv("CHATSERVE_LINEAR", raising=False)
    kernels = load_cpu_kernels(amx=False)
    method = select_linear_method(torch.bfloat16, torch.device("cpu"), kernels)
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


def test_legacy_switch_and_bad_values(gemm, monkeypatch):
    kernels = load_cpu_kernels(amx=False)
    monkeypatch.setenv("CHATSERVE_LINEAR", "legacy")
    assert isinstance(select_linear_method(torch.bfloat16, torch.device("cpu"), kernels), GemvLinearMethod)
    monkeypatch.setenv("CHATSERVE_LINEAR", "fast")
    with pytest.raises(ValueError, match="CHATSERVE_LINEAR"):
        select_linear_method(torch.bfloat16, torch.device("cpu"), kernels)


def test_peak_probe_reports_a_rate(gemm):
    assert gemm.peak_gflops(10_000) > 0
