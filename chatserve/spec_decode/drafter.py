"""What every drafter offers the proposer: guesses of a sequence's next tokens, and a hook to forget it.

A drafter only guesses; correctness never depends on it (a wrong draft is rejected by the
verification, a missing one just means a plain decode step). A draft model later is one more file
with this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    def propose(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses of what follows ``token_ids`` (prompt + output so far);
        ``[]`` when there is nothing worth verifying. Called once per step per decoding sequence,
        with ``token_ids`` grown by what was accepted since."""
        ...

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The sequence has ended (or was aborted): drop its state (a drafter that learns from
        finished outputs records them here)."""
        ...
