"""What one model forward pass needs to know about the batch, built once per step.

Sequences are ordered decodes first, then extends (prefill chunks, possibly over a cached
prefix). The batch holds the flat token data every layer shares and the attention backend's own
metadata (`attn`), prepared once here; the model reads it and writes nothing into it.

It lives below both its writer (worker/model_runner.py) and its reader (models/), as vLLM's
forward context does: a model imports what it reads, never the worker that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chatserve.attention.base import AttentionBackend, BatchLayout, slots_of


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all new tokens packed, decodes first
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    logits_indices: torch.Tensor  # [S] rows of the hidden states that need logits
    num_decodes: int
    num_extends: int
    attn: Any  # the attention backend's metadata for this step

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(
    *,
    decode_tokens: list[int],
    decode_positions: list[int],
    decode_block_tables: list[list[int]],
    extend_tokens: list[list[int]],
    extend_start_positions: list[int],
    extend_block_tables: list[list[int]],
    extend_need_logits: list[bool],
    block_size: int,
    device: torch.device,
    backend: AttentionBackend | None = None,
    extend_num_logits: list[int] | None = None,
) -> ForwardBatch:
    """Pack decodes and prefill chunks into flat tensors and let `backend` (default: the torch
    reference) prepare its metadata.

    Decode sequence i has one new token at `decode_positions[i]`; extend sequence j computes
    `extend_tokens[j]` starting at position `extend_start_positions[j]` (its cached prefix length).
    `extend_num_logits[j]` (when given, instead of `extend_need_logits`) is how many of its last rows
    need logits: a speculative verification needs one per draft plus one.
    """
    if backend is None:
        from chatserve.attention.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend()
    input_ids: list[int] = list(decode_tokens)
    positions: list[int] = list(decode_positions)
    slots: list[int] = [table[p // block_size] * block_size + p % block_size for table, p in zip(decode_block_tables, decode_positions)]
    logits_rows: list[int] = list(range(len(decode_tokens)))
    offset = len(decode_tokens)
    num_logits = extend_num_logits if extend_num_logits is not None else [int(need) for need in extend_need_logits]
    for tokens, start, table, rows in zip(extend_tokens, extend_start_positions, extend_block_tables, num_logits):
        n = len(tokens)
        if not 0 <= rows <= n:
            raise ValueError(f"an extend of {n} tokens cannot need {rows} rows of logits")
        input_ids.extend(tokens)
        positions.extend(range(start, start + n))
        slots.extend(slots_of(table, start, start + n, block_size))
        offset += n
        logits_rows.extend(range(offset - rows, offset))
    layout = BatchLayout(
        decode_positions=list(decode_positions),
        decode_block_tables=list(decode_block_tables),
        extend_start_positions=list(extend_start_positions),
        extend_lens=[len(t) for t in extend_tokens],
        extend_block_tables=list(extend_block_tables),
        block_size=block_size,
    )

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        logits_indices=tensor(logits_rows),
        num_decodes=len(decode_tokens),
        num_extends=len(extend_tokens),
        attn=backend.prepare(layout, device),
    )
