"""One input path: chat template, tokenize, validate, once per request.

Every front end (the offline `LLM`, `AsyncLLMEngine.generate`, the HTTP routes) turns its
input into a `ProcessedPrompt` here, and `LLMEngine.add_request` trusts one it is handed. So
each rule that can refuse a prompt is written once, with one message, and checked once: the
caller hears it at the call, before any work, and nothing downstream re-validates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatserve.tools.rendering import ToolRendering, messages_for_format, tool_rendering_for

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt that passed every rule. Only `InputProcessor.process` should make one: the
    engine does not check it again (building one by hand means "already checked")."""

    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PromptError(ValueError):
    """A refused prompt. `param` names the request field to fix and `code` is OpenAI's error
    code (when there is one), so the server answers with them without re-deriving anything."""

    def __init__(self, message: str, *, param: str = "prompt", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def apply_chat_template(
    tokenizer: Any,
    conversation: Sequence[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    *,
    param: str = "messages",
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Render with the model's template, then tokenize without adding special tokens again.

    A free function because it needs only a tokenizer (tests and scripts render without an
    engine); `InputProcessor.render_chat` is the engine's door to it.
    """
    text = render_chat_template(tokenizer, conversation, add_generation_prompt, chat_template, param=param,
                                continue_final_message=continue_final_message, **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_template(
    tokenizer: Any,
    conversation: Sequence[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    *,
    param: str = "messages",
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """The conversation's text through the template (what `apply_chat_template` tokenizes).

    `continue_final_message`: the last message is an assistant reply to go on with (Anthropic's
    prefill, vLLM's `continue_final_message`): the conversation is rendered whole and cut right
    after that message's text, so whatever the template closes a turn with is not in the prompt.
    """
    for m in conversation:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise PromptError('each message must be a dict with "role" and "content"', param=param)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "this model has no chat template; pass chat_template=... or use generate() with a plain prompt", param=param
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in conversation], add_generation_prompt=add_generation_prompt and not continue_final_message,
            tokenize=False, chat_template=chat_template, **template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template that raises on this conversation (jinja error)
        raise PromptError(f"the chat template could not render these messages: {exc}", param=param) from exc
    if continue_final_message:
        text = _cut_after_final_message(text, conversation, param)
    return text


def _cut_after_final_message(text: str, conversation: Sequence[Message], param: str) -> str:
    final = conversation[-1] if conversation else None
    content = final.get("content") if final is not None else None
    if final is None or final.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise PromptError("continuing the final message needs a last assistant message with text", param=param)
    end = text.rfind(content)
    if end < 0:
        raise PromptError("the chat template does not render the final assistant message's text as sent, so it "
                          "cannot be continued", param=param)
    return text[:end + len(content)]


class InputProcessor:
    """Template + tokenize + validate for one engine: its tokenizer and its limits."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        max_model_len_note: str,
        num_kv_blocks: int,
        block_size: int,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy  # a request's priority is served under "priority" only
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_model_len_note = max_model_len_note  # why the limit is what it is, e.g. the KV pool
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self._tool_renderings: dict[tuple[str, str | None], ToolRendering] = {}

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        param: str = "messages",
        continue_final_message: bool = False,
        tool_parser: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """A conversation's token ids through the chat template; PromptError(param=param) if it cannot render.

        With `tools`, or tool calls / tool results in the conversation, the template is the one
        `tool_rendering` picks (the model's own if it renders tools, else the shipped one)."""
        text = self.render_chat_text(messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                     tools=tools, param=param, continue_final_message=continue_final_message,
                                     tool_parser=tool_parser, **template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat_text(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        param: str = "messages",
        continue_final_message: bool = False,
        tool_parser: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """What `render_chat` tokenizes: the conversation's text through the template it picks
        (with tools: `tool_rendering(chat_template, tool_parser)`'s)."""
        if tools or _has_tool_messages(messages):
            rendering = self.tool_rendering(chat_template, tool_parser)
            chat_template = rendering.chat_template
            messages = messages_for_format(messages, rendering.format)
            if tools:
                template_kwargs["tools"] = [dict(t) for t in tools]
        return render_chat_template(
            self.tokenizer, messages, add_generation_prompt, chat_template, param=param,
            continue_final_message=continue_final_message, **template_kwargs
        )

    def tool_rendering(self, chat_template: str | None = None, parser: str | None = None) -> ToolRendering:
        """The template and call format of requests with tools (chatserve.tools.rendering): `chat_template`'s
        own format (default: the model's template), or `parser`'s (--tool-call-parser). Found once per pair."""
        key = (chat_template or "", parser)
        found = self._tool_renderings.get(key)
        if found is None:
            found = tool_rendering_for(self.tokenizer, chat_template, parser)
            self._tool_renderings[key] = found
        return found

    def process(
        self, prompt: str | dict[str, Any] | ProcessedPrompt, *, max_tokens: int | None = None, param: str = "prompt",
        truncate_prompt_tokens: int | None = None,
    ) -> ProcessedPrompt:
        """Tokenize a str or {"prompt_token_ids": [...]} and check every rule; a ProcessedPrompt passes as is.

        max_tokens, when given, is the caller's explicit budget for the reply: a prompt that fits
        but leaves it no room is refused (param "max_tokens"). Without it, generation simply stops
        at max_model_len. truncate_prompt_tokens (vLLM's): keep only the prompt's last N tokens
        (-1: the model's context length less one, the room for a reply), before the checks; the
        text is then the kept tokens decoded. Raises PromptError (a ValueError) naming `param`.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, ids = self._tokenize(prompt, param)
        kept = self.truncate(ids, truncate_prompt_tokens)
        if len(kept) < len(ids):
            text, ids = self.tokenizer.decode(kept), kept
        self.check_length(len(ids), max_tokens, param=param)
        return ProcessedPrompt(text, ids)

    def truncate(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``ids`` (vLLM's left truncation; -1: the model's
        context length less one, so a reply still fits); None keeps them all."""
        if truncate_prompt_tokens is None:
            return ids
        keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep < 1:
            raise PromptError(f"truncate_prompt_tokens must be >= 1 or -1, got {truncate_prompt_tokens}",
                              param="truncate_prompt_tokens")
        return ids[-keep:] if len(ids) > keep else ids

    def check_params(self, params: Any) -> None:
        """What a request's SamplingParams can only be checked against with the engine: token ids within
        the vocabulary (logit_bias, allowed_token_ids: PromptError naming the field), a priority under a
        policy that does not serve it (vLLM refuses it too), and bad_words turned into token ids (filled
        into ``params.bad_words_token_ids``, vLLM's rule: each word as is and, where it tokenises to as
        many tokens, with a leading space)."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise PromptError(f"{name} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param=name)
        if params.priority != 0 and self.scheduling_policy != "priority":
            raise PromptError(f"priority {params.priority} needs the priority scheduling policy (the server runs "
                              f"{self.scheduling_policy!r}; start it with --scheduling-policy priority), or send "
                              "priority 0", param="priority")
        params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words or [])

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's token ids, then the same word after a space where that is another tokenisation
        of the same length (vLLM's update_from_tokenizer), so " word" mid-sentence is banned too."""
        out: list[list[int]] = []
        for word in words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (plain, spaced):
                if not ids or ids in out or (ids is spaced and len(spaced) != len(plain)):
                    continue
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise PromptError(f"bad_words: {word[:40]!r} tokenises to ids outside the vocabulary", param="bad_words")
                out.append(ids)
        return out

    def _tokenize(self, prompt: Any, param: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise PromptError("prompt_token_ids must be a list of ints", param=param)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(
                    f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param=param
                )
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None, list(ids)
        raise PromptError('prompt must be a string or {"prompt_token_ids": [...]}', param=param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None = None, *, param: str = "prompt") -> None:
        """The length rules alone, for a caller that holds only a count (OpenAI's wording, with the numbers)."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise PromptError("the prompt is empty", param=param)
        if num_prompt_tokens >= limit:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens{self.max_model_len_note}. However, your "
                f"prompt has {num_prompt_tokens} tokens, which leaves no room for a reply. Please shorten the prompt.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens{self.max_model_len_note}. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )
        # NOTE: the prompt plus the first sampled token must fit in the pool at once.
        needed = -(-(num_prompt_tokens + 1) // self.block_size)
        if needed > self.num_kv_blocks:
            raise PromptError(
                f"the prompt needs {needed} KV blocks but the pool has only {self.num_kv_blocks}; "
                "raise num_kv_blocks / kv_cache_memory_gb or shorten the prompt",
                param=param,
            )


def _has_tool_messages(messages: Sequence[Message]) -> bool:
    return any(isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


__all__ = ["InputProcessor", "ProcessedPrompt", "PromptError", "ToolRendering", "apply_chat_template"]
