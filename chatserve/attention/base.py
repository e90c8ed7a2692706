"""The attention-backend interface: what every backend prepares once per step and runs per layer.

A backend is chosen once per engine (`chatserve.attention.select_attention_backend`) and owned by
the model runner. Each step, the runner describes the batch as a `BatchLayout` (plain lists: who
decodes, who extends, over which blocks); the backend turns that into its own metadata once
(`prepare`), and every layer then calls `forward` with it. Nothing about kernels lives on the
batch or in the model: a new backend is one new module here plus one line in the selector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BatchLayout:
    """One step's sequences as the attention sees them. Decodes come first (one new token each at
    `decode_positions[i]`), then extends (prefill chunks: `extend_lens[j]` new tokens starting at
    `extend_start_positions[j]`, the length of the sequence's already computed prefix)."""

    decode_positions: list[int]
    decode_block_tables: list[list[int]]
    extend_start_positions: list[int]
    extend_lens: list[int]
    extend_block_tables: list[list[int]]
    block_size: int

    @property
    def num_decodes(self) -> int:
        return len(self.decode_positions)

    @property
    def num_extends(self) -> int:
        return len(self.extend_lens)

    def extend_offsets(self) -> list[int]:
        """Start of each extend's tokens among the extend tokens, plus the total at the end."""
        offsets = [0]
        for n in self.extend_lens:
            offsets.append(offsets[-1] + n)
        return offsets


def slots_of(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a sequence with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Pad with each table's own first block: padding then reads finite, written data."""
    width = max(1, max(len(t) for t in tables))
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int64, device=device)


class AttentionBackend(ABC):
    """Stores each layer's new K/V in the paged cache and attends the batch's queries over it."""

    name: str
    # whether forward takes a layer's window and soft-cap (the Triton kernels do not yet)
    supports_sliding_window: bool = True

    @abstractmethod
    def prepare(self, layout: BatchLayout, device: torch.device) -> Any:
        """This backend's metadata for one step, built once and shared by every layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D], decodes' tokens first
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], one layer's
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] where each new token's K/V goes
        metadata: Any,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Store k/v at `slot_mapping`, then return the attention output [T, H, D].

        window > 0: this layer's sliding window (a row at pos sees keys pos - window + 1 .. pos, as
        transformers masks it); softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2).
        Both are per layer: one step's metadata serves windowed and global layers alike."""
