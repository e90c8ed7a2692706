"""The Starlette app: routes, auth, error shape, lifespan. Built by `create_app`, state on the app."""

from __future__ import annotations

import contextlib
import hmac
import importlib.resources
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from chatserve.engine.async_engine import AsyncLLMEngine

from chatserve.server.errors import APIError, error_body
from chatserve.server.metrics import ServerMetrics
from chatserve.server.openai_routes import cancel_request, chat_completions, completions, get_ctx, list_models
from chatserve.server.serving import ServerContext
from chatserve.server.settings import ServerSettings
from chatserve.server.tracker import RequestTracker

logger = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1/", "/debug/")


class _AuthAndErrorCount:
    """Pure ASGI middleware (no response buffering, so SSE and disconnects pass through untouched):
    Bearer-key check on the API paths, and a count of error statuses for /metrics."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith(_PROTECTED_PREFIXES) and not self._authorized(scope):
            self.metrics.observe_error(401)
            response = JSONResponse(
                error_body(401, "missing or invalid API key: send `Authorization: Bearer <key>`", code="invalid_api_key"),
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.observe_error(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                text = value.decode("latin-1")
                scheme, _, token = text.partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route for {request.method} {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(500, "internal server error; the server logged the details", code="internal_error"),
                        status_code=500)


async def health(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    if not ctx.engine.is_healthy():
        return JSONResponse({"status": "unhealthy", "reason": "the engine loop died"}, status_code=503)
    if not ctx.accepting:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(get_ctx(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def debug_cache(request: Request) -> JSONResponse:
    """Checks the KV-cache invariants between steps; 200 with the engine's stats, or 500 naming the break."""
    ctx = get_ctx(request)
    loop_before = ctx.engine.loop_state()  # before the check, which itself wakes the loop
    try:
        await ctx.engine.check_integrity()
    except AssertionError as exc:
        return JSONResponse(error_body(500, f"KV cache integrity check failed: {exc}", code="integrity"), status_code=500)
    now = time.time()
    live = [{"id": rec.id, "age_s": round(now - rec.created, 3), "engine_ids": rec.engine_ids,
             "abort_reason": rec.abort_reason} for rec in list(ctx.tracker.live.values())[:100]]
    return JSONResponse({"ok": True, "stats": ctx.engine.stats(), "loop": loop_before,
                         "live_requests": len(ctx.tracker.live),
                         "oldest_live": sorted(live, key=lambda r: -r["age_s"])[:20]})


def _web_dir() -> Any:
    return importlib.resources.files("chatserve.web")


async def index(request: Request) -> Response:
    page = _web_dir() / "index.html"
    if not page.is_file():
        return JSONResponse(error_body(404, "the web client is not installed (web/index.html missing)"), status_code=404)
    return FileResponse(str(page), media_type="text/html")


def create_app(engine: AsyncLLMEngine, sessions: Any = None, settings: ServerSettings | None = None) -> Starlette:
    """The whole HTTP surface over one engine. `sessions` is a SessionStore (or None: no session API)."""
    settings = settings or ServerSettings()
    model_name = settings.served_model_name or engine.engine.served_model_name
    server_metrics = ServerMetrics(engine.stats, model_name)
    ctx = ServerContext(engine, sessions, settings, server_metrics, RequestTracker(settings.finished_request_history),
                        model_name)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/requests/{request_id:str}/cancel", cancel_request, methods=["POST"]),
        Route("/v1/requests/{request_id:str}", cancel_request, methods=["DELETE"]),
        Route("/debug/cache", debug_cache, methods=["GET"]),
    ]
    if sessions is not None:
        from chatserve.server.session_routes import session_routes

        routes.extend(session_routes())
    if settings.serve_web:
        routes.append(Route("/", index, methods=["GET"]))
        routes.append(Mount("/static", app=StaticFiles(directory=str(_web_dir())), name="static"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        logger.info("chatserve: serving %s", model_name)
        try:
            yield
        finally:
            ctx.accepting = False
            await engine.shutdown()
            for task in list(ctx.background):
                with contextlib.suppress(BaseException):
                    await task
            if sessions is not None and hasattr(sessions, "close"):
                with contextlib.suppress(Exception):
                    await sessions.close()

    app = Starlette(
        routes=routes,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.add_middleware(_AuthAndErrorCount, api_key=settings.api_key, metrics=server_metrics)
    return app
