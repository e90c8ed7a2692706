"""The torch reference attention ops against dense attention written out by hand."""

from __future__ import annotations

import random

import pytest
import torch

from chatserve.forward_batch import build_forward_batch
from chatserve.kernels import (
    cascade_decode_attention,
    cascade_extend_attention,
    paged_decode_attention,
    paged_extend_attention,
    store_kv_cache,
)


def dense_attention(q, k, v, scale, q_positions):
    """q [n, H, D] at absolute q_positions; k/v [L, KVH, D] for positions 0..L-1; causal."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).float()
    v = v.repeat_interleave(rep, dim=1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    mask = torch.arange(k.shape[0]).unsqueeze(0) <= torch.tensor(q_positions).unsqueeze(1)
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v)


def make_cache(num_blocks, block_size, kvh, d, dtype):
    k = torch.randn(num_blocks, block_size, kvh, d).to(dtype)
    v = torch.randn(num_blocks, block_size, kvh, d).to(dtype)
    return k, v


def gather_dense(cache, table, length, block_size):
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
    return flat[torch.tensor(slots)]


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_dense(block_size, dtype):
    torch.manual_seed(0)
    h, kvh, d = 8, 2, 32
    k_cache, v_cache = make_cache(64, block_size, kvh, d, dtype)
    lens = [1, 5, block_size, 3 * block_size + 7, 70]
    perm = list(range(64))
    random.Random(0).shuffle(perm)
    tables, pos = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[pos : pos + nb])
        pos += nb
    q = torch.randn(len(lens), h, d).to(dtype)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens), d**-0.5)
    for i, n in enumerate(lens):
        k_dense, v_dense = gather_dense(k_cache, tables[i], n, block_size), gather_dense(v_cache, tables[i], n, block_size)
        ref = dense_attention(q[i : i + 1], k_dense, v_dense, d**-0.5, [n - 1])
        torch.testing.assert_close(out[i].float(), ref[0], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_paged_extend_matches_dense_for_ragged_batches(dtype, heads):
    torch.manual_seed(1)
    (h, kvh), bs, d = heads, 16, 16
    k_cache, v_cache = make_cache(40, bs, kvh, d, dtype)
    specs = [(0, 20), (16, 9), (35, 1), (48, 30)]  # (cached prefix, new tokens)
    tables, nxt = [], 0
    for pre, new in specs:
        nb = -(-(pre + new) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    q = torch.randn(sum(n for _, n in specs), h, d).to(dtype)
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_extend_attention(q, k_cache, v_cache, bt, torch.tensor(qsl), torch.tensor([p + n for p, n in specs]), d**-0.5)
    for i, (pre, new) in enumerate(specs):
        total = pre + new
        ref = dense_attention(
            q[qsl[i] : qsl[i + 1]], gather_dense(k_cache, tables[i], total, bs), gather_dense(v_cache, tables[i], total, bs),
            d**-0.5, list(range(pre, total)),
        )
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_store_kv_skips_negative_slots():
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 33]))
    flat = k_cache.view(-1, 2, 8)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[33], k[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_equals_plain(dtype):
    torch.manual_seed(2)
    bs, h, kvh, d = 16, 9, 3, 64
    k_cache, v_cache = make_cache(80, bs, kvh, d, dtype)
    shared = list(range(10))  # 160 shared tokens
    tables = [shared + [10 + 2 * i, 11 + 2 * i] for i in range(5)]
    lens = [160 + 1, 160 + 17, 160 + 32, 160 + 5, 160 + 20]
    q = torch.randn(5, h, d).to(dtype)
    bt = torch.tensor(tables)
    plain = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens), d**-0.5)
    batch = build_forward_batch(
        decode_tokens=[0] * 5, decode_positions=[n - 1 for n in lens], decode_block_tables=tables,
        extend_tokens=[], extend_start_positions=[], extend_block_tables=[], extend_need_logits=[],
        block_size=bs, device=torch.device("cpu"),
    )
    assert len(batch.attn.decode_groups) == 1
    g = batch.attn.decode_groups[0]
    assert g.prefix_slots.numel() == 160
    out = cascade_decode_attention(q[g.rows], k_cache, v_cache, g.prefix_slots, g.suffix_slots, g.suffix_mask, d**-0.5)
    torch.testing.assert_close(out.float(), plain[g.rows].float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_extend_equals_plain(dtype):
    torch.manual_seed(3)
    bs, h, kvh, d = 16, 8, 2, 32
    k_cache, v_cache = make_cache(80, bs, kvh, d, dtype)
    shared = list(range(8))  # 128 shared cached tokens
    specs = [(128, 20), (128 + 16, 7), (130, 40)]  # (cached prefix, new)
    tables = [shared + [20 + 5 * i + j for j in range(5)] for i in range(3)]
    tokens = [[0] * n for _, n in specs]
    batch = build_forward_batch(
        decode_tokens=[], decode_positions=[], decode_block_tables=[],
        extend_tokens=tokens, extend_start_positions=[p for p, _ in specs], extend_block_tables=tables,
        extend_need_logits=[True] * 3, block_size=bs, device=torch.device("cpu"),
    )
    assert len(batch.attn.extend_groups) == 1
    g = batch.attn.extend_groups[0]
    q = torch.randn(sum(n for _, n in specs), h, d).to(dtype)
    qsl = [0, 20, 27, 67]
    seq_lens = torch.tensor([p + n for p, n in specs])
    plain = paged_extend_attention(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(qsl), seq_lens, d**-0.5)
    out = cascade_extend_attention(q[g.token_rows], k_cache, v_cache, g.prefix_slots, g.query_lens, g.suffix_slots, d**-0.5)
    torch.testing.assert_close(out.float(), plain[g.token_rows].float(), atol=TOL[dtype], rtol=TOL[dtype])
