"""Reasoning models for tests: a chat template with Qwen3's thinking behaviour, replies in the
reasoning-then-answer shape, and engines that write them with exact text.

* :func:`qwen3_thinking_template`: ChatML as Qwen3's template writes it, with its thinking rules:
  the generation prompt opens ``<think>\\n`` when thinking is on (as Qwen3-Thinking's does) and
  writes an empty closed block ``<think>\\n\\n</think>\\n\\n`` with ``enable_thinking=False``;
  an assistant message's ``reasoning_content`` is rendered for turns after the last user message
  and dropped for earlier turns (so a multi-turn prompt diverges from the cached one there).
* :func:`reasoning_reply`: the text a model writes (``[<think>\\n]reasoning\\n</think>\\n\\nanswer``).
* :func:`scripted_reasoning_engine`: the real engine over the scripted worker saying that reply.
* :data:`THINK_REGEX`: a grammar that forces a random model into the shape, for engine tests on a
  real forward pass (the split is then checked against the regex's own groups).
"""

from __future__ import annotations

import re
from typing import Any

from chatserve.reasoning import REASONING_PARSERS

from .fake_runner import scripted_engine

# <think>, a lower-case reasoning, </think>, a blank line, a capitalised answer: what a grammar forces.
THINK_REGEX = r"<think>\n[a-z ]{1,40}\n</think>\n\n[A-Z][a-z ]{1,20}"
THINK_SHAPE = re.compile(r"<think>\n(?P<reasoning>[a-z ]{1,40})\n</think>\n\n(?P<answer>[A-Z][a-z ]{1,20})", re.S)

_QWEN3_THINKING_TEMPLATE = """\
{%- set ns2 = namespace(found=false, last_query=0) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}{%- set ns2.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- if message.role == 'assistant' -%}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content else '' -%}
    {%- if loop.index0 > ns2.last_query and reasoning -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}
{{- message.content.lstrip('\\n') + '<|im_end|>\\n' -}}
    {%- else -%}
{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- else -%}
{{- '<think>\\n' -}}
  {%- endif -%}
{%- endif -%}
"""


def qwen3_thinking_template() -> str:
    """The chat template described in the module docstring (Jinja, as a tokenizer's ``chat_template``)."""
    return _QWEN3_THINKING_TEMPLATE


def reasoning_reply(reasoning: str, answer: str, *, parser: str = "qwen3", opens: bool = False) -> str:
    """What a reasoning model writes: ``opens`` (the prompt did not open the block) starts with the
    opening marker; then ``reasoning``, the end marker and a blank line, then ``answer``."""
    spec = REASONING_PARSERS[parser]
    head = f"{spec.start}\n" if opens else ""
    return f"{head}{reasoning}\n{spec.end}\n\n{answer}"


def scripted_reasoning_engine(
    tokenizer: Any, *, reasoning: str = "the user greets me so i greet back", answer: str = "Hello there, friend.",
    parser: str = "qwen3", opens: bool = False, **kwargs: Any,
) -> Any:
    """An `LLMEngine` over the scripted worker whose every reply is ``reasoning_reply(...)`` (see there):
    the real output processor splits it, the real sampler path forces a spent budget's end marker."""
    return scripted_engine(tokenizer, reply=reasoning_reply(reasoning, answer, parser=parser, opens=opens), **kwargs)
