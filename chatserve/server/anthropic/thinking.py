"""Extended thinking on the Messages API: the request's controls, and the thinking blocks a client sends back.

Controls -> the pipeline's `ReasoningRequest` (chatserve/server/pipeline.py), in the budget table's
terms (chatserve/reasoning/budget.py): `thinking.budget_tokens` wins over `output_config.effort`;
`thinking: {"type": "disabled"}` renders the template with `enable_thinking` off (Qwen3's switch), and
with no `thinking` at all the model thinks as its template has it by default. On a server with no
reasoning parser these fields change nothing (Claude Code sends `thinking` and an effort on every
request, whatever the model).

Blocks sent back: a `thinking` block renders as its assistant turn's `reasoning_content` only with a
signature this server made (`ReasoningSigner.sign` of exactly its text), or, for a block produced
with `display: "omitted"` (empty text), a signature that seals the text (`ReasoningSigner.seal`);
anything else is a 400 naming `messages.N.content.M.signature`. `redacted_thinking` blocks are
Anthropic's encrypted reasoning, which no server but Anthropic's can read: accepted (a conversation
that began there can go on here) and left out of the prompt.
"""

from __future__ import annotations

from typing import Any

from chatserve.reasoning.signature import SEALED_PREFIX, ReasoningSignatureError, ReasoningSigner
from chatserve.server.anthropic.protocol import MessageParam, MessagesBase, ThinkingBlock
from chatserve.server.errors import bad_request
from chatserve.server.pipeline import ReasoningRequest


def reasoning_request(body: MessagesBase, reasoning_parser: str | None) -> ReasoningRequest:
    """What the request asks of the model's thinking (nothing on a model without a parser)."""
    if reasoning_parser is None:
        return ReasoningRequest(api="messages")
    thinking = body.thinking
    effort = body.output_config.effort if body.output_config is not None else None
    if thinking is not None and thinking.type == "disabled":
        return ReasoningRequest(enable_thinking=False, api="messages", param="thinking")
    if thinking is not None and thinking.budget_tokens is not None:
        return ReasoningRequest(budget_tokens=thinking.budget_tokens, api="messages", param="thinking.budget_tokens")
    return ReasoningRequest(effort=effort, api="messages", param="output_config.effort")


def template_kwargs(body: MessagesBase) -> dict[str, Any]:
    """Variables for the chat template: `enable_thinking=False` for `thinking: {"type": "disabled"}`."""
    if body.thinking is not None and body.thinking.type == "disabled":
        return {"enable_thinking": False}
    return {}


def thinking_text(block: ThinkingBlock, where: str, signer: ReasoningSigner) -> str:
    """The reasoning a block sent back carries, checked against its signature (a 400 naming it otherwise)."""
    param = f"{where}.signature"
    if block.signature.startswith(SEALED_PREFIX):  # a block sent with display "omitted": the text is sealed
        try:
            text = signer.unseal(block.signature)
        except ReasoningSignatureError as exc:
            raise bad_request(f"invalid signature in thinking block: {exc}", param=param,
                              code="invalid_signature") from None
        if block.thinking not in ("", text):
            raise bad_request("invalid signature in thinking block: the thinking text was edited", param=param,
                              code="invalid_signature")
        return text
    if not signer.verify(block.signature, block.thinking):
        raise bad_request("invalid signature in thinking block: this server did not produce this thinking (it was "
                          "edited, or came from another server; replicas must share --reasoning-signing-key)",
                          param=param, code="invalid_signature")
    return block.thinking


def with_verified_thinking(body: MessagesBase, signer: ReasoningSigner) -> MessagesBase:
    """`body` with every thinking block's signature checked and its text the reasoning it carries
    (filled in for an omitted block), so that rendering can trust what it reads."""
    messages: list[MessageParam] | None = None
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            continue
        blocks = list(m.content)
        changed = False
        for j, b in enumerate(blocks):
            if isinstance(b, ThinkingBlock):
                text = thinking_text(b, f"messages.{i}.content.{j}", signer)
                if text != b.thinking:
                    blocks[j] = b.model_copy(update={"thinking": text})
                    changed = True
        if changed:
            messages = messages if messages is not None else list(body.messages)
            messages[i] = m.model_copy(update={"content": blocks})
    return body if messages is None else body.model_copy(update={"messages": messages})
