"""Chat replies that may hold tool calls: `message.tool_calls` in a body, `delta.tool_calls` in a stream.

`ToolChatFormat` is a `ChatFormat` whose text goes through a `ToolCallStreamParser` per choice:
text that cannot be part of a call streams as `delta.content` at once; a possible opening
`<tool_call>` is held back until it is known; a call streams as OpenAI and vLLM stream one: a chunk
with its `index`, `id`, `type` and `function.name` (arguments "") as soon as its name is known, then
`function.arguments` chunks (`index` only) as its arguments are generated, which concatenate to the
body's `arguments`. A choice that called tools (each call whole) and stopped finishes with
"tool_calls"; one cut by max_tokens inside a call finishes with "length", its partial call (name,
arguments as generated) in `tool_calls` as vLLM sends a named tool choice, never the call's markup
as text. A chat `echo` opens the content as `ChatFormat` sends it (in a body, before the text around the
calls, or alone where the reply is calls only, as vLLM). The accumulated raw text (what a session stores)
is untouched; only its presentation changes.
Reasoning (the engine's reasoning parser split it off; `text` is the answer alone) is sent as
`ChatFormat` sends it, and calls are read from the answer only.
"""

from __future__ import annotations

from typing import Any

from chatserve.server.chat.choices import Accumulator, ChoiceDelta
from chatserve.server.chat.chunks import ChatFormat, chat_logprobs
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.tools import ToolCallStreamParser, parse_tool_calls
from chatserve.tools.parser import ArgumentsDelta, CallStart, StreamEvent, TextEvent


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """"tool_calls" for a reply that stopped having called tools (`called`: at least one call, each whole;
    a call a stop string cut short keeps "stop")."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ToolChatFormat(ChatFormat):
    def __init__(self, cid: str, created: int, model: str, top_logprobs: int, plan: ToolPlan, *,
                 reasoning: bool = False) -> None:
        super().__init__(cid, created, model, top_logprobs, reasoning=reasoning)
        self.plan = plan
        self._parsers: dict[int, ToolCallStreamParser] = {}

    def _parser(self, index: int) -> ToolCallStreamParser:
        if index not in self._parsers:
            self._parsers[index] = self.plan.parser()
        return self._parsers[index]

    def delta_choices(self, d: ChoiceDelta) -> list[dict[str, Any]]:
        parser = self._parser(d.index)
        events = parser.feed(d.text) if d.text else []
        if d.finish_reason:
            events += parser.finish(truncated=d.finish_reason == "length")
        out = self._event_choices(d.index, events)
        out[:0] = self.reasoning_choices(d)  # (the parser reads the answer only: reasoning is never a call)
        if d.logprobs and d.token_ids:  # logprobs ride on a content chunk (empty while text is held back)
            first = next((i for i, c in enumerate(out) if "reasoning" not in c["delta"]), len(out))
            if first < len(out) and "content" in out[first]["delta"]:
                out[first]["logprobs"] = chat_logprobs(d, self.top_logprobs, self.token_ids_as_text)
            else:
                out.insert(first, {"index": d.index, "delta": {"content": ""},
                               "logprobs": chat_logprobs(d, self.top_logprobs, self.token_ids_as_text), "finish_reason": None})
        if d.finish_reason:
            out.append({"index": d.index, "delta": {}, "logprobs": None,
                        "finish_reason": tool_finish_reason(d.finish_reason, parser.called)})
        return out

    @staticmethod
    def _event_choices(index: int, events: list[StreamEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, TextEvent):
                out.append({"index": index, "delta": {"content": e.text}, "logprobs": None, "finish_reason": None})
            elif isinstance(e, CallStart):
                opening = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
                out.append({"index": index, "delta": {"tool_calls": [opening]}, "logprobs": None, "finish_reason": None})
            elif isinstance(e, ArgumentsDelta):
                arguments = {"index": e.index, "function": {"arguments": e.text}}
                out.append({"index": index, "delta": {"tool_calls": [arguments]}, "logprobs": None, "finish_reason": None})
        return out  # (a CallEnd sends nothing: OpenAI's stream has no end-of-call chunk)

    def whole_choice(self, acc: Accumulator, index: int) -> dict[str, Any]:
        choice = super().whole_choice(acc, index)
        c = acc.choices[index]
        parsed = parse_tool_calls(c.content, self.plan.format, self.plan.callable_schemas(),
                                  truncated=c.finish_reason == "length")
        if parsed.tool_calls:
            # vLLM's echo goes before the content, even the null content of a reply that is calls alone
            choice["message"]["content"] = self.echo + (parsed.content or "") if self.echo else parsed.content
            choice["message"]["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            choice["finish_reason"] = tool_finish_reason(c.finish_reason, all(call.complete for call in parsed.tool_calls))
        return choice
