"""Triton kernels for attention over the paged KV cache (the CUDA path).

Same signatures and cache layout as `reference.py` (the CPU path and the ground
truth): one layer's cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``
and a token's K/V live at slot ``block_table[pos // block_size] * block_size +
pos % block_size``. The kernels read K/V through the block table directly; no
block is ever gathered into a dense tensor.

- `store_kv_cache`: one program per new token; a slot of -1 is skipped.
- `paged_decode_attention`: one program per (sequence, KV head, split of the
  context). The query heads sharing a KV head are the rows of one tile, so K/V
  are read once per group (grouped-query attention). Long contexts with few
  sequences are split ("flash decoding"): each split writes a partial output and
  its log-sum-exp, and a second kernel merges them.
- `paged_extend_attention`: one program per (sequence, KV head, tile of new
  tokens x query heads of the group); keys are the sequence's cached prefix and,
  causally, its own new tokens, for ragged batches in one launch.

All softmax arithmetic is float32 (online softmax in base 2). Loads past a
sequence's context are masked, so the kernels never read the stale or
uninitialised tail of a block.

The kernels are `@triton.jit` functions decided when this module is imported:
with ``TRITON_INTERPRET=1`` in the environment at that moment they run in
Triton's interpreter on CPU tensors (tests), otherwise they compile for CUDA.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Log2(e): the kernels use exp2, so the softmax scale is folded with it.
_LOG2E = 1.4426950408889634


def is_interpreted() -> bool:
    """True when these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_store_kv_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# KV store
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,  # cache strides of a slot and of a head (head_dim is contiguous)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # NOTE: a slot of -1 (padding) stores nothing: zero heads pass the mask.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; -1 = do not store
) -> None:
    """Write each new token's K/V into its slot. Slots of -1 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(k_cache, v_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ---------------------------------------------------------------------------------------------
# Decode: one query token per sequence
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_bt,  # block table row stride
    stride_cs, stride_ch,  # cache strides of a slot and of a head
    stride_pb, stride_ph, stride_ps,  # partial output [B, H, S, D] (lse: [B, H, S], same first strides / D)
    block_size,
    num_splits,  # a runtime value: a new split count needs no recompilation
    window,  # > 0: the query (at ctx_len - 1) sees the last `window` keys only
    softcap,  # > 0 with SOFTCAP: scores become softcap * tanh(score / softcap)
    REP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # one split: normalise and write the output here, no merge
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,  # do the dots in float32 (fp32 caches; bf16 under the interpreter)
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < REP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * REP + offs_h

    ctx_len = tl.load(context_lens_ptr + b)
    lo = 0  # the window's first key (0: every key)
    if WINDOW:
        lo = tl.maximum(ctx_len - window, 0)
    split_len = (ctx_len - lo + num_splits - 1) // num_splits
    start = tl.minimum(lo + split * split_len, ctx_len)  # late splits of short contexts are empty: start == end
    end = tl.minimum(start + split_len, ctx_len)

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_table_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = block * block_size + pos % block_size
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if SOFTCAP:
            # log2-domain soft-capped scores: cap * tanh(dot * scale / cap) * log2(e), tanh from sigmoid
            s = (2.0 * tl.sigmoid(2.0 * s * (qk_scale / 1.4426950408889634) / softcap) - 1.0) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if DIRECT_OUT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & d_mask[None, :])
    else:
        # NOTE: a split with no keys (context shorter than the number of splits) writes a
        # zero output with lse = -inf, so the merge gives it weight exactly 0.
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        base = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] + offs_d[None, :], out,
                 mask=head_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + base // stride_ps, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    base = b * stride_pb + h * stride_ph + offs_s * stride_ps
    lse = tl.load(part_lse_ptr + base // stride_ps, mask=s_mask, other=float("-inf"))
    # split 0 always holds the sequence's first key, so the max is finite
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(part_out_ptr + base[:, None] + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_KEYS_PER_SPLIT = 1024


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Split the context when (sequences x KV heads) programs would leave the GPU idle.

    Each split gets at least 1,024 keys. Measured on one H200 (benchmarks/gpu/gpu_tune.py, bf16, 14q/2kv
    d64): with 256 keys a split, B=64 x 1,024-token contexts took 3 splits and 117 us against 30 us
    unsplit (the merge and the extra partial sums cost more than the idle SMs); B=1 x 4,096 tokens
    is fastest with 4 splits (36 us; 16 splits 45 us).
    """
    if device.type == "cuda":
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        min_keys = MIN_KEYS_PER_SPLIT
    else:  # the interpreter: split modestly so the engine tests exercise the merge too
        target, min_keys = 4, 256
    programs = batch * num_kv_heads
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_len, min_keys), 32))


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] tokens in the cache, the new token included (each >= 1)
    scale: float,
    *,
    max_len: int | None = None,  # max(context_lens) when the caller knows it; only sizes the splits
    mask: torch.Tensor | None = None,  # accepted for signature parity with the reference; unused
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim] to write into (default: a new tensor)
    num_splits: int | None = None,  # override the split heuristic (tests)
    window: int = 0,  # > 0: the last `window` keys only (a sliding-window layer)
    softcap: float = 0.0,  # > 0: soft-capped scores (Gemma 2)
    block_n: int | None = None,  # tuning overrides (benchmarks/gpu/gpu_tune.py); None = the defaults below
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """One query token per sequence over all its cached tokens (GQA aware)."""
    del mask  # lengths come from context_lens; nothing past them is read
    batch, num_heads, head_dim = query.shape
    _check_cache(k_cache, v_cache)
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    rep = _check_heads(num_heads, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if max_len is None:
        max_len = block_tables.shape[1] * block_size  # an upper bound; no device sync
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, query.device)
    if block_n is None:  # H200, d64: 128 keys a step with 2 warps was best or near it in every case swept
        block_n = 128 if head_dim <= 64 else (64 if head_dim <= 128 else 32)
    if num_warps is None:
        num_warps = 2 if head_dim <= 64 else 4
    dot_f32 = _dot_in_f32(query.dtype)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_lse,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        num_heads * num_splits * head_dim, num_splits * head_dim, head_dim,
        block_size, num_splits, window, softcap,
        REP=rep, HEAD_DIM=head_dim, DIRECT_OUT=num_splits == 1,
        BLOCK_H=max(16, triton.next_power_of_2(rep)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_F32=dot_f32, WINDOW=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out,
            num_heads * num_splits * head_dim, num_splits * head_dim, head_dim,
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Extend: new tokens over a cached prefix plus themselves (prefill, chunked prefill, cache hits)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_cs, stride_ch,
    block_size,
    window,  # with WINDOW: a query at q_pos sees keys q_pos - window + 1 .. q_pos
    softcap,  # with SOFTCAP: scores become softcap * tanh(score / softcap)
    REP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    num_new = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - num_new
    # NOTE: rows are (new token, query head of this KV head's group) pairs, token-major,
    # so one tile of K/V serves every query head that shares it.
    row0 = tile * BLOCK_M
    if row0 < num_new * REP:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tok = offs_m // REP
        head = kvh * REP + offs_m % REP
        m_mask = tok < num_new
        # rows past the sequence's tokens get positions >= seq_len: they see every key, stay
        # finite, and are never stored
        q_pos = prefix_len + tok
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_table_ptr + b * stride_bt
        last_tok = tl.minimum(row0 + BLOCK_M - 1, num_new * REP - 1) // REP
        kv_end = tl.minimum(seq_len, prefix_len + last_tok + 1)  # keys past the tile's last query are masked anyway
        kv_start = 0
        if WINDOW:  # keys before the tile's first query's window are masked for every row: skip them
            kv_start = tl.maximum(prefix_len + row0 // REP - window + 1, 0)
        for n0 in range(kv_start, kv_end, BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < kv_end
            block = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
            slot = block * block_size + pos % block_size
            kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            if SOFTCAP:
                # log2-domain soft-capped scores: cap * tanh(dot * scale / cap) * log2(e), tanh from sigmoid
                s = (2.0 * tl.sigmoid(2.0 * s * (qk_scale / 1.4426950408889634) / softcap) - 1.0) * (softcap * 1.4426950408889634)
            else:
                s = s * qk_scale
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            if WINDOW:  # a row may see no key of this tile yet: keep its state finite (no -inf - -inf)
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        if WINDOW:  # padding rows past the sequence may see no key at all
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_extend_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1] offsets of each sequence's new tokens in `query`
    seq_lens: torch.Tensor,  # [B] cached prefix + new tokens (the new K/V are already stored)
    scale: float,
    *,
    max_query_len: int | None = None,  # longest run of new tokens; computed (one sync) when omitted
    out: torch.Tensor | None = None,
    block_m: int | None = None,  # tuning overrides (benchmarks/gpu/gpu_tune.py); None = the defaults below
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    window: int = 0,  # > 0: each query sees its last `window` keys only (a sliding-window layer)
    softcap: float = 0.0,  # > 0: soft-capped scores (Gemma 2)
) -> torch.Tensor:
    """New tokens attend to their sequence's cached prefix and causally to themselves."""
    num_tokens, num_heads, head_dim = query.shape
    _check_cache(k_cache, v_cache)
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    rep = _check_heads(num_heads, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty_like(query)
    batch = block_tables.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if block_m is None:
        block_m = 64 if head_dim <= 128 else 32
    if block_n is None:  # H200, d64: 128 keys a step, 2,048-token prefill 86 -> 68 us
        block_n = 128 if head_dim <= 64 else 32
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len * rep, block_m))
    _extend_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, window, softcap,
        REP=rep, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_F32=_dot_in_f32(query.dtype), WINDOW=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _dot_in_f32(dtype: torch.dtype) -> bool:
    # NOTE: float32 caches get IEEE float32 dots (not TF32) so they match the reference tightly.
    # Triton's interpreter cannot multiply bfloat16 (numpy has no such type; it would compute on
    # the raw bits), so there bf16 operands are converted to float32 first; on a GPU bf16 and
    # fp16 dots run natively on tensor cores with float32 accumulation.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted())


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] with the same "
            f"strides; got {tuple(k_cache.shape)} {k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}"
        )
    if k_cache.stride(-1) != 1 or k_cache.stride(1) != k_cache.shape[2] * k_cache.shape[3]:
        raise ValueError("the KV cache's (block_size, num_kv_heads, head_dim) dims must be contiguous")


def _check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim > 256:
        raise ValueError(f"head_dim={head_dim} > 256 is not supported by the Triton kernels")
    return num_heads // num_kv_heads


__all__ = [
    "choose_num_splits",
    "is_interpreted",
    "paged_decode_attention",
    "paged_extend_attention",
    "store_kv_cache",
]
