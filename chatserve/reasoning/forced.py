"""A one-token allow-list per step: the tokens a sequence must write next, whatever its model says.

Used to close a reasoning block whose budget is spent (the end marker's tokens, llama-server's
``--reasoning-budget``). It is a grammar matcher in shape, so the sampler masks it like any other
constrained row (one allowed token: the row's argmax and its sample are that token), the output
processor checks each token through ``accept`` and speculative drafts walk and roll back through
it, all per row: the other rows of the batch never see it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BITS = 32


class ForcedTokens:
    """Allows exactly ``token_ids[i]`` at step i, then is ``done`` (the caller swaps it out)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("ForcedTokens needs at least one token")
        self.token_ids = list(token_ids)
        self.num_accepted = 0

    @property
    def done(self) -> bool:
        return self.num_accepted >= len(self.token_ids)

    @property
    def next_token(self) -> int | None:
        return None if self.done else self.token_ids[self.num_accepted]

    def accept(self, token_id: int) -> bool:
        if token_id != self.next_token:
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_accepted} accepted")
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        # NOTE: never: the forced tokens end a part of the output (the reasoning), not the output.
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Only the next forced token's bit set in ``bitmask[row]`` (every bit once all are written:
        the caller swaps this matcher out before then)."""
        token = self.next_token
        if token is None:
            bitmask[row].fill_(-1)
            return
        bitmask[row].zero_()
        bit = token % _BITS
        # int32 words: bit 31 is the sign bit
        bitmask[row, token // _BITS] = -(2**31) if bit == _BITS - 1 else 1 << bit
