"""The quantized matmul (csrc/quant_gemm.cpp, issue #21; csrc/tier_quant.cpp per kernel tier, issue
#30) over GGUF blocks and int8 per channel, for every format and every tier this CPU runs:
- `rows` and `dequantize` read back exactly gguf's numpy de-quantisation, rounded to bf16;
- `linear` equals the product of the int8-quantised activations (quant_reference.quantize_activations)
  with gguf's fp32 weights up to fp32 summation and the output's bf16 rounding (ACT_TOL), and the
  fp32 product of the unquantised activations within the stated tolerance (FP32_MAX_TOL of the largest
  output, FP32_MEAN_TOL on average): the activations' int8 rounding is the only approximation;
- it is batch-invariant: the same bits for a row at every row count and position, and for a strided view;
- the torch reference agrees with it within ACT_TOL; bad inputs are refused by name;
- the integer products stay exact at the extremes (AVX2's vpmaddubsw saturates pair sums at int16:
  the largest quants times activations of +-127, and int8 weights of -128).

Raw blocks: gguf.quants.quantize where gguf implements it (Q4_0, Q4_1, Q8_0); Q4_K and Q6_K have no
quantizer in gguf 0.19, so their blocks are random bytes with small finite fp16 d / dmin (every bit
pattern of the quants and 6-bit / int8 scales is a valid block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from chatserve.kernels.cpu_quant import (  # noqa: E402
    BLOCK_VALUES,
    QTYPE_INT8_CHANNEL,
    SUPPORTED_QTYPES,
    load_quant_kernels,
)
from chatserve.kernels.quant_reference import quantize_activations, reference_quant_kernels  # noqa: E402
from chatserve.kernels.tiers import tested_tiers as _tested_tiers  # noqa: E402 (not a test: no test_ name here)
from tests.conftest import PROCESS_ENGINE_ARGS  # noqa: E402

ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 100, 257, 1000]  # tiles of 1-2 rows x 4 columns, then of 3-4 x 2, row blocks of 256
GGUF_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
              GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]
# N: a part-filled zmm column of 16 and register tile of 4 columns; K: an odd number of blocks
SHAPES = {32: [(37, 96), (150, 224)], 256: [(37, 256), (70, 768)]}


# every tier this CPU runs, best first (none: the tests that need kernels skip)
TIERS = _tested_tiers(PROCESS_ENGINE_ARGS.max_cpu_tier)  # this run's $CHATSERVE_MAX_CPU_TIER


@pytest.fixture(scope="module", params=TIERS or [None], ids=[t.name for t in TIERS] or ["no-tier"])
def quant(request):
    if request.param is None:
        pytest.skip("no kernel tier on this CPU (AVX2 or better): quantized weights are de-quantised at load")
    kernels = load_quant_kernels(request.param.name)
    if kernels is None:  # a tier this CPU runs: a failure, never a skip
        pytest.fail(f"the {request.param.name} quantized kernels did not build or failed their self-check")
    assert kernels.tier == request.param.name
    return kernels


def _raw_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: GGUF blocks of n rows of k values, as a file holds them."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        raw = rng.integers(0, 256, size=(n, k // block, type_size), dtype=np.uint8)
        scale = lambda: (rng.random((n, k // block)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, -1, 2)  # noqa: E731
        if qtype == GGMLQuantizationType.Q4_K:  # d, dmin first
            raw[:, :, 0:2], raw[:, :, 2:4] = scale(), scale()
        else:  # d last
            raw[:, :, 208:210] = scale()
        return raw.reshape(n, -1)
    values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    values[0, :block] = 0.0  # an all-zero block (d = 0)
    return gguf_quants.quantize(values, qtype)


def _case(qtype, n, k, seed):
    rng = np.random.default_rng(seed)
    raw = _raw_blocks(qtype, n, k, rng)
    deq32 = torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(n, k).copy())
    return torch.from_numpy(raw.copy()), deq32


# |kernel - quantised-activation product| <= ACT_TOL * |product| + ACT_TOL * max|product| (bf16: 2^-9)
ACT_TOL = 2**-7
# against the fp32 product of the bf16 activations: int8 activations in blocks of 32 (measured: max
# 0.5-0.7% of the largest output, mean 0.55% of the mean output)
FP32_MAX_TOL, FP32_MEAN_TOL = 0.02, 0.01


def _quantised_product(x: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    q, dx = quantize_activations(x)
    xa = (q.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    out = xa @ w32.double().T
    return out if bias is None else out + bias.double()


def _assert_act_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    limit = ACT_TOL * want.abs() + ACT_TOL * float(want.abs().max())
    assert bool((err <= limit).all()), f"max excess {float((err - limit).max())}"


def _check_matmul(quant, packed, qtype, n, k, w32, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for b in (None, bias):
        full = quant.linear(x, packed, qtype, n, k, b)
        assert full.shape == (x.shape[0], n) and full.dtype == torch.bfloat16
        _assert_act_close(full, _quantised_product(x, w32, b))
        ref = F.linear(x.float(), w32, None if b is None else b.float())
        err = (full.float() - ref).abs()
        assert float(err.max()) <= FP32_MAX_TOL * float(ref.abs().max())
        assert float(err.mean()) <= FP32_MEAN_TOL * float(ref.abs().mean())
        for m in ROW_COUNTS:
            assert torch.equal(quant.linear(x[:m], packed, qtype, n, k, b), full[:m]), f"M = {m}"
        for i in (0, 5, 99, 640, 999):  # each row alone: the same bits as in the batch of 1000
            assert torch.equal(quant.linear(x[i : i + 1], packed, qtype, n, k, b), full[i : i + 1]), f"row {i}"
        # a strided view (a slice of a fused projection's output)
        wide = torch.randn(9, k + 40, generator=gen).to(torch.bfloat16)
        assert torch.equal(quant.linear(wide[:, 8 : 8 + k], packed, qtype, n, k, b),
                           quant.linear(wide[:, 8 : 8 + k].contiguous(), packed, qtype, n, k, b))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_formats_multiply_gguf_weights_by_int8_activations(quant, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    reference = reference_quant_kernels()
    for idx, (n, k) in enumerate(SHAPES[block]):
        raw, w32 = _case(qtype, n, k, seed=int(qtype) * 10 + idx)
        w_bf16 = w32.to(torch.bfloat16)
        packed = quant.pack(raw, int(qtype), n, k)
        assert packed.dtype == torch.uint8 and packed.numel() == quant.packed_nbytes(int(qtype), n, k)
        assert torch.equal(quant.dequantize(packed, int(qtype), n, k), w_bf16)
        ids = torch.tensor([n - 1, 0, 17, 17, n // 2])
        assert torch.equal(quant.rows(packed, int(qtype), ids, n, k), w_bf16[ids])
        _check_matmul(quant, packed, int(qtype), n, k, w32, seed=idx)
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(idx)).to(torch.bfloat16)
        ref_packed = reference.pack(raw, int(qtype), n, k)  # the reference keeps the file's blocks
        _assert_act_close(quant.linear(x, packed, int(qtype), n, k, None),
                          reference.linear(x, ref_packed, int(qtype), n, k, None).double())


def test_pack_into_an_arena_slice(quant):
    qtype = GGMLQuantizationType.Q4_1
    raw, w32 = _case(qtype, 70, 96, seed=3)
    size = quant.packed_nbytes(int(qtype), 70, 96)
    arena = torch.zeros(size + 128, dtype=torch.uint8)
    view = arena[64 : 64 + size]
    out = quant.pack(raw, int(qtype), 70, 96, out=view)
    assert out.data_ptr() == view.data_ptr()
    assert torch.equal(quant.dequantize(view, int(qtype), 70, 96), w32.to(torch.bfloat16))
    assert not arena[:64].any() and not arena[64 + size :].any()


def test_int8_per_channel(quant):
    gen = torch.Generator().manual_seed(7)
    for n, k in ((37, 96), (150, 224)):
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
        w32 = scale[:, None] * q.float()
        w_bf16 = w32.to(torch.bfloat16)
        packed = quant.pack_int8(q, scale)
        assert packed.numel() == quant.packed_nbytes(QTYPE_INT8_CHANNEL, n, k)
        assert torch.equal(quant.dequantize(packed, QTYPE_INT8_CHANNEL, n, k), w_bf16)
        ids = torch.tensor([n - 1, 3, 0])
        assert torch.equal(quant.rows(packed, QTYPE_INT8_CHANNEL, ids, n, k), w_bf16[ids])
        _check_matmul(quant, packed, QTYPE_INT8_CHANNEL, n, k, w32, seed=n)
        x = torch.randn(17, k, generator=gen).to(torch.bfloat16)
        reference = reference_quant_kernels()
        _assert_act_close(quant.linear(x, packed, QTYPE_INT8_CHANNEL, n, k, None),
                          reference.linear(x, reference.pack_int8(q, scale), QTYPE_INT8_CHANNEL, n, k, None).double())


# bytes of each GGUF block that hold quants, set to the largest quant (0xFF: u = 15, Q6_K q = 63) or
# for Q8_0 to q = -128 (0x80; |q| = 128 is the sign trick's largest unsigned operand)
EXTREME_QUANTS = {GGMLQuantizationType.Q4_0: (slice(2, 18), 0xFF), GGMLQuantizationType.Q4_1: (slice(4, 20), 0xFF),
                  GGMLQuantizationType.Q8_0: (slice(2, 34), 0x80), GGMLQuantizationType.Q4_K: (slice(16, 144), 0xFF),
                  GGMLQuantizationType.Q6_K: (slice(0, 192), 0xFF)}


def _extreme_rows(k: int) -> torch.Tensor:
    """Rows whose int8 activations are +-127 everywhere (all +1, all -1, alternating, in pairs), then one random."""
    sign = torch.ones(4, k)
    sign[1] = -1
    sign[2, 1::2] = -1
    sign[3, 2::4] = -1
    sign[3, 3::4] = -1
    return torch.cat([sign, torch.randn(1, k, generator=torch.Generator().manual_seed(5))]).to(torch.bfloat16)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_extreme_quants_stay_exact(quant, qtype):
    """The largest quants times activations of +-127 over whole sub-blocks: the sums an int16 lane of
    vpmaddubsw accumulates are at their bound (4-bit: 16 products of 15 x 127; 6-bit: 4 of 63 x 127;
    8-bit: 2 of 128 x 127); a saturated or wrapped sum would be far outside ACT_TOL."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n, k = 40, 2 * max(block, 64)
    raw = _raw_blocks(qtype, n, k, np.random.default_rng(11)).reshape(n, k // block, type_size)
    where, value = EXTREME_QUANTS[qtype]
    raw[:, :, where] = value
    raw = raw.reshape(n, -1)
    w32 = torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(n, k).copy())
    packed = quant.pack(torch.from_numpy(raw.copy()), int(qtype), n, k)
    assert torch.equal(quant.dequantize(packed, int(qtype), n, k), w32.to(torch.bfloat16))
    x = _extreme_rows(k)
    _assert_act_close(quant.linear(x, packed, int(qtype), n, k, None), _quantised_product(x, w32, None))


