"""One sequence's position in its grammar.

Why a wrapper: the engine and the sampler should not know xgrammar's API, and the engine needs
two facts per step only: did the grammar take the sampled token, and has it ended (and, for
speculative decoding, a rollback of drafts walked through it).

Preemption by recompute keeps a sequence's output tokens (only their KV is recomputed, and no
token is sampled until the recompute reaches the end), so the matcher is never rewound or
advanced twice: it always stands after the last output token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where used: xgrammar (its C++ library, tvm_ffi, tiktoken) is ~20 MiB
    import xgrammar as xgr  # of resident memory that an engine serving no grammar never needs


class SequenceMatcher:
    """A GrammarMatcher over one compiled grammar; each of a request's n sequences has its own."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar cannot take it (the matcher is unchanged)."""
        ok = bool(self._matcher.accept_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts: a speculative draft walked through the grammar
        (to cut drafts at the first token it rejects, and to mask each verified row) is undone."""
        if num_tokens <= 0:
            return
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_accepted} accepted")
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the sequence is complete."""
        return bool(self._matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The output so far is a full match (a stop token may come next, or more text)."""
        return bool(self._matcher.is_completed())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (1 bit per token, 1 = allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
