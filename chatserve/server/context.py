"""`ServerContext`: what every route needs, built once by `create_app` and kept on `app.state.ctx`.

No module globals: two apps in one process each have their own engine, settings, metrics and
tracker. The checks that refuse a request before any work (wrong model, overload, shutdown) live
here because they read the server's state, not the request body.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.reasoning import detect_reasoning_parser, reasoning_parser_named
from chatserve.reasoning.signature import ReasoningSigner
from chatserve.server.cancel_bus import CancelBus
from chatserve.server.errors import APIError
from chatserve.server.metrics import ServerMetrics
from chatserve.server.settings import ServerSettings
from chatserve.server.streams.event_log import MemoryEventLog
from chatserve.server.streams.runs import RunRegistry
from chatserve.server.tracker import RequestTracker
from chatserve.sessions import SessionStore
from chatserve.sessions.response_store import ResponseStore

logger = logging.getLogger(__name__)

T = TypeVar("T")
PREP_THREADS = 4
"""Worker threads for a request's work before the engine (template, tokenizing, schema checks)."""


@dataclass
class ServerContext:
    """Everything a route needs; lives on `app.state.ctx`."""

    engine: AsyncLLMEngine
    sessions: SessionStore | None  # None: no session API
    settings: ServerSettings
    metrics: ServerMetrics
    tracker: RequestTracker
    model_name: str
    background: set[asyncio.Task] = field(default_factory=set)
    accepting: bool = True  # False once shutdown began
    started_at: int = field(default_factory=lambda: int(time.time()))
    chat_template: str | None = None  # --chat-template's text; None: the model's own
    cancel_bus: CancelBus | None = None  # cancels for requests other replicas hold (None: local only)
    runs: RunRegistry = field(default_factory=lambda: RunRegistry(MemoryEventLog()))  # resumable/background runs
    responses: ResponseStore | None = None  # stored Responses API objects (None: the Responses API's store is off)
    preparing: int = 0  # requests admitted and not yet handed to the engine (rendering, tokenizing, compiling)
    prep_workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=PREP_THREADS, thread_name_prefix="chatserve-prep"))
    reasoning_parser: str | None = field(init=False, default=None)
    """The reasoning parser replies are split by (--reasoning-parser, else found from the chat template's
    markers), resolved once here; None: the model does not reason, as far as the server knows."""

    reasoning_signer: ReasoningSigner = field(init=False, repr=False)
    """Signs and seals the reasoning given to clients (--reasoning-signing-key, else a random key)."""

    def __post_init__(self) -> None:
        self.reasoning_signer = ReasoningSigner.from_key(self.settings.reasoning_signing_key)
        self.reasoning_parser = resolve_reasoning_parser(
            self.settings.reasoning_parser, self.chat_template or getattr(self.engine.tokenizer, "chat_template", None))

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the pre-engine worker threads, so synchronous work on a request's
        own input (a chat template, a tokenizer, a schema check) never holds the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prep_workers, functools.partial(fn, *args, **kwargs))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may give for the model (`--served-model-name A B C`), the one replies
        report (model_name) first."""
        return tuple(dict.fromkeys((self.model_name, *(self.settings.served_model_aliases or ()))))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task that outlives the request that started it (e.g. settling after a disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def drain(self, grace_s: float) -> None:
        """Shutdown: refuse new work, let running requests finish for up to grace_s, then abort the
        rest (their streams end with finish_reason "abort" and [DONE]; session turns are stored)."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.tracker.live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        live = [rec.owner for rec in list(self.tracker.live.values()) if rec.owner is not None]
        if live:
            logger.warning("shutdown: aborting %d request(s) still running after %.1fs", len(live), grace_s)
            await asyncio.gather(*(gen.cancel("engine") for gen in live), return_exceptions=True)
        # Let the streams write their final events and the session turns land.
        deadline = loop.time() + 5.0
        while (self.tracker.live or self.background) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def check_model(self, model: str | None) -> None:
        """A request naming another model is OpenAI's 404, not silently served by this one; any of the
        served names is this model."""
        names = self.served_model_names
        if model is not None and model not in names:
            also = f" (also as {', '.join(f'`{n}`' for n in names[1:])})" if len(names) > 1 else ""
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`{also}.",
                           param="model", code="model_not_found")

    @property
    def num_live_requests(self) -> int:
        """Requests in the engine plus those still being prepared for it (their grammar compiling, ...)."""
        return self.engine.num_live_requests + self.preparing

    def check_capacity(self) -> None:
        """Shed load with 503 + Retry-After once the waiting queue is full, instead of queueing forever.
        Requests still being prepared (rendering, tokenizing, compiling their grammar) count too."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if not self.engine.is_healthy():
            raise APIError(503, "the engine has failed and must be restarted", code="engine_dead")
        limit = self.engine.max_num_seqs + self.settings.max_queue_len
        live = self.num_live_requests
        if live >= limit:
            raise APIError(
                503,
                f"the server is overloaded ({live} requests in flight, limit {limit}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )


def resolve_reasoning_parser(flag: str | None, chat_template: str | None) -> str | None:
    """--reasoning-parser's value: a name forces that parser on any template, `none` turns parsing off,
    unset finds the family from the template the server renders with (its own or --chat-template's)."""
    if flag == "none":
        return None
    if flag is not None:
        reasoning_parser_named(flag)  # (ServerSettings refused an unknown name already; this keeps both in step)
        return flag
    return detect_reasoning_parser(chat_template if isinstance(chat_template, str) else None)


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx
