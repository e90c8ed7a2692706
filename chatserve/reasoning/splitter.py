"""Reasoning and answer split apart as text arrives, never leaking a marker into either.

The splitter reads the text a sequence's detokenizer emits, in whatever pieces it comes, and keeps
two texts: the reasoning (between the markers) and the answer (after the end marker). Its result
depends only on the concatenated text, never on how it was chunked: a marker split across tokens
(``</th`` + ``ink>``) is held back until it either completes or turns out to be text, the way the
detokenizer holds back a possible stop string.

Shape of the output it expects (the templates' and models' own)::

    [<think>] \\n reasoning \\n </think> \\n\\n answer

The opening marker is recognised only at the very start (after leading whitespace); a prompt that
already ends in it starts the splitter inside the reasoning. The newlines just inside the markers
and the blank lines after the end marker are layout, not content: they are dropped (as vLLM and
llama-server do), so ``reasoning`` and ``text`` read as the model meant them. With no end marker
before the output ends, everything after the opening marker is reasoning.
"""

from __future__ import annotations

import enum

from chatserve.reasoning.specs import ReasoningParserSpec


class Phase(enum.Enum):
    START = "start"  # nothing decided: the text so far may still be the opening marker
    REASONING = "reasoning"
    ANSWER = "answer"


def _partial_marker_len(text: str, marker: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of ``marker`` (it may complete later)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Feed it text (``feed``), read ``reasoning`` / ``answer`` (final text only), ``finish`` at the end.

    ``phase`` is where the text stands now; ``reasoning_ended`` turns True with the text that
    completes the end marker (the engine then starts the answer's grammar).
    """

    def __init__(self, spec: ReasoningParserSpec, *, starts_in_reasoning: bool) -> None:
        self.spec = spec
        self.phase = Phase.REASONING if starts_in_reasoning else Phase.START
        self.reasoning = ""
        self.answer = ""
        self.reasoning_ended = False
        self._held = ""  # text not yet assigned: a possible marker, or newlines that may be layout
        self._strip_leading = starts_in_reasoning  # drop the newlines that follow a marker
        self._finished = False

    def feed(self, text: str) -> None:
        """Take the next piece of the output text."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not text:
            return
        self._held += text
        self._advance(final=False)

    def finish(self) -> None:
        """The output ended: whatever is held is final (reasoning if no end marker came). Idempotent."""
        if self._finished:
            return
        self._advance(final=True)
        self._finished = True

    @property
    def finished(self) -> bool:
        return self._finished

    def _advance(self, *, final: bool) -> None:
        # Each phase consumes what it can and hands the rest on; a loop, since one piece of text
        # may open the reasoning, close it and start the answer at once.
        while True:
            if self.phase is Phase.START and not self._advance_start(final):
                return
            if self.phase is Phase.REASONING and not self._advance_reasoning(final):
                return
            if self.phase is Phase.ANSWER:
                self._advance_answer(final)
                return

    def _advance_start(self, final: bool) -> bool:
        """True when the phase moved on (to reasoning or answer) and the rest is to be read there."""
        start = self.spec.start
        body = self._held.lstrip()
        if body.startswith(start):
            self._held = body[len(start) :]
            self.phase = Phase.REASONING
            self._strip_leading = True
            return True
        if not final and start.startswith(body):
            return False  # empty, or a prefix of the opening marker: wait for more text
        self.phase = Phase.ANSWER  # no reasoning block: all of it is the answer, leading spaces and all
        self._strip_leading = False
        return True

    def _advance_reasoning(self, final: bool) -> bool:
        held = self._held
        if self._strip_leading:
            held = held.lstrip("\n")
            if not held and not final:
                self._held = ""
                return False
            self._strip_leading = False
        end = self.spec.end
        at = held.find(end)
        if at != -1:
            self.reasoning += held[:at].rstrip("\n")
            self._held = held[at + len(end) :]
            self.phase = Phase.ANSWER
            self.reasoning_ended = True
            self._strip_leading = True
            return True
        if final:
            self.reasoning += held
            self._held = ""
            return False
        # Hold a possible start of the end marker, and the newlines before it (layout if it closes).
        keep = _partial_marker_len(held, end)
        body = held[: len(held) - keep]
        newlines = len(body) - len(body.rstrip("\n"))
        keep += newlines
        self.reasoning += held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        return False

    def _advance_answer(self, final: bool) -> None:
        held = self._held
        if self._strip_leading:
            held = held.lstrip("\n")
            if not held and not final:
                self._held = ""
                return
            self._strip_leading = False
        self.answer += held
        self._held = ""
