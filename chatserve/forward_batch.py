"""What one model forward pass needs to know about the batch, built once per step.

Sequences are ordered decodes first, then extends (prefill chunks, possibly
over a cached prefix). Tensors derived from the block tables (token slots,
padding masks, rotary cos/sin) are computed here once and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all new tokens packed
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    logits_indices: torch.Tensor  # [S] rows of the hidden states that need logits
    # decode part: the first `num_decodes` tokens, one per sequence
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks]
    decode_context_lens: torch.Tensor | None  # [Bd]
    decode_token_slots: torch.Tensor | None  # [Bd, L]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool or None when Bd == 1
    # extend part: the remaining tokens
    num_extends: int
    extend_block_tables: torch.Tensor | None  # [Be, max_blocks]
    extend_query_start_loc: torch.Tensor | None  # [Be + 1], offsets within the extend tokens
    extend_seq_lens: torch.Tensor | None  # [Be] prefix + new tokens
    # filled by the model once per forward
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int64, device=device)


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
) -> ForwardBatch:
    """Pack decodes and prefill chunks into flat tensors.

    Decode sequence i has one new token at `decode_positions[i]`; extend
    sequence j computes `extend_tokens[j]` starting at position
    `extend_start_positions[j]` (its cached prefix length).
    """
    input_ids: list[int] = list(decode_tokens)
    positions: list[int] = list(decode_positions)
    slots: list[int] = [table[p // block_size] * block_size + p % block_size for table, p in zip(decode_block_tables, decode_positions)]
    logits_rows: list[int] = list(range(len(decode_tokens)))
    query_start = [0]
    seq_lens: list[int] = []
    for tokens, start, table, need in zip(extend_tokens, extend_start_positions, extend_block_tables, extend_need_logits):
        n = len(tokens)
        input_ids.extend(tokens)
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if need:
            logits_rows.append(len(decode_tokens) + query_start[-1] + n - 1)
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)

    num_decodes = len(decode_tokens)
    dec_tables = dec_lens = dec_slots = dec_mask = None
    if num_decodes:
        dec_tables = _pad_tables(decode_block_tables, device)
        context = [p + 1 for p in decode_positions]
        dec_lens = torch.tensor(context, dtype=torch.int64, device=device)
        max_len = max(context)
        offsets = torch.arange(block_size, dtype=torch.int64, device=device)
        dec_slots = (dec_tables.unsqueeze(-1) * block_size + offsets).reshape(num_decodes, -1)[:, :max_len]
        if num_decodes > 1 and min(context) != max_len:
            valid = torch.arange(max_len, device=device).unsqueeze(0) < dec_lens.unsqueeze(1)
            dec_mask = valid.view(num_decodes, 1, 1, max_len)
            # NOTE: padded positions read a slot the sequence has written (its first), never
            # unwritten pool memory, which may hold NaN bit patterns that survive masking.
            dec_slots = torch.where(valid, dec_slots, dec_slots[:, :1])
    ext_tables = ext_qsl = ext_lens = None
    if extend_tokens:
        ext_tables = _pad_tables(extend_block_tables, device)
        ext_qsl = torch.tensor(query_start, dtype=torch.int64, device=device)
        ext_lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        decode_block_tables=dec_tables,
        decode_context_lens=dec_lens,
        decode_token_slots=dec_slots,
        decode_mask=dec_mask,
        num_extends=len(extend_tokens),
        extend_block_tables=ext_tables,
        extend_query_start_loc=ext_qsl,
        extend_seq_lens=ext_lens,
    )
