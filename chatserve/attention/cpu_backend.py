"""The CPU backends with the compiled C++ kernels (every kernel tier: AVX2 and up).

`CpuPagedAttentionBackend` runs every query row (prefill, a chunk over cached keys, decode) through
one C++ kernel (csrc/tier_attention.cpp, built per tier; bf16 or int8 caches) that walks the row's keys in 16-key tiles in order with an
online softmax: a row gets the same bits whatever else is in the step and wherever its keys come
from, so greedy output does not change with batching, the prefix cache or chunk sizes (issue 20).
It keeps K and V in the kernel's own layout inside each block (the tier's: K by dim, V by key, what
its dot-product instructions read with no transpose per step; int8 with each block's scales); the engine only ever copies and
zeroes whole blocks, so the layout is this backend's business alone.
Sequences whose block tables start with the same cached blocks (a shared system prompt) form one
group: the kernel reads each shared tile once for all of them (what cascade attention was for),
and because each row's own arithmetic is unchanged, grouping costs no bits.

`CpuKernelAttentionBackend` is the torch reference with the C++ K/V store, for shapes the paged
kernel does not take (head_dim not a multiple of 32, or above 256).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatserve.attention.base import AttentionBackend, BatchLayout, pad_tables
from chatserve.attention.torch_backend import MIN_CASCADE_BLOCKS, TorchAttentionBackend, find_shared_prefixes
from chatserve.kernels.cpu import CpuKernels


def paged_kernel_fits(head_dim: int) -> bool:
    """The C++ paged attention kernel's limit: head_dim a multiple of 32, at most 256 (any GQA ratio)."""
    return head_dim % 32 == 0 and head_dim <= 256


@dataclass(frozen=True)
class CpuAttentionMetadata:
    """One step's sequences for the kernel: decodes first, then extends, in batch row order."""

    block_tables: torch.Tensor  # [S, max_blocks] int64
    query_start: torch.Tensor  # [S + 1] each sequence's first row among the step's tokens
    start_pos: torch.Tensor  # [S] position of each sequence's first new token
    seq_order: torch.Tensor  # [S] sequences listed group by group
    group_start: torch.Tensor  # [G + 1] where each group begins in seq_order


def group_sequences(tables: list[list[int]], start_positions: list[int], block_size: int,
                    min_blocks: int = MIN_CASCADE_BLOCKS) -> list[list[int]]:
    """Sequences sharing at least `min_blocks` cached blocks (wholly before their new tokens) in
    one group each; every other sequence alone. Grouping only decides what is read together."""
    caps = [start // block_size for start in start_positions]
    groups: list[list[int]] = []
    grouped: set[int] = set()
    for members, _ in find_shared_prefixes(tables, caps, min_blocks):
        groups.append(sorted(members))
        grouped.update(members)
    groups.extend([i] for i in range(len(tables)) if i not in grouped)
    return groups


class CpuPagedAttentionBackend(AttentionBackend):
    name = "cpu"
    description = "C++ K/V store + C++ paged attention (prefill, extend, decode: one reduction order per row)"

    def __init__(self, kernels: CpuKernels, min_cascade_blocks: int = MIN_CASCADE_BLOCKS) -> None:
        self._store_kv = kernels.store_kv_paged
        self._attend = kernels.paged_attention
        self.min_cascade_blocks = min_cascade_blocks

    def prepare(self, layout: BatchLayout, device: torch.device) -> CpuAttentionMetadata:
        tables = layout.decode_block_tables + layout.extend_block_tables
        starts = layout.decode_positions + layout.extend_start_positions
        lens = [1] * layout.num_decodes + layout.extend_lens
        query_start = [0]
        for n in lens:
            query_start.append(query_start[-1] + n)
        groups = group_sequences(tables, starts, layout.block_size, self.min_cascade_blocks)
        group_start = [0]
        for g in groups:
            group_start.append(group_start[-1] + len(g))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return CpuAttentionMetadata(
            block_tables=pad_tables(tables, device) if tables else torch.zeros((0, 1), dtype=torch.int64, device=device),
            query_start=tensor(query_start),
            start_pos=tensor(starts),
            seq_order=tensor([i for g in groups for i in g]),
            group_start=tensor(group_start),
        )

    def forward(self, q, k, v, k_cache, v_cache, slot_mapping, metadata: CpuAttentionMetadata, scale,
                window: int = 0, softcap: float = 0.0):
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)
        m = metadata
        if window or softcap:  # the same kernel: a row walks only its window's tiles, soft-capped scores
            return self._attend(q, k_cache, v_cache, m.block_tables, m.query_start, m.start_pos, m.seq_order,
                                m.group_start, scale, window, softcap)
        return self._attend(q, k_cache, v_cache, m.block_tables, m.query_start, m.start_pos, m.seq_order,
                            m.group_start, scale)


class CpuKernelAttentionBackend(TorchAttentionBackend):
    """The torch reference with the C++ K/V store (for head sizes the paged kernel does not take)."""

    name = "cpu"
    description = "torch + C++ K/V store"

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self._store_kv_kernel = kernels.store_kv

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._store_kv_kernel(k, v, k_cache, v_cache, slot_mapping)
