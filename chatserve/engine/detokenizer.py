"""Incremental detokenization: generated token ids in, UTF-8 safe, stop-string aware text deltas out.

Streaming wants text as soon as it is final, but two things make "decode the new token" wrong:

* Byte-level BPE (GPT-2 style, SmolLM2, Qwen, Llama 3) and SentencePiece byte fallback split one
  character (CJK, emoji) over several tokens. Decoding a partial character gives U+FFFD, and
  emitting it would put garbage into the client's text that no later delta can take back.
* Some tokenizers make a token's text depend on its left neighbour (SentencePiece strips the
  leading space of the first token of a decode), so a token decoded alone differs from the same
  token decoded in context.

The fix is the prefix-offset / read-offset technique: keep a small window of tokens whose text has
already been emitted (``ids[prefix_offset:read_offset]``), decode the window plus the new tokens,
and emit the difference. Both decodes start at the same token, so left-context effects cancel, and
each step costs O(window) rather than O(output length). While the decoded tail still ends in
U+FFFD the character may be incomplete, so that tail is held back and the window is not advanced.

On top of that, a stop-string filter holds back the longest suffix of the not-yet-emitted text
that could still grow into a stop string, so a stop string is never partly streamed before it is
recognised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# The replacement character a lossy UTF-8 decode yields for an incomplete or invalid byte sequence.
REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens of left context the first window starts with. A handful is enough for
# merges and leading-space rules; the exact value only affects cost, not the output.
INITIAL_PREFIX_TOKENS = 5


class Tokenizer(Protocol):
    """The one method the detokenizer needs; any Hugging Face tokenizer satisfies it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: object) -> str: ...


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one call to :meth:`IncrementalDetokenizer.add_tokens` produced.

    ``delta`` is text that is final and may be streamed now (possibly ""). ``stop_str`` is set when
    a stop string matched: generation must end, and ``delta`` already stops before the stop string
    (or just after it, with ``include_stop_str_in_output``); nothing after it is ever emitted.
    """

    delta: str
    stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


def _trailing_replacement_chars(text: str) -> int:
    """Length of the run of U+FFFD at the end of ``text``.

    The whole run is held back, not only its last character: SentencePiece byte fallback renders an
    undecodable group of byte tokens as one U+FFFD per byte, and the whole group can still turn into
    valid characters when the next byte token arrives.
    """
    n = len(text)
    i = n
    while i > 0 and text[i - 1] == REPLACEMENT_CHAR:
        i -= 1
    return n - i


def _stop_prefix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    That suffix must be withheld: the next tokens may complete the stop string, and then none of it
    may have been emitted. Cost is O(max_len**2) per call, independent of the output length.
    """
    for k in range(min(max_len - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, UTF-8 safe and stop-string aware.

    Contract: the concatenation of all deltas (``text``) equals
    ``decode(prompt + output)[len(decode(prompt)):]`` with ``clean_up_tokenization_spaces=False``;
    for byte-level BPE tokenizers that is simply ``tokenizer.decode(output_ids)``. For
    SentencePiece tokenizers the first output token keeps its leading space (the prompt is its left
    context), where a standalone ``decode(output_ids)`` would strip it. One known exception: when
    SentencePiece byte fallback meets invalid UTF-8, it renders the whole run of byte tokens as
    U+FFFD, rewriting characters that were valid (and streamed) a token earlier.

    Usage per request: call :meth:`add_tokens` once per engine step with the new token(s); stop
    when an update carries ``stop_str``; otherwise, when generation ends for another reason (EOS,
    length), call :meth:`flush` for the held-back rest.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty; drop the empty string from `stop`")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))  # dedupe, keep order
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop_str = include_stop_str_in_output

        # NOTE: invariant: decode(ids[prefix_offset:read_offset]) has exactly _prefix_len characters,
        # all of which, plus the next _emitted_past_read characters of decode(ids[prefix_offset:]),
        # have been handed to the stop filter. The window is only advanced when the decoded tail is
        # clean (no trailing U+FFFD), so the prefix text never ends inside a character.
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_PREFIX_TOKENS, 0)
        self._prefix_len = len(self._decode(self._prefix_offset, self._read_offset))
        self._emitted_past_read = 0

        self._num_prompt_tokens = len(self._ids)
        self._pending = ""  # stable text withheld because it may start a stop string
        self._deltas: list[str] = []
        self._text_cache: str | None = ""
        self._stop_str: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public API

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Append newly generated token(s) and return the text that became final."""
        if self._finished:
            raise RuntimeError(
                "add_tokens() after the detokenizer finished (stop string matched or flush() "
                "called); create a new IncrementalDetokenizer for a new generation"
            )
        self._ids.extend(token_ids)
        return self._filter_stop(self._take_stable_text(final=False), final=False)

    def flush(self) -> str:
        """Return the held-back rest at the end of generation (EOS, length limit, abort).

        Everything still withheld becomes final: text held as a possible stop-string prefix, and a
        trailing U+FFFD of an incomplete byte sequence, exactly as ``decode`` renders it (the only
        place a dangling replacement character can appear, matching a full decode of the output).
        If that rest completes a stop string, the text is cut there and :attr:`stop_str` is set.
        Idempotent: later calls return "".
        """
        if self._finished:
            return ""
        update = self._filter_stop(self._take_stable_text(final=True), final=True)
        self._finished = True
        return update.delta

    @property
    def text(self) -> str:
        """All text emitted so far: the output text of the request."""
        if self._text_cache is None:
            self._text_cache = "".join(self._deltas)
        return self._text_cache

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended generation, if one did."""
        return self._stop_str

    @property
    def finished(self) -> bool:
        """True after a stop string matched or :meth:`flush` was called."""
        return self._finished

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids seen so far (a copy)."""
        return self._ids[self._num_prompt_tokens :]

    # ------------------------------------------------------------------ internals

    def _decode(self, start: int, end: int | None = None) -> str:
        # NOTE: clean_up_tokenization_spaces is forced off: it rewrites " ." to "." and the like,
        # which depends on the right context and would make window diffs inconsistent.
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _take_stable_text(self, *, final: bool) -> str:
        """Decode the window and return the newly final characters, advancing the window if clean."""
        full = self._decode(self._prefix_offset)
        held = 0 if final else _trailing_replacement_chars(full)
        start = self._prefix_len + self._emitted_past_read
        stable_end = len(full) - held
        new_text = full[start:stable_end] if stable_end > start else ""
        if held:
            # The tail may still be an incomplete character: keep the window, remember how much of
            # it (the complete text before the tail) has been taken already.
            self._emitted_past_read += len(new_text)
        else:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_len = len(self._decode(self._prefix_offset, self._read_offset))
            self._emitted_past_read = 0
        return new_text

    def _filter_stop(self, new_text: str, *, final: bool) -> DetokenizerUpdate:
        """Pass stable text through the stop-string filter and record what is emitted."""
        if not self._stops:
            return self._emit(new_text, stop_str=None)
        pending = self._pending + new_text
        # The match that ends first wins (ties: the one starting first, i.e. the longer). That is
        # the stop string a one-token-at-a-time stream completes first, so the result does not
        # depend on how tokens are chunked into steps. Any new match lies wholly inside `pending`:
        # it ends in the new text, and the part before that was withheld as a stop-string prefix.
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            idx = pending.find(s)  # first occurrence, hence the earliest end for this string
            if idx != -1 and (best is None or (idx + len(s), idx) < best[:2]):
                best = (idx + len(s), idx, s)
        if best is not None:
            _, idx, s = best
            end = idx + len(s) if self._include_stop_str else idx
            self._pending = ""
            self._finished = True
            self._stop_str = s
            return self._emit(pending[:end], stop_str=s)
        hold = 0 if final else _stop_prefix_len(pending, self._stops, self._max_stop_len)
        self._pending = pending[len(pending) - hold :]
        return self._emit(pending[: len(pending) - hold], stop_str=None)

    def _emit(self, delta: str, *, stop_str: str | None) -> DetokenizerUpdate:
        if delta:
            self._deltas.append(delta)
            self._text_cache = None
        return DetokenizerUpdate(delta=delta, stop_str=stop_str)
