"""KV blocks out of the pool as bytes, and bytes back in: what the disk / Redis tiers store.

A block's bytes are ``kv_cache[:, :, b]`` (every layer's K and V of its slots, shape
``(layers, 2, block_size, kv_heads, head_dim)``), contiguous and in the pool's dtype, exactly as
the attention backend wrote them: a block loaded back is bit for bit the block that was computed,
so greedy tokens after a load equal a cold run's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["read_blocks", "write_blocks"]


@torch.inference_mode()
def read_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[bytes]:
    """One ``bytes`` per block (a copy: the block may be reused as soon as this returns)."""
    if not block_ids:
        return []
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    blocks = kv_cache.index_select(2, idx).movedim(2, 0).contiguous().cpu()  # (k, layers, 2, bs, heads, dim)
    raw = blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [raw[i].tobytes() for i in range(len(block_ids))]


@torch.inference_mode()
def write_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
    """Write ``payloads[i]`` (from ``read_blocks`` of a pool of the same shape and dtype) into block ``block_ids[i]``."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} blocks but {len(payloads)} payloads")
    if not block_ids:
        return
    # NOTE: one block at a time, straight from each payload's memory into the pool: no joined copy of the
    # whole run (45 MB for a 2,000-token prompt of a 135M model; a copy that size is not free on a busy host).
    shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    for b, payload in zip(block_ids, payloads):
        view = memoryview(payload)
        if view.readonly:  # (torch.frombuffer wants writable memory; a disk read already is)
            view = memoryview(bytearray(view))
        data = torch.frombuffer(view, dtype=torch.uint8).view(kv_cache.dtype).view(shape)
        kv_cache[:, :, b].copy_(data)
