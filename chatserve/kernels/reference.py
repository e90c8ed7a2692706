"""Pure-torch reference ops for attention over a paged KV cache.

These are the ground truth for the Triton kernels and the CPU execution path.
Layout of one layer's cache (vLLM "flash" layout): ``[num_blocks, block_size,
num_kv_heads, head_dim]``; a *slot* is ``block_id * block_size + offset``, so a
token's K/V lives at ``cache.view(-1, num_kv_heads, head_dim)[slot]``.

An int8 cache (``--kv-cache-dtype int8``) holds rows of ``head_dim + 4`` int8: each token's
quants and its fp32 scale (kernels/kv_quant.py); the store quantizes, every read dequantizes
(``read_kv``) right after the gather.

Performance note for the CPU path: every layer of one forward pass attends over
the same block tables, so the expensive index arithmetic (block table -> token
slots, padding masks) is done once per forward by the caller and passed in as
``token_slots``/``mask``. The functions compute them themselves when omitted.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from chatserve.kernels.kv_quant import quantize_kv_rows, read_kv


def store_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = do not store (padding)
) -> None:
    """Write each new token's K/V into its slot. Slots of -1 are skipped. An int8 cache (rows of
    head_dim + 4) gets each row quantized with its own scale (kernels/kv_quant.py)."""
    k_flat = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    v_flat = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if k_flat.dtype == torch.int8:
        key, value = quantize_kv_rows(key), quantize_kv_rows(value)
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] x [B, nb] -> [B, kvh, max_len, d], copying whole blocks.

    Copying whole blocks (index_select on the block dim) is ~3x faster on the
    CPU than gathering token by token. Positions past a sequence's length hold
    stale data from earlier use of the block (never uninitialised memory: the
    engine writes zeros into every block before its first use); callers mask them.
    """
    batch = block_tables.shape[0]
    flat = cache.index_select(0, block_tables.reshape(-1))
    return flat.view(batch, -1, cache.shape[-2], cache.shape[-1])[:, :max_len].transpose(1, 2)


