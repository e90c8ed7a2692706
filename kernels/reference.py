"""Pure-torch reference ops for attention over a paged KV cache.

These are the ground truth for the Triton kernels and the CPU execution path.
Layout of one layer's cache (vLLM "flash" layout): ``[num_blocks, block_size,
num_kv_heads, head_dim]``; a *slot* is ``block_id * block_size + offset``, so a
token's K/V lives at ``cache.view(-1, num_kv_heads, head_dim)[slot]``.

Performance note for the CPU path: every layer of one forward pass attends over
the same block tables, so the expensive index arithmetic (block table -> token
slots, padding masks) is done once per forward by the caller and passed in as
``token_slots``/``mask``. The functions compute them themselves when omitted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = do not store (padding)
) -> None:
    """Write each new token's K/V into its slot. Slots of -1 are skipped."""
    k_flat = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    v_flat = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))


def token_slots_from_block_tables(block_tables: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_len] slot of every token position."""
    offsets = torch.arange(block_size, device=block_tables.device, dtype=torch.int64)
    slots = block_tables.to(torch.int64).unsqueeze(-1) * block_size + offsets
    return slots.reshape(block_tables.shape[0], -1)[:, :max_len]


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
    token_slots: torch.Tensor | None = None,  # [B, L] precomputed slots
    mask: torch.Tensor | None = None,  # [B, 1, 1, L] bool, True = attend
) -> torch.Tensor:
    """One query token per sequence over all its cached tokens (GQA aware)."""
    batch, num_heads, head_dim = query.shape
    if token_slots is None:
        max_len = int(context_lens.max())
        token_slots = token_slots_from_block_tables(block_tables, k_cache.shape[1], max_len)
    max_len = token_slots.shape[1]
    if mask is None and batch > 1:
        positions = torch.arange(max_len, device=query.device)
        valid = positions.unsqueeze(0) < context_lens.unsqueeze(1)
        mask = valid.view(batch, 1, 1, max_len)
        # padded positions read the sequence's first slot: finite, written data
        token_slots = torch.where(valid, token_slots, token_slots[:, :1])
    k = _gather(k_cache, token_slots).to(query.dtype)
    v = _gather(v_cache, token_slots).to(query.dtype)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    gqa = num_heads != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(2)


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
        slots = token_slots_from_block_tables(block_tables[i : i + 1], block_size, seq_len)
        k = _gather(k_cache, slots).to(query.dtype)
        v = _gather(v_cache, slots).to(query.dtype)
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
    total = prefix_len + num_new
    q_pos = torch.arange(prefix_len, total, device=q.device).unsqueeze(1)
    k_pos = torch.arange(total, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
