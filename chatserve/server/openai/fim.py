"""A completion's `suffix`: fill-in-the-middle prompts for models whose vocabulary has FIM tokens.

The prompt becomes prefix-suffix-middle (PSM, the order StarCoder, Qwen2.5-Coder and DeepSeek-Coder
were trained on): ``<prefix token> prompt <suffix token> suffix <middle token>``, and the model
writes what goes between. A model without such tokens cannot do it, so a `suffix` there is a 400
naming the model rather than a prompt the model would read as plain text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatserve.server.errors import bad_request


@dataclass(frozen=True)
class FIMTokens:
    """The ids of a model's three fill-in-the-middle markers."""

    prefix: int
    suffix: int
    middle: int

    def prompt(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]


# the marker spellings of the families that have them (prefix, suffix, middle)
FIM_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Granite code
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_tokens(tokenizer: Any) -> FIMTokens | None:
    """The tokenizer's FIM markers, the first family whose three markers are all in its vocabulary."""
    vocab = tokenizer.get_vocab()
    for spelling in FIM_SPELLINGS:
        if all(marker in vocab for marker in spelling):
            return FIMTokens(*(vocab[marker] for marker in spelling))
    return None


def fim_prompt(tokenizer: Any, model_name: str, prompt: str | list[int], suffix: str) -> list[int]:
    """The fill-in-the-middle prompt for `prompt` (text or token ids) and `suffix`; a 400 naming
    `suffix` and the model when the model has no FIM tokens."""
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        raise bad_request(f"suffix needs a model with fill-in-the-middle tokens; {model_name} has none "
                          f"(none of {', '.join(s[0] for s in FIM_SPELLINGS)} in its vocabulary)", param="suffix")
    prefix_ids = prompt if isinstance(prompt, list) else list(tokenizer.encode(prompt, add_special_tokens=False))
    return tokens.prompt(prefix_ids, list(tokenizer.encode(suffix, add_special_tokens=False)))
