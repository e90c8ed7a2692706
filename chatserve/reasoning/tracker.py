"""One sequence's reasoning as the engine runs it: the split, the token counts, the budget, the grammar gate.

The output processor calls :meth:`ReasoningTracker.after_token` for every token it appends (after
the detokenizer took it) and :meth:`sync` when it builds an output; the tracker feeds the new text
to its :class:`~chatserve.reasoning.splitter.ReasoningSplitter` and says, through
:meth:`grammar_now`, which matcher masks the sequence's next token:

- inside the reasoning: none (the model thinks freely; a request's grammar waits, not advanced);
- the budget spent: :class:`~chatserve.reasoning.forced.ForcedTokens` over the end marker's tokens;
- after the end marker: the request's own grammar (structured outputs, forced tool calls), if any;
  when the prompt opened no reasoning block, that grammar is on from the first token
  (:attr:`ReasoningTracker.grammar_from_start`).

Everything is per sequence, so a request gives the same tokens alone or batched.
"""

from __future__ import annotations

from typing import Any

from chatserve.reasoning.config import ReasoningConfig
from chatserve.reasoning.forced import ForcedTokens
from chatserve.reasoning.splitter import Phase, ReasoningSplitter


class ReasoningTracker:
    """See the module docstring. ``end_token_ids``: the end marker as the tokenizer writes it (what is
    forced when the budget is spent)."""

    def __init__(self, config: ReasoningConfig, end_token_ids: list[int]) -> None:
        if not end_token_ids:
            raise ValueError(f"reasoning: the end marker {config.spec.end!r} tokenizes to no tokens")
        self.config = config
        self.end_token_ids = list(end_token_ids)
        self.splitter = ReasoningSplitter(config.spec, starts_in_reasoning=config.starts_in_reasoning)
        self.num_reasoning_tokens = 0  # tokens of the reasoning, its markers included
        self.in_answer = False  # token-level: the end marker has been written (or no reasoning opened)
        self.answer_grammar: Any = None  # the request's own grammar (structured.SequenceMatcher), if any
        self.forced: ForcedTokens | None = None
        self.sent_reasoning_len = 0  # reasoning text already in a delta output
        self._fed_len = 0  # detokenizer text already fed to the splitter
        self._start_tokens = 0  # tokens read while the start was undecided (they count if it opens)
        self._check_budget()

    @classmethod
    def for_request(cls, config: ReasoningConfig, tokenizer: Any) -> ReasoningTracker:
        return cls(config, list(tokenizer.encode(config.spec.end, add_special_tokens=False)))

    # ---- what masks the next token ------------------------------------------
    def grammar_now(self) -> Any:
        """The matcher for the sequence's next token (``Sequence.grammar``), or None."""
        if self.forced is not None:
            return self.forced
        if self.in_answer or self.grammar_from_start:
            return self.answer_grammar
        return None

    @property
    def grammar_from_start(self) -> bool:
        """A prompt that opened no reasoning block leaves the request's grammar on from the first token,
        over the whole output: whether the model opens a block is not known before its first tokens, and
        a token cannot be taken back once sampled. The grammar then decides the shape (a regex may write
        the block itself); no end marker is forced against it."""
        return not self.config.starts_in_reasoning and self.answer_grammar is not None

    def with_answer_grammar(self, grammar: Any) -> Any:
        """Hold the request's compiled grammar until the answer starts; returns ``grammar_now()``."""
        self.answer_grammar = grammar
        return self.grammar_now()

    # ---- tokens and text ----------------------------------------------------
    def after_token(self, text: str) -> None:
        """One token was appended; ``text`` is the detokenizer's text now. Counts it, moves the phase,
        and starts forcing the end marker when the budget is spent."""
        before = self.splitter.phase
        self.sync(text)
        if self.forced is not None:
            self.num_reasoning_tokens += 1
            if self.forced.done:
                self.forced = None
                self.in_answer = True
        elif before is Phase.START:
            self._start_tokens += 1
            if self.splitter.phase is Phase.REASONING or self.splitter.reasoning_ended:
                self.num_reasoning_tokens = self._start_tokens
            elif self.splitter.phase is Phase.ANSWER:
                self.in_answer = True
        elif before is Phase.REASONING:
            self.num_reasoning_tokens += 1
        if self.splitter.reasoning_ended:
            self.in_answer = True
        self._check_budget()

    def sync(self, text: str, *, finished: bool = False) -> None:
        """Feed the text the detokenizer added since the last call; ``finished``: the output is complete."""
        if self.splitter.finished:
            return
        new = text[self._fed_len :]
        self._fed_len = len(text)
        self.splitter.feed(new)
        if finished:
            self.splitter.finish()

    def _check_budget(self) -> None:
        budget = self.config.budget_tokens
        if budget is None or self.forced is not None or self.in_answer or self.grammar_from_start:
            return
        if self.splitter.phase is Phase.REASONING and self.num_reasoning_tokens >= budget:
            self.forced = ForcedTokens(self.end_token_ids)

    # ---- what the user sees ---------------------------------------------------
    @property
    def reasoning(self) -> str:
        return self.splitter.reasoning

    @property
    def answer(self) -> str:
        return self.splitter.answer

    def reasoning_delta(self) -> str:
        """The reasoning text not yet sent in a delta output (and mark it sent)."""
        text = self.splitter.reasoning
        delta = text[self.sent_reasoning_len :]
        self.sent_reasoning_len = len(text)
        return delta
