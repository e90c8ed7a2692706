"""8-bit KV caches in the C++ attention kernels (issue 56: the KV contract, summed up here).

An int8 layer cache is [num_blocks, block_size, KVH, D + 4] int8: per (token, KV head) row, D quants
and an fp32 scale, with scale = amax / 127 and q = clamp(round_half_even(x / scale), -127, 127) (0
where the scale is 0), bit-exact in every implementation. `store_kv` writes the reference layout
(the row's D quants, then its scale's 4 bytes); `store_kv_paged` the kernel's layout inside each
block's head region (K quants [D][block_size], V quants [block_size][D], each then the region's
[block_size] scales); `paged_attention` reads that directly.

Checked for every tier this CPU runs (kernels.tiers.tested_tiers, capped by $CHATSERVE_MAX_CPU_TIER):
the stored bytes against the formula (both layouts), attention against the fp32 reference over the
dequantized caches, and the bits of a row the same however it is scheduled (alone, in a batch, in
chunks, in a shared-prefix group, at any block size), with sliding windows and soft-capping too.
"""

from __future__ import annotations

import pytest
import torch

from chatserve.kernels.kv_quant import dequantize_kv_rows, quantize_kv_rows
from chatserve.kernels.reference import paged_extend_attention, paged_masked_attention
from tests.kernels import test_cpu_attention
from tests.kernels.test_cpu_attention import SEQS, _i64, _setup, attend_paged

kernels = test_cpu_attention.kernels  # the tier fixture: every tier this CPU runs, capped by $CHATSERVE_MAX_CPU_TIER

# ------------------------------------------------------------------ the contract's layouts


def reference_rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 rows [..., D] -> the reference layout's int8 rows [..., D + 4] (kernels/kv_quant.py, the contract's formula)."""
    return quantize_kv_rows(x)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Reference-layout int8 rows [..., D + 4] -> fp32 [..., D] (q * scale)."""
    return dequantize_kv_rows(rows, torch.float32)


def kernel_layout(rows: torch.Tensor) -> torch.Tensor:
    """A reference-layout int8 cache [blocks, bs, KVH, D + 4] rewritten as store_kv_paged lays each
    block out: per KV head, K quants [D][bs] then [bs] scales (`is_k`), V quants [bs][D] then scales."""
    nb, bs, kvh, width = rows.shape
    d = width - 4
    out = torch.empty(nb, kvh, 2, bs * width, dtype=torch.int8)  # [.., K layout / V layout, region]
    quants = rows[..., :d].permute(0, 2, 1, 3)  # [nb, KVH, bs, D]
    scales = rows[..., d:].permute(0, 2, 1, 3).reshape(nb, kvh, bs * 4)
    out[:, :, 0] = torch.cat([quants.transpose(2, 3).reshape(nb, kvh, d * bs), scales], dim=-1)
    out[:, :, 1] = torch.cat([quants.reshape(nb, kvh, bs * d), scales], dim=-1)
    return out


