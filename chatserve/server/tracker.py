"""Which HTTP request owns which engine requests, and the final state the cancel endpoint reports.

One public request id (the `X-Request-Id`) may run several engine requests (a completions call
with a list of prompts); cancel aborts all of them. Finished requests stay in a bounded history so
a late or repeated cancel is answered with the final state instead of a 404.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from chatserve.engine.async_engine import RequestMetrics


@dataclass(eq=False)
class TrackedRequest:
    id: str
    engine_ids: list[str]
    created: float = field(default_factory=time.time)
    # Why it ended early, if it did: "cancel_endpoint", "client_disconnect" (or "engine" by elimination).
    abort_reason: str | None = None
    finished: bool = False
    finish_reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    blocks_freed: int = 0
    aborted_in_state: str | None = None
    metrics: dict[str, RequestMetrics] = field(default_factory=dict)
    owner: Any = None  # the chat.generation.Generation running it, while live (the cancel endpoint calls it)

    @property
    def status(self) -> str:
        if not self.finished:
            return "running"
        return "aborted" if "abort" in self.finish_reasons else "finished"

    def absorb(self, engine_id: str, m: RequestMetrics) -> None:
        """Fold one engine request's final metrics in (idempotent per engine id)."""
        if engine_id in self.metrics:
            return
        self.metrics[engine_id] = m
        self.completion_tokens += m.num_generated_tokens
        self.cached_prompt_tokens += m.num_cached_tokens
        self.blocks_freed += m.blocks_freed
        if m.aborted_in_state and self.aborted_in_state is None:
            self.aborted_in_state = m.aborted_in_state
        self.finish_reasons.append(m.finish_reason)

    def final_state(self) -> dict[str, Any]:
        reasons = [r for r in self.finish_reasons if r]
        return {
            "id": self.id,
            "object": "request.state",
            "status": self.status,
            "finish_reason": ("abort" if "abort" in reasons else reasons[0]) if reasons else None,
            "state_when_cancelled": self.aborted_in_state,
            "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "blocks_freed": self.blocks_freed,
        }


class RequestTracker:
    def __init__(self, history: int = 4096) -> None:
        self.live: dict[str, TrackedRequest] = {}
        self._history: collections.OrderedDict[str, TrackedRequest] = collections.OrderedDict()
        self._history_len = history

    def start(self, request_id: str, engine_ids: list[str]) -> TrackedRequest:
        if request_id in self.live:
            raise KeyError(request_id)
        self._history.pop(request_id, None)  # an id may be reused once its request finished
        rec = TrackedRequest(request_id, engine_ids)
        self.live[request_id] = rec
        return rec

    def finish(self, rec: TrackedRequest) -> None:
        if rec.finished:
            return
        rec.finished = True
        rec.owner = None
        if self.live.get(rec.id) is rec:
            del self.live[rec.id]
        self._history[rec.id] = rec
        while len(self._history) > self._history_len:
            self._history.popitem(last=False)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self.live.get(request_id) or self._history.get(request_id)

    async def cancel(self, request_id: str) -> dict[str, Any] | None:
        """Cancel `request_id` if this process holds it (idempotent); its final state, or None if unknown here."""
        rec = self.get(request_id)
        if rec is None:
            return None
        if not rec.finished and rec.owner is not None:
            await rec.owner.cancel()
        return rec.final_state()
