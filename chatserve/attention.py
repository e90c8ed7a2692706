"""Routes one layer's attention through the kernels, as the ForwardBatch describes it.

This is the seam for attention backends: the torch reference ops (CPU path)
today, Triton kernels on CUDA later, with the same batch metadata.
"""

from __future__ import annotations

import torch

from chatserve.kernels import (
    cascade_decode_attention,
    cascade_extend_attention,
    paged_decode_attention,
    paged_extend_attention,
    store_kv_cache,
)

from .forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Store the new K/V, then attend decodes and extends (grouped by shared prefix where possible)."""
    store_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
    nd = batch.num_decodes
    if batch.num_extends == 0:
        return _decode(q, k_cache, v_cache, batch, scale)
    if nd == 0:
        return _extend(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    out[:nd] = _decode(q[:nd], k_cache, v_cache, batch, scale)
    out[nd:] = _extend(q[nd:], k_cache, v_cache, batch, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    def plain(qp: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(
            qp, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
            max_len=batch.decode_max_len, mask=batch.decode_mask,
        )

    if not batch.decode_groups:
        return plain(q)
    out = torch.empty_like(q)
    for g in batch.decode_groups:
        out[g.rows] = cascade_decode_attention(q[g.rows], k_cache, v_cache, g.prefix_slots, g.suffix_slots, g.suffix_mask, scale)
    if batch.decode_plain_rows is not None and batch.decode_plain_rows.numel():
        out[batch.decode_plain_rows] = plain(q[batch.decode_plain_rows])
    return out


def _extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    def plain(qp: torch.Tensor) -> torch.Tensor:
        return paged_extend_attention(
            qp, k_cache, v_cache, batch.extend_block_tables, batch.extend_query_start_loc, batch.extend_seq_lens, scale
        )

    if not batch.extend_groups:
        return plain(q)
    out = torch.empty_like(q)
    for g in batch.extend_groups:
        out[g.token_rows] = cascade_extend_attention(
            q[g.token_rows], k_cache, v_cache, g.prefix_slots, g.query_lens, g.suffix_slots, scale
        )
    if batch.extend_plain_rows is not None and batch.extend_plain_rows.numel():
        out[batch.extend_plain_rows] = plain(q[batch.extend_plain_rows])
    return out
