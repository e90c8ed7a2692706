"""What one model forward pass needs to know about the batch, built once per step.

Sequences are ordered decodes first, then extends (prefill chunks, possibly
over a cached prefix). Tensors derived from the block tables (token slots,
padding masks, cascade groups, rotary cos/sin) are computed here once and
shared by every layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Sequences sharing at least this many cached blocks attend to them as one group.
MIN_CASCADE_BLOCKS = 4


@dataclass
class DecodeGroup:
    """Decode sequences sharing `prefix_slots`; each attends to its own suffix too."""

    rows: torch.Tensor  # [G] indices among the decode sequences
    prefix_slots: torch.Tensor  # [P]
    suffix_slots: torch.Tensor  # [G, Ls]
    suffix_mask: torch.Tensor | None  # [G, 1, 1, Ls] or None when all suffixes are Ls long


@dataclass
class ExtendGroup:
    """Prefill chunks whose cached prefixes share `prefix_slots`."""

    token_rows: torch.Tensor  # [Tg] indices among the extend tokens
    prefix_slots: torch.Tensor  # [P]
    query_lens: list[int]
    suffix_slots: list[torch.Tensor]  # per sequence, positions [P, seq_len)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all new tokens packed
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    logits_indices: torch.Tensor  # [S] rows of the hidden states that need logits
    # decode part: the first `num_decodes` tokens, one per sequence
    num_decodes: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_plain_rows: torch.Tensor | None = None  # decodes not in a group; None = all of them
    decode_block_tables: torch.Tensor | None = None  # [Bp, max_blocks] of the plain decodes
    decode_context_lens: torch.Tensor | None = None  # [Bp]
    decode_max_len: int = 0  # longest context among the plain decodes
    decode_mask: torch.Tensor | None = None  # [Bp, 1, 1, L] or None when lengths are equal
    # a compiled kernel for the plain decodes (reads the paged cache in place; no mask needed)
    decode_kernel: Callable[..., torch.Tensor] | None = None
    # a compiled kernel that writes the new K/V into the cache (the torch reference op otherwise)
    store_kv_kernel: Callable[..., None] | None = None
    # extend part: the remaining tokens
    num_extends: int = 0
    extend_groups: list[ExtendGroup] = field(default_factory=list)
    extend_plain_rows: torch.Tensor | None = None  # extend tokens of sequences not in a group; None = all
    extend_block_tables: torch.Tensor | None = None  # [Ep, max_blocks] of the plain extends
    extend_query_start_loc: torch.Tensor | None = None  # [Ep + 1] offsets within the plain extend tokens
    extend_seq_lens: torch.Tensor | None = None  # [Ep] prefix + new tokens
    extend_max_query_len: int = 0  # most new tokens of one plain extend (sizes the Triton grid, no sync)
    # "torch" (reference ops, cascade groups) or "triton" (paged kernels; no groups, no masks)
    attention_backend: str = "torch"
    # filled by the model once per forward
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Pad with each table's own first block: padding then reads finite, written data."""
    width = max(1, max(len(t) for t in tables))
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def find_shared_prefixes(tables: list[list[int]], max_blocks: list[int], min_blocks: int) -> list[tuple[list[int], int]]:
    """Group sequences whose block tables start with the same physical blocks.

    Returns (member indices, number of shared blocks) for groups of two or more
    sharing at least `min_blocks`; `max_blocks[i]` caps how many of sequence i's
    blocks may count (only blocks wholly before its new tokens).
    """
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, (table, cap) in enumerate(zip(tables, max_blocks)):
        if cap >= min_blocks:
            buckets[table[0]].append(i)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        limit = min(max_blocks[i] for i in members)
        first = tables[members[0]]
        shared = 0
        while shared < limit and all(tables[i][shared] == first[shared] for i in members):
            shared += 1
        if shared >= min_blocks:
            groups.append((members, shared))
    return groups


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
    min_cascade_blocks: int = MIN_CASCADE_BLOCKS,
    attention_backend: str = "torch",
    decode_kernel: Callable[..., torch.Tensor] | None = None,
    store_kv_kernel: Callable[..., None] | None = None,
) -> ForwardBatch:
    """Pack decodes and prefill chunks into flat tensors.

    Decode sequence i has one new token at `decode_positions[i]`; extend
    sequence j computes `extend_tokens[j]` starting at position
    `extend_start_positions[j]` (its cached prefix length).

    With ``attention_backend="triton"`` no cascade groups and no padding masks
    are built: the kernels read each sequence's blocks through its table.
    """
    triton = attention_backend == "triton"
    if triton:
        min_cascade_blocks = 1 << 62  # never group
    input_ids: list[int] = list(decode_tokens)
    positions: list[int] = list(decode_positions)
    slots: list[int] = [table[p // block_size] * block_size + p % block_size for table, p in zip(decode_block_tables, decode_positions)]
    logits_rows: list[int] = list(range(len(decode_tokens)))
    ext_offsets = [0]
    for tokens, start, table, need in zip(extend_tokens, extend_start_positions, extend_block_tables, extend_need_logits):
        n = len(tokens)
        input_ids.extend(tokens)
        positions.extend(range(start, start + n))
        slots.extend(_slots(table, start, start + n, block_size))
        if need:
            logits_rows.append(len(decode_tokens) + ext_offsets[-1] + n - 1)
        ext_offsets.append(ext_offsets[-1] + n)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    batch = ForwardBatch(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        logits_indices=tensor(logits_rows),
        num_decodes=len(decode_tokens),
        num_extends=len(extend_tokens),
        attention_backend=attention_backend,
        store_kv_kernel=None if triton else store_kv_kernel,
    )

    # ---- decodes ----
    if decode_tokens:
        context = [p + 1 for p in decode_positions]
        grouped: set[int] = set()
        caps = [(c - 1) // block_size for c in context]
        for members, shared in find_shared_prefixes(decode_block_tables, caps, min_cascade_blocks):
            prefix_len = shared * block_size
            suffixes = [_slots(decode_block_tables[i], prefix_len, context[i], block_size) for i in members]
            width = max(len(s) for s in suffixes)
            mask = None
            if any(len(s) != width for s in suffixes):
                mask = tensor([[1] * len(s) + [0] * (width - len(s)) for s in suffixes]).bool().view(len(members), 1, 1, width)
            padded = [s + [s[0]] * (width - len(s)) for s in suffixes]  # pad with a written slot
            batch.decode_groups.append(
                DecodeGroup(
                    rows=tensor(members),
                    prefix_slots=tensor(_slots(decode_block_tables[members[0]], 0, prefix_len, block_size)),
                    suffix_slots=tensor(padded),
                    suffix_mask=mask,
                )
            )
            grouped.update(members)
        plain = [i for i in range(len(decode_tokens)) if i not in grouped]
        if grouped:
            batch.decode_plain_rows = tensor(plain)
        if plain:
            tables = [decode_block_tables[i] for i in plain]
            ctx = [context[i] for i in plain]
            batch.decode_block_tables = _pad_tables(tables, device)
            batch.decode_context_lens = tensor(ctx)
            max_len = max(ctx)
            batch.decode_max_len = max_len
            batch.decode_kernel = None if triton else decode_kernel
            if not triton and decode_kernel is None and len(plain) > 1 and min(ctx) != max_len:
                valid = torch.arange(max_len, device=device).unsqueeze(0) < batch.decode_context_lens.unsqueeze(1)
                batch.decode_mask = valid.view(len(plain), 1, 1, max_len)

    # ---- extends ----
    if extend_tokens:
        grouped = set()
        caps = [start // block_size for start in extend_start_positions]
        for members, shared in find_shared_prefixes(extend_block_tables, caps, min_cascade_blocks):
            prefix_len = shared * block_size
            rows: list[int] = []
            for i in members:
                rows.extend(range(ext_offsets[i], ext_offsets[i + 1]))
            batch.extend_groups.append(
                ExtendGroup(
                    token_rows=tensor(rows),
                    prefix_slots=tensor(_slots(extend_block_tables[members[0]], 0, prefix_len, block_size)),
                    query_lens=[len(extend_tokens[i]) for i in members],
                    suffix_slots=[
                        tensor(_slots(extend_block_tables[i], prefix_len, extend_start_positions[i] + len(extend_tokens[i]), block_size))
                        for i in members
                    ],
                )
            )
            grouped.update(members)
        plain = [i for i in range(len(extend_tokens)) if i not in grouped]
        if grouped:
            rows = []
            for i in plain:
                rows.extend(range(ext_offsets[i], ext_offsets[i + 1]))
            batch.extend_plain_rows = tensor(rows)
        if plain:
            qsl = [0]
            for i in plain:
                qsl.append(qsl[-1] + len(extend_tokens[i]))
            batch.extend_block_tables = _pad_tables([extend_block_tables[i] for i in plain], device)
            batch.extend_query_start_loc = tensor(qsl)
            batch.extend_max_query_len = max(len(extend_tokens[i]) for i in plain)
            batch.extend_seq_lens = tensor([extend_start_positions[i] + len(extend_tokens[i]) for i in plain])
    return batch