def paged_int8(kernels, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 caches [blocks, bs, KVH, D] stored (every slot) into int8 caches in the kernel's layout."""
    nb, bs, kvh, d = k_cache.shape
    k_out = torch.empty(nb, bs, kvh, d + 4, dtype=torch.int8)
    v_out = torch.empty_like(k_out)
    kernels.store_kv_paged(k_cache.reshape(-1, kvh, d), v_cache.reshape(-1, kvh, d), k_out, v_out, torch.arange(nb * bs))
    return k_out, v_out


def attend(kernels, q, caches, tables, seqs, groups=None, scale=0.125, window=0, softcap=0.0):
    """seqs: (start position, new tokens) per sequence, their rows packed in order in q; `caches`: int8, kernel layout."""
    return attend_paged(kernels, q, *caches, tables, seqs, groups, scale, window, softcap)


def reference(q, k_cache, v_cache, tables, seqs, scale=0.125, window=0, softcap=0.0):
    """fp32 attention over the dequantized int8 values of bf16 caches."""
    k, v = dequantize(reference_rows(k_cache)), dequantize(reference_rows(v_cache))
    query_start = [0]
    for _, n in seqs:
        query_start.append(query_start[-1] + n)
    if window or softcap:
        return paged_masked_attention(q.float(), k, v, tables, query_start, [s for s, _ in seqs], scale,
                                      window=window, softcap=softcap)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    return paged_extend_attention(q.float(), k, v, padded, torch.tensor(query_start), torch.tensor([s + n for s, n in seqs]), scale)


# ------------------------------------------------------------------ the stored bytes


def _rows_with_edges(t: int, kvh: int, d: int, seed: int) -> torch.Tensor:
    """Random bf16 rows, plus rows the formula's edges hit: all zero (scale 0), amax 127 with
    .5 ties (round half to even: 2.5 -> 2, 3.5 -> 4), the max negative, one huge outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, kvh, d, generator=gen) * 3).to(torch.bfloat16)
    x[0, 0] = 0
    ties = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -2.5, 126.5, -127.0, 127.0] * d)[:d]
    x[1, 0] = ties.to(torch.bfloat16)  # scale exactly 1: x / scale = x
    x[2, -1] = -x[2, -1].abs()
    x[2, -1, 3] = -50.0
    x[3, 0, 5] = 1e4
    return x


@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(16, 3, 64), (4, 2, 32), (32, 1, 128), (8, 2, 256)])
def test_store_kv_writes_the_contract_bytes_in_both_layouts(kernels, block_size, kv_heads, head_dim):
    """store_kv: every written row's bytes equal the formula's (quants, then the scale's raw bytes);
    store_kv_paged: the same bytes in the kernel's block layout. K and V come as strided views of
    one fused projection; slots of -1 are skipped (their bytes untouched)."""
    t = 23
    nb = -(-2 * t // block_size)  # room for every row, with slots to spare
    kv = torch.cat([_rows_with_edges(t, kv_heads, head_dim, seed=1), _rows_with_edges(t, kv_heads, head_dim, seed=2)], dim=1)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    perm = torch.randperm(nb * block_size, generator=torch.Generator().manual_seed(3))[:t]
    slots = perm.clone()
    slots[[4, 11]] = -1
    fill = torch.full((nb, block_size, kv_heads, head_dim + 4), 7, dtype=torch.int8)
    written = slots >= 0
    expect_k, expect_v = fill.clone(), fill.clone()
    expect_k.view(-1, kv_heads, head_dim + 4)[slots[written]] = reference_rows(k[written])
    expect_v.view(-1, kv_heads, head_dim + 4)[slots[written]] = reference_rows(v[written])

    k_cache, v_cache = fill.clone(), fill.clone()
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    # the edge rows' quants, spelled out
    q = k_cache.view(-1, kv_heads, head_dim + 4)[slots[1], 0, :9].tolist()
    assert q == [0, 2, 2, 4, 0, -2, 126, -127, 127][:head_dim]
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim + 4)[slots[0], 0], torch.zeros(head_dim + 4, dtype=torch.int8))

    # the paged layout: the same bytes where the kernel puts them (untouched slots keep the fill)
    k_paged, v_paged = fill.clone(), fill.clone()
    kernels.store_kv_paged(k, v, k_paged, v_paged, slots)
    assert torch.equal(k_paged.view(nb, kv_heads, -1), kernel_layout(expect_k)[:, :, 0])
    assert torch.equal(v_paged.view(nb, kv_heads, -1), kernel_layout(expect_v)[:, :, 1])


def test_store_refuses_bad_int8_caches(kernels):
    k = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    good = torch.zeros(2, 16, 1, 68, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        kernels.store_kv(k, k, torch.zeros(2, 16, 1, 64, dtype=torch.int8), torch.zeros(2, 16, 1, 64, dtype=torch.int8),
                         _i64([0, 1]))
    with pytest.raises(RuntimeError, match="both be bf16 or both int8"):
        kernels.store_kv_paged(k, k, good, torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16), _i64([0, 1]))
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        kernels.store_kv_paged(k, k, good, good.clone(), _i64([0, 32]))
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        attend(kernels, q, (good[..., :66].contiguous(), good[..., :66].contiguous()), [[0]], [(3, 1)])


# ------------------------------------------------------------------ attention over int8


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 32), (16, 1, 64, 8), (2, 1, 256, 16), (6, 2, 32, 4), (3, 3, 64, 2),
])
def test_int8_attention_matches_the_dequantized_reference_and_every_row_alone(kernels, heads, kv_heads, head_dim, block_size):
    """Ragged prefills, chunks over cached keys and decodes at block edges, GQA 1-16, head_dim
    32-256, blocks from 2 (smaller than a vector) to 32 keys: close to fp32 attention over the
    dequantized K/V, and each row alone (the decode of its position) the same bits as in its batch."""
    q, k_cache, v_cache, tables = _setup(heads, kv_heads, head_dim, block_size, SEQS, seed=heads * 100 + head_dim)
    scale = head_dim**-0.5
    caches = paged_int8(kernels, k_cache, v_cache)
    out = attend(kernels, q, caches, tables, SEQS, scale=scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, SEQS, scale), atol=1.5e-2, rtol=1e-2)
    row = 0
    for i, (start, n) in enumerate(SEQS):
        for j in range(0, n, 7 if n > 20 else 1):
            alone = attend(kernels, q[row + j : row + j + 1], caches, [tables[i]], [(start + j, 1)], scale=scale)
            assert torch.equal(alone, out[row + j : row + j + 1]), (i, j)
        row += n


def test_int8_attention_differs_from_bf16_by_the_quantization_only(kernels):
    """The int8 path reads the quantized values, not the bf16 ones: its output is the dequantized
    reference's, measurably off the bf16 caches' (so the test above cannot pass on bf16 data)."""
    q, k_cache, v_cache, tables = _setup(9, 3, 64, 16, [(0, 40)], seed=9)
    out = attend(kernels, q, paged_int8(kernels, k_cache, v_cache), tables, [(0, 40)]).float()
    exact = paged_extend_attention(q.float(), k_cache.float(), v_cache.float(), torch.tensor(tables), torch.tensor([0, 40]),
                                   torch.tensor([40]), 0.125)
    quantized = reference(q, k_cache, v_cache, tables, [(0, 40)])
    assert (out - quantized).abs().max() < (exact - quantized).abs().max()


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_int8_prompt_in_one_piece_in_chunks_decoded_and_at_another_block_size(kernels, block_size):
    """A 200-token prompt over int8 caches: in one call, in chunks of 1-96 tokens over its cached
    keys, and its last rows as decodes: bit-identical rows; and the same tokens stored at block
    size 16 instead give the same bits (a token's bytes depend on the token alone)."""
    n = 200
    q, k_cache, v_cache, tables = _setup(9, 3, 64, block_size, [(0, n)], seed=block_size)
    caches = paged_int8(kernels, k_cache, v_cache)
    whole = attend(kernels, q, caches, tables, [(0, n)])
    torch.testing.assert_close(whole.float(), reference(q, k_cache, v_cache, tables, [(0, n)]), atol=1.5e-2, rtol=1e-2)
    for chunk in (1, 7, 16, 96):
        parts = [attend(kernels, q[s : s + chunk], caches, tables, [(s, min(chunk, n - s))]) for s in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    keys = torch.cat([k_cache[b] for b in tables[0]])[:n]
    values = torch.cat([v_cache[b] for b in tables[0]])[:n]
    k16, v16 = torch.zeros(13, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(13, 16, 3, 64, dtype=torch.bfloat16)
    k16.view(-1, 3, 64)[:n], v16.view(-1, 3, 64)[:n] = keys, values
    assert torch.equal(attend(kernels, q, paged_int8(kernels, k16, v16), [list(range(13))], [(0, n)]), whole)


def test_int8_shared_prefix_groups_give_the_bits_of_plain_attention(kernels):
    """Decoders and chunks sharing a 20-block int8 prefix, read once per group: the same bits as
    each sequence attended on its own, in any grouping or order."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(120, 16, 3, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(120, 16, 3, 64, generator=gen).to(torch.bfloat16)
    shared = list(range(20))
    seqs = [(320 + 3 * i, 1) for i in range(6)] + [(320, 40), (330, 7)]
    tables = [shared + list(range(20 + 4 * i, 24 + 4 * i)) for i in range(len(seqs))]
    q = torch.randn(sum(n for _, n in seqs), 9, 64, generator=gen).to(torch.bfloat16)
    caches = paged_int8(kernels, k_cache, v_cache)
    plain = attend(kernels, q, caches, tables, seqs)
    assert torch.equal(attend(kernels, q, caches, tables, seqs, groups=[list(range(len(seqs)))]), plain)
    assert torch.equal(attend(kernels, q, caches, tables, seqs, groups=[[7, 0, 5], [2, 1, 6, 3, 4]]), plain)
    torch.testing.assert_close(plain.float(), reference(q, k_cache, v_cache, tables, seqs), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("window,softcap", [(24, 0.0), (0, 5.0), (37, 3.0)])
def test_int8_sliding_window_and_softcap(kernels, window, softcap):
    """Sliding windows (rows whose window starts mid-tile) and soft-capped scores over int8 caches:
    close to the eager reference over the dequantized K/V, and a row alone the same bits as in the batch."""
    seqs = [(0, 60), (90, 1), (50, 30), (3, 1)]
    q, k_cache, v_cache, tables = _setup(8, 2, 64, 8, seqs, seed=window + int(softcap))
    caches = paged_int8(kernels, k_cache, v_cache)
    out = attend(kernels, q, caches, tables, seqs, window=window, softcap=softcap)
    ref = reference(q, k_cache, v_cache, tables, seqs, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, atol=1.5e-2, rtol=1e-2)
    row = 0
    for i, (start, n) in enumerate(seqs):
        for j in range(0, n, 5):
            alone = attend(kernels, q[row + j : row + j + 1], caches, [tables[i]], [(start + j, 1)], window=window, softcap=softcap)
            assert torch.equal(alone, out[row + j : row + j + 1]), (i, j)
        row += n


def test_the_load_time_check_proves_the_int8_path(kernels):
    """kernels/cpu.py's check passes this tier's kernels and refuses a K/V store whose bytes leave
    the contract by one quant, or attention whose int8 results drift from the dequantized reference."""
    from chatserve.kernels.cpu import verify_paged_attention_int8

    verify_paged_attention_int8(kernels.paged_attention, kernels.store_kv_paged, kernels.store_kv)

    def off_by_one_store(k, v, k_cache, v_cache, slots):
        kernels.store_kv(k, v, k_cache, v_cache, slots)
        k_cache.view(-1)[5] += 1

    with pytest.raises(RuntimeError, match="KV contract"):
        verify_paged_attention_int8(kernels.paged_attention, kernels.store_kv_paged, off_by_one_store)

    def drifting_attention(*args):
        return kernels.paged_attention(*args) + 0.1

    with pytest.raises(RuntimeError, match="int8 KV cache"):
        verify_paged_attention_int8(drifting_attention, kernels.store_kv_paged, kernels.store_kv)
