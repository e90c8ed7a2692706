"""The pure-torch attention backend (the CPU path and the ground truth), with cascade attention.

Sequences whose block tables start with the same physical blocks (a shared system prompt served
from the prefix cache) attend to that shared prefix as one group: its K/V are read once for the
whole group, and each member's own suffix is merged in by log-sum-exp.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from chatserve.attention.base import AttentionBackend, BatchLayout, pad_tables, slots_of
from chatserve.kernels.reference import (
    cascade_decode_attention,
    cascade_extend_attention,
    paged_decode_attention,
    paged_extend_attention,
    paged_masked_attention,
    store_kv_cache,
)

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
class TorchAttentionMetadata:
    num_decodes: int
    num_extends: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_plain_rows: torch.Tensor | None = None  # decodes not in a group; None = all of them
    decode_block_tables: torch.Tensor | None = None  # [Bp, max_blocks] of the plain decodes
    decode_context_lens: torch.Tensor | None = None  # [Bp]
    decode_max_len: int = 0  # longest context among the plain decodes
    decode_mask: torch.Tensor | None = None  # [Bp, 1, 1, L] or None when lengths are equal
    extend_groups: list[ExtendGroup] = field(default_factory=list)
    extend_plain_rows: torch.Tensor | None = None  # extend tokens of sequences not in a group; None = all
    extend_block_tables: torch.Tensor | None = None  # [Ep, max_blocks] of the plain extends
    extend_query_start_loc: torch.Tensor | None = None  # [Ep + 1] offsets within the plain extend tokens
    extend_seq_lens: torch.Tensor | None = None  # [Ep] prefix + new tokens
    layout: BatchLayout | None = None  # the step as given: sliding-window and soft-capped layers read it


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


class TorchAttentionBackend(AttentionBackend):
    """Reference ops over the paged cache; cascade groups for shared cached prefixes."""

    name = "torch"

    def __init__(self, min_cascade_blocks: int = MIN_CASCADE_BLOCKS) -> None:
        self.min_cascade_blocks = min_cascade_blocks

    # The C++ subclass attends plain decodes in place and needs no padding mask.
    needs_decode_mask = True

    def prepare(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        bs = layout.block_size
        meta = TorchAttentionMetadata(layout.num_decodes, layout.num_extends, layout=layout)
        if layout.num_decodes:
            tables = layout.decode_block_tables
            context = [p + 1 for p in layout.decode_positions]
            grouped: set[int] = set()
            caps = [(c - 1) // bs for c in context]
            for members, shared in find_shared_prefixes(tables, caps, self.min_cascade_blocks):
                prefix_len = shared * bs
                suffixes = [slots_of(tables[i], prefix_len, context[i], bs) for i in members]
                width = max(len(s) for s in suffixes)
                mask = None
                if any(len(s) != width for s in suffixes):
                    mask = tensor([[1] * len(s) + [0] * (width - len(s)) for s in suffixes]).bool().view(len(members), 1, 1, width)
                padded = [s + [s[0]] * (width - len(s)) for s in suffixes]  # pad with a written slot
                meta.decode_groups.append(DecodeGroup(
                    rows=tensor(members),
                    prefix_slots=tensor(slots_of(tables[members[0]], 0, prefix_len, bs)),
                    suffix_slots=tensor(padded),
                    suffix_mask=mask,
                ))
                grouped.update(members)
            plain = [i for i in range(layout.num_decodes) if i not in grouped]
            if grouped:
                meta.decode_plain_rows = tensor(plain)
            if plain:
                ctx = [context[i] for i in plain]
                meta.decode_block_tables = pad_tables([tables[i] for i in plain], device)
                meta.decode_context_lens = tensor(ctx)
                meta.decode_max_len = max(ctx)
                if self.needs_decode_mask and len(plain) > 1 and min(ctx) != meta.decode_max_len:
                    valid = torch.arange(meta.decode_max_len, device=device).unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)
                    meta.decode_mask = valid.view(len(plain), 1, 1, meta.decode_max_len)
        if layout.num_extends:
            tables = layout.extend_block_tables
            starts, lens = layout.extend_start_positions, layout.extend_lens
            offsets = layout.extend_offsets()
            grouped = set()
            caps = [start // bs for start in starts]
            for members, shared in find_shared_prefixes(tables, caps, self.min_cascade_blocks):
                prefix_len = shared * bs
                rows: list[int] = []
                for i in members:
                    rows.extend(range(offsets[i], offsets[i + 1]))
                meta.extend_groups.append(ExtendGroup(
                    token_rows=tensor(rows),
                    prefix_slots=tensor(slots_of(tables[members[0]], 0, prefix_len, bs)),
                    query_lens=[lens[i] for i in members],
                    suffix_slots=[tensor(slots_of(tables[i], prefix_len, starts[i] + lens[i], bs)) for i in members],
                ))
                grouped.update(members)
            plain = [i for i in range(layout.num_extends) if i not in grouped]
            if grouped:
                rows = []
                for i in plain:
                    rows.extend(range(offsets[i], offsets[i + 1]))
                meta.extend_plain_rows = tensor(rows)
            if plain:
                qsl = [0]
                for i in plain:
                    qsl.append(qsl[-1] + lens[i])
                meta.extend_block_tables = pad_tables([tables[i] for i in plain], device)
                meta.extend_query_start_loc = tensor(qsl)
                meta.extend_seq_lens = tensor([starts[i] + lens[i] for i in plain])
        return meta

    # ---- per layer -------------------------------------------------------------------------------
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def plain_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
            max_len=meta.decode_max_len, mask=meta.decode_mask,
        )

    def forward(self, q, k, v, k_cache, v_cache, slot_mapping, metadata: TorchAttentionMetadata, scale,
                window: int = 0, softcap: float = 0.0):
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)
        if window > 0 or softcap > 0:  # explicit scores (SDPA has no soft-cap), no cascade groups
            return self._masked(q, k_cache, v_cache, metadata, scale, window, softcap)
        nd = metadata.num_decodes
        if metadata.num_extends == 0:
            return self._decode(q, k_cache, v_cache, metadata, scale)
        if nd == 0:
            return self._extend(q, k_cache, v_cache, metadata, scale)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, metadata, scale)
        out[nd:] = self._extend(q[nd:], k_cache, v_cache, metadata, scale)
        return out

    @staticmethod
    def _masked(q, k_cache, v_cache, meta: TorchAttentionMetadata, scale: float, window: int, softcap: float) -> torch.Tensor:
        layout = meta.layout
        assert layout is not None
        lens = [1] * layout.num_decodes + layout.extend_lens
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return paged_masked_attention(q, k_cache, v_cache, layout.decode_block_tables + layout.extend_block_tables, starts,
                                      layout.decode_positions + layout.extend_start_positions, scale,
                                      window=window, softcap=softcap)

    def _decode(self, q, k_cache, v_cache, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        if not meta.decode_groups:
            return self.plain_decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            out[g.rows] = cascade_decode_attention(q[g.rows], k_cache, v_cache, g.prefix_slots, g.suffix_slots, g.suffix_mask, scale)
        if meta.decode_plain_rows is not None and meta.decode_plain_rows.numel():
            out[meta.decode_plain_rows] = self.plain_decode(q[meta.decode_plain_rows], k_cache, v_cache, meta, scale)
        return out

    def _extend(self, q, k_cache, v_cache, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        def plain(qp: torch.Tensor) -> torch.Tensor:
            return paged_extend_attention(
                qp, k_cache, v_cache, meta.extend_block_tables, meta.extend_query_start_loc, meta.extend_seq_lens, scale
            )

        if not meta.extend_groups:
            return plain(q)
        out = torch.empty_like(q)
        for g in meta.extend_groups:
            out[g.token_rows] = cascade_extend_attention(
                q[g.token_rows], k_cache, v_cache, g.prefix_slots, g.query_lens, g.suffix_slots, scale
            )
        if meta.extend_plain_rows is not None and meta.extend_plain_rows.numel():
            out[meta.extend_plain_rows] = plain(q[meta.extend_plain_rows])
        return out
