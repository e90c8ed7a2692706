"""Prompt lookup: the tail of the sequence matched against its earlier tokens (vLLM's ``ngram``).

When the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred
earlier in the prompt or the output, the tokens that followed that occurrence are the draft. That
is what copying looks like: a code edit repeating a file, tool arguments quoting the user, JSON
repeating its keys.

Why an index and not a scan: each sequence keeps a map from every n-gram to where it last
continued, extended by the few tokens added since the previous step, so a step costs O(new tokens
x n) instead of a scan of the whole context (a 2,000-token prompt scanned every step costs more
than the matmuls of a 135M model's token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _NgramIndex:
    upto: int = 0  # n-grams ending before this position are indexed
    continues_at: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where its latest occurrence continues


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[int, _NgramIndex] = {}

    def _index(self, seq_id: int, token_ids: Sequence[int]) -> _NgramIndex:
        index = self._indexes.setdefault(seq_id, _NgramIndex())
        table = index.continues_at
        last = len(token_ids) - 1  # an n-gram ending here has no continuation yet
        for end in range(index.upto, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table[tuple(token_ids[end - n + 1 : end + 1])] = end + 1
        index.upto = max(index.upto, last)
        return index

    def propose(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) < self.min_n + 1:
            return []
        table = self._index(seq_id, token_ids).continues_at
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = table.get(tuple(token_ids[length - n :]))
            if start is not None:
                return list(token_ids[start : start + max_tokens])
        return []

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(seq_id, None)
