"""Token ids of one new user turn appended to a session's exact token history.

Re-rendering the whole conversation through the chat template can give other tokens than the
ones the model saw (and then the prefix cache misses). So the history is kept as token ids and
only the *new* part is rendered: what closes the previous assistant message plus the new user
turn and the generation prompt, found by rendering a sentinel conversation and cutting it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chatserve.engine.input_processor import InputProcessor

_SENTINEL = "\x1fCHATSERVE_SENTINEL\x1f"


def first_turn_ids(input_processor: InputProcessor, system_prompt: str | None, content: str) -> list[int]:
    """No history yet: the whole conversation through the template (PromptError names `content`)."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": content}
    ]
    return input_processor.render_chat(messages, add_generation_prompt=True, param="content")


def next_turn_ids(tokenizer: Any, history: list[int], content: str, eos_token_ids: Collection[int]) -> list[int]:
    """history (prompt + reply of the last turn, exactly as generated) + the new user turn."""
    return continue_history(tokenizer, history, [{"role": "user", "content": content}], eos_token_ids)


def continue_history(tokenizer: Any, history: list[int], messages: list[dict[str, Any]], eos_token_ids: Collection[int],
                     *, chat_template: str | None = None, **template_kwargs: Any) -> list[int]:
    """history (exactly as generated) + `messages` (a user turn, tool results, ...) and the generation
    prompt, rendered through `chat_template` (None: the model's) with `template_kwargs` (e.g. tools)."""
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template(before, add_generation_prompt=False, tokenize=False,
                                             chat_template=chat_template, **template_kwargs)
    extended = tokenizer.apply_chat_template(before + messages, add_generation_prompt=True, tokenize=False,
                                             chat_template=chat_template, **template_kwargs)
    if _SENTINEL not in rendered or not extended.startswith(rendered):
        # A template that rewrites earlier turns: fall back to rendering the new turn on its own.
        close, new_turn = "", extended[extended.rfind(_SENTINEL) + len(_SENTINEL):]
    else:
        close = rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]
        new_turn = extended[len(rendered):]
    if history and history[-1] in eos_token_ids:
        # The reply ended with the end-of-turn token itself: only what follows it is missing.
        eos_text = tokenizer.decode([history[-1]], skip_special_tokens=False)
        if close.startswith(eos_text):
            close = close[len(eos_text):]
    return list(history) + list(tokenizer.encode(close + new_turn, add_special_tokens=False))
