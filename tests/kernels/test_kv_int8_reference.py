"""The 8-bit KV cache's reference layout and arithmetic (kernels/kv_quant.py, the torch reference store
and attention): the bytes `store_kv_cache` writes are the contract's, exactly, and every reference
attention path over an int8 cache reads what dequantizing it gives (no other rounding on the way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chatserve.kernels.kv_quant import dequantize_kv_rows, kv_row_bytes, kv_row_width, quantize_kv_rows, read_kv
from chatserve.kernels.reference import (
    cascade_decode_attention,
    paged_decode_attention,
    paged_extend_attention,
    paged_masked_attention,
    store_kv_cache,
)


def _contract_bytes(row: list[float]) -> bytes:
    """The contract's bytes of one row, in numpy float32 (IEEE division, round half to even)."""
    x = np.asarray(row, dtype=np.float32)
    scale = np.float32(np.abs(x).max()) / np.float32(127.0)
    q = np.zeros_like(x, dtype=np.int8) if scale == 0 else np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return q.tobytes() + np.float32(scale).tobytes()


def test_store_writes_the_contract_bytes_hand_computed() -> None:
    """D = 4, one KV head, one block of 4 slots. Rows (all exact in bf16):
    - [127, 2.5, -3.5, 0.5]: amax 127, scale 1.0; ties round to even: 2, -4, 0;
    - [63.5, 1.25, -0.75, 0.25]: amax 63.5, scale 0.5; /scale = 127, 2.5, -1.5, 0.5 -> 127, 2, -2, 0;
    - zeros: quants 0 and scale 0.0;
    - [-1.0, 0.0, 0.0, 0.0]: amax 1, scale fl(1/127); -1/scale rounds to -127."""
    k = torch.tensor([[127, 2.5, -3.5, 0.5], [63.5, 1.25, -0.75, 0.25], [0, 0, 0, 0], [-1, 0, 0, 0]],
                     dtype=torch.bfloat16).view(4, 1, 4)
    v = -k
    k_cache = torch.full((2, 4, 1, 8), 99, dtype=torch.int8)
    v_cache = torch.full((2, 4, 1, 8), 99, dtype=torch.int8)
    store_kv_cache(k, v, k_cache, v_cache, torch.tensor([4, 5, 6, 7]))  # block 1; block 0 untouched
    one = np.float32(1.0).tobytes()
    half = np.float32(0.5).tobytes()
    inv127 = (np.float32(1.0) / np.float32(127.0)).tobytes()
    assert inv127 == bytes.fromhex("0402013c")  # 0x3c010204: fl(1/127) as the row's 4 raw bytes
    want_k = [
        bytes([127, 2, 256 - 4, 0]) + one,
        bytes([127, 2, 256 - 2, 0]) + half,
        bytes(8),
        bytes([256 - 127, 0, 0, 0]) + inv127,
    ]
    want_v = [
        bytes([256 - 127, 256 - 2, 4, 0]) + one,  # -2.5 -> -2, 3.5 -> 4, -0.5 -> -0 = 0
        bytes([256 - 127, 256 - 2, 2, 0]) + half,
        bytes(8),
        bytes([127, 0, 0, 0]) + inv127,
    ]
    assert [bytes(k_cache[1, s, 0].view(torch.uint8).tolist()) for s in range(4)] == want_k
    assert [bytes(v_cache[1, s, 0].view(torch.uint8).tolist()) for s in range(4)] == want_v
    assert (k_cache[0] == 99).all() and (v_cache[0] == 99).all()
    assert [_contract_bytes(r) for r in k.view(4, 4).float().tolist()] == want_k


