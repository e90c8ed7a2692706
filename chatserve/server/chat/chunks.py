"""OpenAI's response and chunk objects, built from `ChoiceDelta`s. Exactly their field names.

Chat and text completions share one skeleton (`ReplyFormat`): the same envelope (`id`, `object`,
`created`, `model`, `system_fingerprint`, `choices`, `usage`) around choices that differ only in
shape. A subclass says what opens a stream, which choices one delta becomes, and what one choice
of the whole reply looks like; `replies` and the routes drive either one the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from chatserve.outputs import Logprob
from chatserve.server.chat.choices import Accumulator, ChoiceDelta, ChoiceState, Usage


# ---- logprobs ------------------------------------------------------------------------------------
def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked[:n]


def _token_text(lp: Logprob, token_id: int | None = None) -> str:
    """A logprob's token as text; with `token_id` (vLLM's return_tokens_as_token_ids) ``token_id:N``."""
    if token_id is not None:
        return f"token_id:{token_id}"
    return lp.decoded_token if lp.decoded_token is not None else ""


def chat_logprobs(delta: ChoiceDelta, top_n: int, as_ids: bool = False) -> dict[str, Any] | None:
    """The chat shape: one entry per token, each with its bytes and its top alternatives (`as_ids`:
    tokens spelled ``token_id:N``)."""
    if delta.logprobs is None:
        return None
    content = []
    for tid, entry in zip(delta.token_ids, delta.logprobs):
        chosen = entry[tid]
        text = _token_text(chosen, tid if as_ids else None)
        content.append({
            "token": text,
            "logprob": chosen.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := _token_text(lp, other if as_ids else None)), "logprob": lp.logprob,
                 "bytes": list(t.encode("utf-8"))}
                for other, lp in _top(entry, top_n)
            ],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(delta: ChoiceDelta, top_n: int, offset: int, as_ids: bool = False) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists; text_offset counts from `offset` (`as_ids`: tokens
    spelled ``token_id:N``, offsets still those of the text)."""
    if delta.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, entry in zip(delta.token_ids, delta.logprobs):
        chosen = entry[tid]
        text = _token_text(chosen)
        tokens.append(_token_text(chosen, tid) if as_ids else text)
        token_lps.append(chosen.logprob)
        tops.append({_token_text(lp, other if as_ids else None): lp.logprob for other, lp in _top(entry, top_n)}
                    if top_n else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ---- the skeleton --------------------------------------------------------------------------------
def prompt_logprobs_json(entries: list[dict[int, Logprob] | None], as_ids: bool = False) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token_id: {logprob, rank, decoded_token}}."""
    return [None if e is None else {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": _token_text(lp, t if as_ids else None)}
        for t, lp in e.items()} for e in entries]


class ReplyFormat(ABC):
    """The envelope shared by chat and completions; subclasses fill in the choices.

    One instance per HTTP request (a completions stream keeps per-choice text offsets).
    """

    CHUNK_OBJECT: ClassVar[str]
    REPLY_OBJECT: ClassVar[str]
    # vLLM's return_tokens_as_token_ids: logprobs' tokens spelled "token_id:N" (set by the route)
    token_ids_as_text: bool = False

    def __init__(self, cid: str, created: int, model: str, top_logprobs: int) -> None:
        self.cid = cid
        self.created = created
        self.model = model
        self.top_logprobs = top_logprobs
        # vLLM's prompt_logprobs asked for (set by the route): the generation's prompt index -> entries (filled
        # as outputs arrive), and how many choices each prompt has; None: not asked, no key in the reply
        self.prompt_logprobs: dict[int, Any] | None = None
        self.choices_per_prompt = 1
        self._prompt_logprobs_sent: set[int] = set()

    def prompt_logprobs_of(self, choice: int) -> list[dict[str, Any] | None] | None:
        """Choice ``choice``'s prompt's prompt logprobs in vLLM's JSON (None until known)."""
        entries = None if self.prompt_logprobs is None else self.prompt_logprobs.get(choice // self.choices_per_prompt)
        return None if entries is None else prompt_logprobs_json(entries, self.token_ids_as_text)

    def unsent_prompt_logprobs(self, key: int) -> list[dict[str, Any] | None] | None:
        """A stream's prompt logprobs for ``key`` (a choice, or 0 for chat's one prompt) the first time they
        are known, then None: vLLM streams them once."""
        if self.prompt_logprobs is None or key in self._prompt_logprobs_sent:
            return None
        value = self.prompt_logprobs_of(key)
        if value is not None:
            self._prompt_logprobs_sent.add(key)
        return value

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.cid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]], include_usage: bool, usage: Usage | None = None) -> dict[str, Any]:
        """One streamed chunk. With include_usage every chunk has `usage` (null until the last one)."""
        obj = self.with_top_level(self._envelope(self.CHUNK_OBJECT, choices), streaming=True) if choices \
            else self._envelope(self.CHUNK_OBJECT, choices)
        if include_usage:
            obj["usage"] = usage.as_dict() if usage is not None else None
        return obj

    def reply(self, acc: Accumulator, usage: Usage) -> dict[str, Any]:
        """The non-streaming body: every choice whole, and the usage."""
        obj = self._envelope(self.REPLY_OBJECT, [self.whole_choice(acc, i) for i in range(len(acc.choices))])
        obj["usage"] = usage.as_dict()
        return self.with_top_level(obj, streaming=False)

    def with_top_level(self, obj: dict[str, Any], *, streaming: bool) -> dict[str, Any]:
        """Fields of the whole object besides the choices (chat's prompt_logprobs)."""
        return obj

    @abstractmethod
    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices sent before any output (one chunk each)."""

    @abstractmethod
    def delta_choices(self, d: ChoiceDelta) -> list[dict[str, Any]]:
        """The choices one delta becomes (one chunk each; none for a delta with nothing to show)."""

    @abstractmethod
    def whole_choice(self, acc: Accumulator, index: int) -> dict[str, Any]:
        """Choice `index` of the non-streaming body."""


class ChatFormat(ReplyFormat):
    """`chat.completion(.chunk)`: a role delta opens each choice; the finish reason is its own chunk.

    `reasoning`: the request was parsed for reasoning (a reasoning parser and a `ReasoningConfig`).
    Its reasoning is sent under both names clients read, `reasoning` (vLLM's now) and
    `reasoning_content` (vLLM's before PR #33402, DeepSeek's, what llama_index, dify and LiteLLM
    read): `delta.reasoning` + `delta.reasoning_content` in a stream, `message.reasoning` +
    `message.reasoning_content` in a body (null when the reply had none). Never in `content`.
    """

    CHUNK_OBJECT = "chat.completion.chunk"
    REPLY_OBJECT = "chat.completion"
    # vLLM's chat echo: text every choice's content starts with (sent after the role delta; set by the route)
    echo: str = ""

    def __init__(self, cid: str, created: int, model: str, top_logprobs: int, *, reasoning: bool = False) -> None:
        super().__init__(cid, created, model, top_logprobs)
        self.reasoning = reasoning

    def with_top_level(self, obj: dict[str, Any], *, streaming: bool) -> dict[str, Any]:
        """vLLM's chat puts prompt_logprobs on the object (one prompt): the body, or the first chunk after
        they are known."""
        if self.prompt_logprobs is not None:
            value = self.unsent_prompt_logprobs(0) if streaming else self.prompt_logprobs_of(0)
            if value is not None or not streaming:
                obj["prompt_logprobs"] = value
        return obj

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(num_choices)]
        if self.echo:
            opening += [{"index": i, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}
                        for i in range(num_choices)]
        return opening

    @staticmethod
    def reasoning_choices(d: ChoiceDelta) -> list[dict[str, Any]]:
        """The chunk a delta's new reasoning is (none without any), before its answer's."""
        if not d.reasoning:
            return []
        return [{"index": d.index, "delta": reasoning_fields(d.reasoning), "logprobs": None, "finish_reason": None}]

    def delta_choices(self, d: ChoiceDelta) -> list[dict[str, Any]]:
        out = self.reasoning_choices(d)
        if d.text or (d.logprobs and d.token_ids):
            out.append({"index": d.index, "delta": {"content": d.text},
                        "logprobs": chat_logprobs(d, self.top_logprobs, self.token_ids_as_text), "finish_reason": None})
        if d.finish_reason:
            out.append({"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason})
        return out

    def whole_choice(self, acc: Accumulator, index: int) -> dict[str, Any]:
        c: ChoiceState = acc.choices[index]
        message: dict[str, Any] = {"role": "assistant", "content": self.echo + c.content, "refusal": None}
        if self.reasoning:
            message.update(reasoning_fields(c.reasoning_text))
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(acc.merged_delta(index), self.top_logprobs, self.token_ids_as_text)
            if c.has_logprobs else None,
            "finish_reason": c.finish_reason,
        }


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """Reasoning under both of its names (see `ChatFormat`)."""
    return {"reasoning": text, "reasoning_content": text}


class CompletionFormat(ReplyFormat):
    """`text_completion`: an echoed prompt opens its choice; text and finish reason share a chunk.

    `echo[i]` is the prompt text choice i repeats before its completion ("" without echo); the
    logprobs' text offsets count from its end.
    """

    CHUNK_OBJECT = "text_completion"
    REPLY_OBJECT = "text_completion"

    def __init__(self, cid: str, created: int, model: str, top_logprobs: int, echo: list[str]) -> None:
        super().__init__(cid, created, model, top_logprobs)
        self.echo = echo
        self._offsets = [len(e) for e in echo]

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        return [{"index": i, "text": e, "logprobs": None, "finish_reason": None} for i, e in enumerate(self.echo) if e]

    def delta_choices(self, d: ChoiceDelta) -> list[dict[str, Any]]:
        if not (d.text or (d.logprobs and d.token_ids) or d.finish_reason):
            return []
        lp = completion_logprobs(d, self.top_logprobs, self._offsets[d.index], self.token_ids_as_text) if d.logprobs is not None else None
        self._offsets[d.index] += len(d.text)
        choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        if self.prompt_logprobs is not None:
            prompt_lps = self.unsent_prompt_logprobs(d.index)
            if prompt_lps is not None:  # vLLM: on the choice's first chunk
                choice["prompt_logprobs"] = prompt_lps
        return [choice]

    def whole_choice(self, acc: Accumulator, index: int) -> dict[str, Any]:
        c = acc.choices[index]
        echo = self.echo[index]
        return {
            "index": index, "text": echo + c.content,
            "logprobs": completion_logprobs(acc.merged_delta(index), self.top_logprobs, len(echo), self.token_ids_as_text)
            if c.has_logprobs else None,
            "finish_reason": c.finish_reason,
            **({} if self.prompt_logprobs is None else {"prompt_logprobs": self.prompt_logprobs_of(index)}),
        }
