"""One response from start to end: its engine request, its typed events, its stored record.

`ResponseRun.events()` is the whole life of a response as OpenAI's event sequence
(`response.created`, `response.in_progress`, the output item events, then `response.completed`,
`response.incomplete` or `response.failed`), whoever consumes it: the SSE of a foreground stream,
a collector for a JSON body, or the run registry (streams/runs.py) that appends it to the event log of a
background response. The stored record follows along: written when the run starts (queued or
in_progress, so a GET or a cancel from any replica sees it), and once more at the end with the
exact token ids of the conversation, *before* the final event goes out, so a client that chains
on `response.completed` at once finds them.

Statuses: `queued` (background, until the engine produced its first token), `in_progress`,
`completed`, `incomplete` (`max_output_tokens`: the reply hit its budget or the context's end),
`cancelled` (the cancel endpoint, or a foreground client that left), `failed` (the engine failed,
the request's grammar failed, or a detached run's lease expired with no reader).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from chatserve.engine.async_engine import EngineDeadError
from chatserve.server.chat.choices import Usage
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.responses.events import OutputBuilder, Sequencer
from chatserve.server.responses.protocol import ResponsesRequest
from chatserve.sessions import SessionStoreError
from chatserve.sessions.response_store import ResponseStore

logger = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "incomplete", "cancelled", "failed"})
_CANCELLED_BY = frozenset({"cancel_endpoint", "client_disconnect"})


def usage_object(usage: Usage) -> dict[str, Any]:
    """The Responses `usage`: input/output tokens (the reasoning's among them, as OpenAI counts them), and
    how many input tokens the prefix cache served."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                 "cache_write_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0)},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseRun:
    def __init__(self, gen: Generation, body: ResponsesRequest, plan: ToolPlan | None, *, response_id: str,
                 model: str, prompt_ids: list[int], input_items: list[dict[str, Any]],
                 store: ResponseStore | None, instructions: str | None,
                 seal: Callable[[str], str] | None = None) -> None:
        """`seal`: the server's sealing of reasoning text, when the request includes `reasoning.encrypted_content`."""
        self.gen = gen
        self.body = body
        self.id = response_id
        self.model = model
        self.prompt_ids = prompt_ids
        self.input_items = input_items
        self.store = store if body.store else None
        self.instructions = instructions
        self.created_at = int(time.time())
        self.builder = OutputBuilder(plan, seal)
        self.seq = Sequencer()
        self.status = "queued" if body.background else "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: int | None = None
        self.final: dict[str, Any] | None = None  # the response object once the run ended
        self._token_ids: list[int] = []

    # ---- the response object ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": b.background, "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": self.incomplete, "instructions": self.instructions,
            "max_output_tokens": b.max_output_tokens, "max_tool_calls": None, "model": self.model,
            "output": [dict(item) for item in self.builder.output] if self.status in TERMINAL else [],
            "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
            "reasoning": _reasoning(b), "service_tier": "default", "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature, "text": b.text_config(),
            "tool_choice": _tool_choice(b), "tools": [t.model_dump(exclude_none=False) for t in b.tools or []],
            "top_logprobs": 0, "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": b.truncation,
            "usage": usage_object(self.gen.usage) if self.status in TERMINAL else None,
            "user": b.user, "safety_identifier": b.safety_identifier, "prompt_cache_key": b.prompt_cache_key,
            "metadata": dict(b.metadata or {}),
        }

    async def save_start(self) -> None:
        """The first write: the response as queued / in_progress and its input items (a store
        failure here is the request's 503: nothing has run yet)."""
        if self.store is not None:
            await self.store.put(self.snapshot(), self.input_items, [])

    async def _save(self, final: bool) -> None:
        if self.store is None:
            return
        try:
            await self.store.put(self.snapshot(), None, self._token_ids if final else None)
        except SessionStoreError as exc:
            # The reply still reaches its reader; only a later GET / previous_response_id misses it.
            logger.warning("response %s: could not store its %s state: %s", self.id, self.status, exc)

    # ---- the run -----------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event of the response, numbered; ends after the final one whatever happens."""
        yield self.seq.number({"type": "response.created", "response": self.snapshot()})
        if self.body.background:
            yield self.seq.number({"type": "response.queued", "response": self.snapshot()})
        else:
            yield self.seq.number({"type": "response.in_progress", "response": self.snapshot()})
        finish_reason: str | None = None
        try:
            async for deltas in self.gen.deltas():
                for d in deltas:
                    if self.status == "queued":
                        self.status = "in_progress"
                        await self._save(final=False)
                        yield self.seq.number({"type": "response.in_progress", "response": self.snapshot()})
                    self._token_ids.extend(d.token_ids)
                    for event in self.builder.feed(d.text, d.reasoning):
                        yield self.seq.number(event)
                    if d.finish_reason:
                        finish_reason = d.finish_reason
                        if d.finish_reason == "error":
                            self.error = {"code": "server_error", "message": f"generation failed: {d.error or 'unknown'}"}
        except EngineDeadError as exc:
            finish_reason = "error"
            self.error = {"code": "server_error", "message": str(exc)}
        finally:
            if not self.gen.finished:  # the consumer left (a foreground stream's client): abort it
                self.gen.close("client_disconnect")
        for event in self.builder.finish("incomplete" if finish_reason == "length" else "completed"):
            yield self.seq.number(event)
        self._settle(finish_reason)
        await self._save(final=True)
        self.final = self.snapshot()
        # (OpenAI's SDK has no "response.cancelled" event: a cancelled reply is partial, so
        # response.incomplete carries it, with status "cancelled" in its response object)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.status, "response.incomplete")
        yield self.seq.number({"type": kind, "response": self.final})

    async def abandoned(self) -> None:
        """The consumer left mid-run (a foreground client's disconnect closed `events()` at a yield):
        record the partial reply as cancelled once the engine request settled."""
        if self.final is not None:
            return
        if not self.gen.finished:
            self.gen.close("client_disconnect")
        for _ in range(500):  # the abort is settled within a step or two
            if self.gen.finished:
                break
            await asyncio.sleep(0.01)
        self.builder.finish("incomplete")
        self._settle("abort")
        await self._save(final=True)
        self.final = self.snapshot()

    def _settle(self, finish_reason: str | None) -> None:
        self.completed_at = int(time.time())
        self._token_ids = self.prompt_ids + self._token_ids
        if self.error is not None:
            self.status = "failed"
        elif finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        elif finish_reason == "stop" and self.gen.record.abort_reason is None:
            self.status = "completed"
        else:
            reason = self.gen.record.abort_reason or "unknown"
            if reason in _CANCELLED_BY:
                self.status = "cancelled"
            else:
                self.status = "failed"
                self.error = {"code": "server_error", "message": f"the run was stopped ({reason})"}


def _reasoning(body: ResponsesRequest) -> dict[str, Any]:
    """The response object's `reasoning`: the effort and summary as asked (no summary is written)."""
    r = body.reasoning
    if r is None:
        return {"effort": None, "summary": None}
    return {"effort": r.effort, "summary": r.summary or r.generate_summary}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.name}