def test_int8_of_minus_128_stays_exact(quant):
    """int8 per channel weights may hold -128 (pack_int8 takes any int8): |q| = 128 times 127, twice, is
    the sign trick's largest pair (32512 <= 32767)."""
    n, k = 24, 96
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    q[2, ::3] = 0
    scale = torch.rand(n, generator=torch.Generator().manual_seed(2)) * 0.01 + 1e-4
    w32 = scale[:, None] * q.float()
    packed = quant.pack_int8(q, scale)
    assert torch.equal(quant.dequantize(packed, QTYPE_INT8_CHANNEL, n, k), w32.to(torch.bfloat16))
    x = _extreme_rows(k)
    _assert_act_close(quant.linear(x, packed, QTYPE_INT8_CHANNEL, n, k, None), _quantised_product(x, w32, None))


def test_packed_weights_take_the_files_bytes(quant):
    """Repacking keeps each format's size (N a multiple of 64 outputs, no padding): Q6_K's 6-bit quants
    stay 6-bit (4 + 2-bit planes); Q4_K only spreads its 12 bytes of 6-bit scales/mins to 16."""
    n = 128
    for qtype in GGUF_TYPES:
        block, type_size = GGML_QUANT_SIZES[qtype]
        k = 2 * max(block, 256)
        extra = 4 if qtype == GGMLQuantizationType.Q4_K else 0
        assert quant.packed_nbytes(int(qtype), n, k) == n * (k // block) * (type_size + extra), qtype.name


def test_supported_types_and_blocks():
    assert SUPPORTED_QTYPES == {2, 3, 8, 12, 14, QTYPE_INT8_CHANNEL}
    for qtype in GGUF_TYPES:
        assert BLOCK_VALUES[int(qtype)] == GGML_QUANT_SIZES[qtype][0]


def test_bad_inputs_are_refused_by_name(quant):
    qtype = int(GGMLQuantizationType.Q4_0)
    raw, _ = _case(GGMLQuantizationType.Q4_0, 20, 64, seed=1)
    packed = quant.pack(raw, qtype, 20, 64)
    assert packed.numel() == quant.packed_nbytes(qtype, 20, 64) > 20 * 64 // 2
    with pytest.raises(RuntimeError, match="multiple of the format's block"):
        quant.packed_nbytes(qtype, 20, 48)
    with pytest.raises(RuntimeError, match="multiple of the format's block"):
        quant.pack(raw, int(GGMLQuantizationType.Q4_K), 20, 64)
    with pytest.raises(RuntimeError, match="raw must be uint8"):
        quant.pack(raw.to(torch.int8), qtype, 20, 64)
    with pytest.raises(RuntimeError, match=r"raw must be \[N = 21"):
        quant.pack(raw, qtype, 21, 64)
    with pytest.raises(RuntimeError, match="qtype 6 is not supported"):
        quant.pack(raw, 6, 20, 64)
    with pytest.raises(RuntimeError, match=f"out must be a contiguous uint8 tensor of {packed.numel()} bytes"):
        quant.pack(raw, qtype, 20, 64, out=torch.empty(100, dtype=torch.uint8))
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        quant.linear(x.float(), packed, qtype, 20, 64, None)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        quant.linear(x[:, :32], packed, qtype, 20, 64, None)
    with pytest.raises(RuntimeError, match="unit stride along K"):
        quant.linear(torch.randn(64, 3).to(torch.bfloat16).t(), packed, qtype, 20, 64, None)
    with pytest.raises(RuntimeError, match=f"packed has {packed.numel()} bytes"):
        quant.linear(x, packed, qtype, 80, 64, None)
    with pytest.raises(RuntimeError, match="bias must be bf16 \\[20\\]"):
        quant.linear(x, packed, qtype, 20, 64, torch.zeros(19, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="row id 20 out of range"):
        quant.rows(packed, qtype, torch.tensor([20]), 20, 64)
    with pytest.raises(RuntimeError, match="ids must be int64"):
        quant.rows(packed, qtype, torch.tensor([1], dtype=torch.int32), 20, 64)
    with pytest.raises(RuntimeError, match="q must be int8"):
        quant.pack_int8(torch.zeros(4, 32), torch.ones(4))
    with pytest.raises(RuntimeError, match=r"scale must be float32 \[N = 4\]"):
        quant.pack_int8(torch.zeros(4, 32, dtype=torch.int8), torch.ones(3))
