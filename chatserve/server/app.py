"""`create_app`: the whole HTTP surface over one engine, as a Starlette app.

A request's path: `middleware` (error count, Host and Origin checks, CORS, API key) -> a family's `routes` (openai/, responses/,
sessions/) -> `http_input` (body size, JSON, the family's pydantic `protocol` models) ->
`chat/params` (SamplingParams) -> `chat/generation` (engine requests) -> `chat/replies` (SSE
chunks or one body, built by `chat/chunks`, written by `streams/sse`). Every failure on the way
is an `errors.APIError`, answered in OpenAI's error shape. State lives on `app.state.ctx`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import BaseRoute

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.server import admin, kv_events, models, web
from chatserve.server.anthropic import routes as anthropic_routes
from chatserve.server.cancel_bus import CancelBus
from chatserve.server.context import ServerContext
from chatserve.server.errors import exception_handlers
from chatserve.server.metrics import ServerMetrics
from chatserve.server.middleware import add_middleware
from chatserve.server.openai import routes as openai_routes
from chatserve.server.openai import tokens as token_routes
from chatserve.server.responses import routes as responses_routes
from chatserve.server.sessions import routes as session_routes
from chatserve.server.sessions.header import SessionHeader
from chatserve.server.settings import ServerSettings
from chatserve.server.streams.event_log import make_event_log
from chatserve.server.streams.runs import RunRegistry
from chatserve.server.tracker import RequestTracker
from chatserve.sessions import SessionStore
from chatserve.sessions.factory import make_response_store
from chatserve.sessions.response_store import ResponseStore

logger = logging.getLogger(__name__)


def create_app(engine: AsyncLLMEngine, sessions: SessionStore | None = None,
               settings: ServerSettings | None = None, cancel_bus: CancelBus | None = None,
               responses: ResponseStore | None = None, bind_host: str | None = None) -> Starlette:
    """The whole HTTP surface over one engine. `sessions` None: no session API. `cancel_bus`: cancels
    reach the replica holding the request (several replicas sharing a Redis behind a router).
    `bind_host`: the address the server listens on (a loopback one turns the Host check on; see
    middleware.py); the session store takes its limits from `settings`."""
    settings = settings or ServerSettings()
    if sessions is not None:
        sessions.set_limits(settings.session_limits())
    model_name = settings.served_model_name or engine.model_name
    server_metrics = ServerMetrics(engine.stats, model_name)
    ctx = ServerContext(engine, sessions, settings, server_metrics,
                        RequestTracker(settings.finished_request_history), model_name,
                        chat_template=settings.load_chat_template(), cancel_bus=cancel_bus,
                        runs=RunRegistry(make_event_log(sessions, max_events=settings.event_log_max_events,
                                                        ttl_s=settings.event_log_ttl_s)),
                        responses=responses if responses is not None else make_response_store(
                            sessions, ttl_seconds=settings.responses_ttl_s,
                            max_in_memory=settings.responses_max_in_memory))

    routes: list[BaseRoute] = [*admin.routes(), *models.routes(), *openai_routes.routes(), *token_routes.routes(), *kv_events.routes(),
                                *responses_routes.routes(), *anthropic_routes.routes()]
    if sessions is not None:
        routes.extend(session_routes.routes())
    if settings.serve_web:
        routes.extend(web.routes())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        if cancel_bus is not None:
            await cancel_bus.start(ctx.tracker.cancel)
        logger.info("chatserve: serving %s", model_name)
        try:
            yield
        finally:
            ctx.accepting = False
            await ctx.runs.shutdown()  # detached runs end ("engine") and their logs are ended
            await engine.shutdown()
            if cancel_bus is not None:
                await cancel_bus.close()
            for task in list(ctx.background):
                with contextlib.suppress(BaseException):
                    await task
            if sessions is not None:
                with contextlib.suppress(Exception):
                    await sessions.close()

    app = Starlette(routes=routes, exception_handlers=exception_handlers(), lifespan=lifespan)
    app.state.ctx = ctx
    if sessions is not None:
        app.add_middleware(SessionHeader)
    add_middleware(app, api_key=settings.api_key, metrics=server_metrics, routes=app.router.routes,
                   instance_id=settings.instance_id, allowed_origins=settings.allowed_origins or (),
                   allowed_hosts=settings.allowed_hosts or (), bind_host=bind_host)
    return app