@pytest.mark.parametrize("shape", [(1, 1, 64), (7, 3, 64), (5, 2, 128), (3, 1, 32)])
def test_quantize_matches_the_contract_in_numpy_for_random_rows(shape) -> None:
    """Every row of random bf16 values (a 1-row call included: no scalar shortcut in the division)."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 8).to(torch.bfloat16)
    x[0, 0, :3] = 0  # a few zeros beside non-zero values
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == shape[:-1] + (shape[-1] + 4,)
    got = rows.reshape(-1, rows.shape[-1]).view(torch.uint8).numpy()
    for i, row in enumerate(x.reshape(-1, shape[-1]).float().tolist()):
        assert got[i].tobytes() == _contract_bytes(row), i
    back = dequantize_kv_rows(rows, torch.float32)
    scale = rows[..., -4:].contiguous().view(torch.float32)
    assert (back - x.float()).abs().le(scale * 0.501).all()  # half a step off at most (plus rounding)


def test_float32_values_quantize_from_their_own_bits() -> None:
    """A float32 engine's K/V (no kernel tier) quantize from the float32 values, not a bf16 rounding."""
    x = torch.tensor([[[1.0, 0.3333333, -0.7071068, 0.1]]], dtype=torch.float32)
    assert quantize_kv_rows(x)[0, 0].view(torch.uint8).numpy().tobytes() == _contract_bytes(x.view(-1).tolist())


def test_row_sizes() -> None:
    assert (kv_row_width(64, torch.int8), kv_row_bytes(64, torch.int8)) == (68, 68)
    assert (kv_row_width(64, torch.bfloat16), kv_row_bytes(64, torch.bfloat16)) == (64, 128)
    assert kv_row_bytes(64, torch.float32) == 256


def _caches(num_blocks=6, bs=4, kvh=2, d=32, seed=0):
    """A bf16 K/V pair and the int8 caches storing it, and the bf16 caches holding what the int8 ones
    dequantize to: attention over the second pair must equal attention over the first bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(torch.bfloat16)
    k8 = torch.zeros(num_blocks, bs, kvh, d + 4, dtype=torch.int8)
    v8 = torch.zeros_like(k8)
    store_kv_cache(k, v, k8, v8, torch.arange(num_blocks * bs))
    kd, vd = dequantize_kv_rows(k8, torch.bfloat16), dequantize_kv_rows(v8, torch.bfloat16)
    return k8, v8, kd, vd


def test_reference_attention_over_int8_reads_the_dequantized_values() -> None:
    k8, v8, kd, vd = _caches()
    gen = torch.Generator().manual_seed(1)
    h, d = 4, 32
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]])
    q = torch.randn(2, h, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([15, 7])
    got = paged_decode_attention(q, k8, v8, tables, lens, 0.2)
    assert torch.equal(got, paged_decode_attention(q, kd, vd, tables, lens, 0.2))
    qe = torch.randn(9, h, d, generator=gen).to(torch.bfloat16)
    qsl, seq = torch.tensor([0, 5, 9]), torch.tensor([14, 8])
    got = paged_extend_attention(qe, k8, v8, tables, qsl, seq, 0.2)
    assert torch.equal(got, paged_extend_attention(qe, kd, vd, tables, qsl, seq, 0.2))
    lists = tables.tolist()
    got = paged_masked_attention(qe, k8, v8, lists, [0, 5, 9], [9, 4], 0.2, window=6, softcap=30.0)
    assert torch.equal(got, paged_masked_attention(qe, kd, vd, lists, [0, 5, 9], [9, 4], 0.2, window=6, softcap=30.0))
    prefix = torch.arange(8)
    suffix = torch.tensor([[8, 9, 10], [16, 17, 17]])
    got = cascade_decode_attention(q, k8, v8, prefix, suffix, None, 0.2)
    assert torch.equal(got, cascade_decode_attention(q, kd, vd, prefix, suffix, None, 0.2))
    assert read_kv(k8, torch.bfloat16).shape == kd.shape == (6, 4, 2, 32)


def test_a_tokens_bytes_do_not_depend_on_the_tokens_stored_with_it() -> None:
    """Per-token scales: a token stored alone, or in a chunk with others, gets the same bytes."""
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(8, 2, 64, generator=gen) * torch.arange(1, 9).view(8, 1, 1)).to(torch.bfloat16)
    together = torch.zeros(2, 4, 2, 68, dtype=torch.int8)
    store_kv_cache(k, k, together, together.clone(), torch.arange(8))
    one_by_one = torch.zeros_like(together)
    for t in range(8):
        store_kv_cache(k[t : t + 1], k[t : t + 1], one_by_one, one_by_one.clone(), torch.tensor([t]))
    assert torch.equal(together, one_by_one)