def _gather(cache: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] x [B, L] -> [B, kvh, L, d]."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    return flat[token_slots].transpose(1, 2)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] tokens in the cache, the new token included
    scale: float,
    *,
    max_len: int | None = None,  # max(context_lens), when the caller knows it (saves a sync)
    mask: torch.Tensor | None = None,  # [B, 1, 1, L] bool, True = attend; computed when omitted
) -> torch.Tensor:
    """One query token per sequence over all its cached tokens (GQA aware).

    Rows of `block_tables` past a sequence's blocks must name blocks holding
    finite data (the engine pads with the sequence's own first block).
    """
    batch, num_heads, head_dim = query.shape
    if max_len is None:
        max_len = int(context_lens.max())
    if mask is None and batch > 1:
        positions = torch.arange(max_len, device=query.device)
        mask = (positions.unsqueeze(0) < context_lens.unsqueeze(1)).view(batch, 1, 1, max_len)
    k = read_kv(gather_blocks(k_cache, block_tables, max_len), query.dtype)
    v = read_kv(gather_blocks(v_cache, block_tables, max_len), query.dtype)
    num_kv_heads = k.shape[1]
    # NOTE: the query heads sharing a KV head are folded into rows ([B, KVH, rep, D]), so
    # grouped-query attention needs no copy of K/V per query head.
    q = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_extend_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1] offsets of each sequence's new tokens in `query`
    seq_lens: torch.Tensor,  # [B] cached prefix + new tokens (the new K/V are already stored)
    scale: float,
) -> torch.Tensor:
    """New tokens attend to their sequence's cached prefix and causally to themselves.

    Ragged batches are handled one sequence at a time: prefill is compute bound,
    so the Python loop costs little next to the matmuls and no padding is wasted.
    """
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    block_size = k_cache.shape[1]
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_new = q_end - q_start
        if num_new == 0:
            continue
        table = block_tables[i : i + 1, : -(-seq_len // block_size)]
        k = read_kv(gather_blocks(k_cache, table, seq_len), query.dtype)  # whole blocks: ~3x faster than per token
        v = read_kv(gather_blocks(v_cache, table, seq_len), query.dtype)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        gqa = num_heads != k.shape[1]
        out[q_start:q_end] = extend_attention_dense(q, k, v, seq_len - num_new, scale, gqa).squeeze(0).transpose(0, 1)
    return out


def extend_attention_dense(
    q: torch.Tensor,  # [1, H, n, D]
    k: torch.Tensor,  # [1, KVH, prefix + n, D]
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """Causal attention of n new queries whose keys start with `prefix_len` cached ones."""
    num_new = q.shape[2]
    if prefix_len == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if num_new == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if gqa:
        # NOTE: fold the query heads sharing a KV head into rows (row = token * rep + head), so
        # K/V are not repeated per query head; the causal mask repeats per row instead.
        num_heads, head_dim, kvh = q.shape[1], q.shape[3], k.shape[1]
        rep = num_heads // kvh
        qf = q[0].reshape(kvh, rep, num_new, head_dim).transpose(1, 2).reshape(1, kvh, num_new * rep, head_dim)
        mask = _offset_causal_mask(prefix_len, num_new, rep, q.dtype, q.device)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
        return out[0].reshape(kvh, num_new, rep, head_dim).transpose(1, 2).reshape(1, num_heads, num_new, head_dim)
    mask = _offset_causal_mask(prefix_len, num_new, 1, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@functools.lru_cache(maxsize=4)
def _offset_causal_mask(prefix_len: int, num_new: int, rep: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [num_new * rep, prefix_len + num_new]: row t*rep+h sees keys up to prefix_len + t.

    Cached: every layer of a forward pass uses the same one, and building it (plus SDPA's own
    bool-to-additive conversion) per layer cost about as much as the attention of a short chunk.
    """
    total = prefix_len + num_new
    q_pos = torch.arange(prefix_len, total, device=device).repeat_interleave(rep).unsqueeze(1)
    allowed = torch.arange(total, device=device).unsqueeze(0) <= q_pos
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


# ---------------------------------------------------------------------------
# Cascade attention: many sequences sharing a cached prefix (a system prompt).
#
# Without it every sequence gathers and attends over its own copy of the shared
# prefix in every layer, so a batch of 16 users behind a 1,000-token system
# prompt moves 16x the prefix K/V per layer per step. Here the prefix is
# gathered once and attended by all the group's queries in one call; each
# sequence then attends over its private suffix, and the two partial results are
# merged exactly through their log-sum-exp (softmax is associative that way).
# ---------------------------------------------------------------------------


def attention_lse(
    q: torch.Tensor,  # [B, N, M, D]
    k: torch.Tensor,  # [B, N, L, D]
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,  # bool, broadcastable to [B, N, M, L]; True = attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, N, M, D] and its log-sum-exp [B, N, M] (float32)."""
    if q.device.type == "cpu":
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=additive, scale=scale)[:2]
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, lse


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Combine two attention results over disjoint key sets. o: [..., D], lse: [...]."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [1, KVH, T * rep, D]: the query heads sharing a KV head become rows."""
    t, h, d = q.shape
    rep = h // num_kv_heads
    return q.reshape(t, num_kv_heads, rep, d).permute(1, 0, 2, 3).reshape(1, num_kv_heads, t * rep, d)


def _unfold_gqa(x: torch.Tensor, t: int, rep: int) -> torch.Tensor:
    """Inverse of `_fold_gqa` for outputs [1, KVH, T*rep, D] or lse [1, KVH, T*rep] -> [T, H(, D)]."""
    kvh = x.shape[1]
    if x.dim() == 4:
        return x.reshape(kvh, t, rep, x.shape[-1]).permute(1, 0, 2, 3).reshape(t, kvh * rep, x.shape[-1])
    return x.reshape(kvh, t, rep).permute(1, 0, 2).reshape(t, kvh * rep)


def _prefix_part(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_slots: torch.Tensor, scale: float):
    num_kv_heads = k_cache.shape[-2]
    t, h, _ = query.shape
    k = read_kv(_gather(k_cache, prefix_slots.unsqueeze(0)), query.dtype)  # [1, KVH, P, D]
    v = read_kv(_gather(v_cache, prefix_slots.unsqueeze(0)), query.dtype)
    out, lse = attention_lse(_fold_gqa(query, num_kv_heads), k, v, scale)
    rep = h // num_kv_heads
    return _unfold_gqa(out, t, rep), _unfold_gqa(lse, t, rep)


def cascade_decode_attention(
    query: torch.Tensor,  # [B, H, D], one token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_slots: torch.Tensor,  # [P] slots of the prefix all B sequences share
    suffix_slots: torch.Tensor,  # [B, Ls] slots of each sequence's tokens after the prefix (padded)
    suffix_mask: torch.Tensor | None,  # [B, 1, 1, Ls] bool, or None when all suffixes have length Ls
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-2]
    rep = num_heads // num_kv_heads
    o_p, lse_p = _prefix_part(query, k_cache, v_cache, prefix_slots, scale)
    k = read_kv(_gather(k_cache, suffix_slots), query.dtype)  # [B, KVH, Ls, D]
    v = read_kv(_gather(v_cache, suffix_slots), query.dtype)
    q = query.reshape(batch, num_kv_heads, rep, head_dim)
    o_s, lse_s = attention_lse(q, k, v, scale, suffix_mask)
    return merge_attention_states(o_p, lse_p, o_s.reshape(batch, num_heads, head_dim), lse_s.reshape(batch, num_heads))


def cascade_extend_attention(
    query: torch.Tensor,  # [T, H, D], the new tokens of the group's sequences, packed in order
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_slots: torch.Tensor,  # [P] shared prefix; every new token's position is >= P
    query_lens: list[int],  # new tokens per sequence
    suffix_slots: list[torch.Tensor],  # per sequence: slots of positions [P, seq_len)
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[-2]
    rep = num_heads // num_kv_heads
    o_p, lse_p = _prefix_part(query, k_cache, v_cache, prefix_slots, scale)
    o_s = torch.empty_like(o_p)
    lse_s = torch.empty_like(lse_p)
    start = 0
    for n, slots in zip(query_lens, suffix_slots):
        suffix_len = slots.shape[0]
        k = read_kv(_gather(k_cache, slots.unsqueeze(0)), query.dtype)
        v = read_kv(_gather(v_cache, slots.unsqueeze(0)), query.dtype)
        q = query[start : start + n]  # [n, H, D] -> rows ordered (token, rep)
        q = q.reshape(n, num_kv_heads, rep, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, n * rep, head_dim)
        first = suffix_len - n  # suffix index of this sequence's first new token
        q_pos = torch.arange(first, suffix_len, device=query.device).repeat_interleave(rep).unsqueeze(1)
        mask = torch.arange(suffix_len, device=query.device).unsqueeze(0) <= q_pos  # [n*rep, Ls]
        out, lse = attention_lse(q, k, v, scale, mask.view(1, 1, n * rep, suffix_len))
        o_s[start : start + n] = _unfold_gqa(out, n, rep)
        lse_s[start : start + n] = _unfold_gqa(lse, n, rep)
        start += n
    return merge_attention_states(o_p, lse_p, o_s, lse_s)


# ---------------------------------------------------------------------------
# Sliding-window and soft-capped attention (Gemma 2/3, Phi-3, Mistral): the ground truth.
# ---------------------------------------------------------------------------


def window_start(pos: int, window: int) -> int:
    """First key a query at `pos` attends to: HF's sliding window keeps key k when k > pos - window."""
    return max(0, pos - window + 1) if window > 0 else 0


def paged_masked_attention(
    query: torch.Tensor,  # [T, H, D], each sequence's new rows in order
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: list[list[int]],
    query_start: list[int],  # [S + 1] offsets of each sequence's rows in `query`
    start_pos: list[int],  # [S] position of each sequence's first new row
    scale: float,
    *,
    window: int = 0,  # > 0: a row at pos sees keys pos - window + 1 .. pos only
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score / softcap) before the mask
) -> torch.Tensor:
    """Attention with explicit float32 scores, as transformers' eager attention computes it
    (scores * scale, soft-cap, mask, softmax in float32, weights cast to the query's dtype, then V).

    Only the blocks holding keys some row of the sequence can see are read, so entries of a table
    before the first row's window may name any block (freed ones included).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[-2], k_cache.shape[1]
    rep = num_heads // num_kv_heads
    out = torch.empty_like(query)
    k_flat = k_cache.reshape(-1, num_kv_heads, k_cache.shape[-1])  # (head_dim, or head_dim + 4 in int8)
    v_flat = v_cache.reshape(-1, num_kv_heads, v_cache.shape[-1])
    for i, table in enumerate(block_tables):
        q0, q1 = query_start[i], query_start[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        first, last = window_start(start_pos[i], window), start_pos[i] + n - 1
        keys = torch.arange(first, last + 1, device=query.device)
        blocks = torch.tensor(table, dtype=torch.int64, device=query.device)
        slots = blocks[keys // block_size] * block_size + keys % block_size
        k = read_kv(k_flat[slots], query.dtype).transpose(0, 1)  # [KVH, L, D]
        v = read_kv(v_flat[slots], query.dtype).transpose(0, 1)
        q = query[q0:q1].reshape(n, num_kv_heads, rep, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, n * rep, head_dim)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [KVH, n * rep, L]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(start_pos[i], start_pos[i] + n, device=query.device).repeat_interleave(rep).unsqueeze(1)
        visible = keys.unsqueeze(0) <= q_pos
        if window > 0:
            visible &= keys.unsqueeze(0) > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        o = torch.matmul(weights, v)  # [KVH, n * rep, D]
        out[q0:q1] = o.reshape(num_kv_heads, n, rep, head_dim).permute(1, 0, 2, 3).reshape(n, num_heads, head_dim)
    return out
