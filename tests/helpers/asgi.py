"""The real app over an engine (usually FakeEngine), driven in-process through httpx's ASGITransport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from chatserve.server import ServerSettings, create_app


@contextlib.asynccontextmanager
async def app_client(engine: Any, sessions: Any = None, cancel_bus: Any = None, *, lifespan: bool = False,
                     **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `create_app(engine, sessions, ServerSettings(**settings), cancel_bus)` (no web page
    unless asked). ASGITransport does not run the app's lifespan; `lifespan=True` runs it (the engine's
    start and the cancel bus live there)."""
    settings.setdefault("serve_web", False)
    app = create_app(engine, sessions, ServerSettings(**settings), cancel_bus)
    async with contextlib.AsyncExitStack() as stack:
        if lifespan:
            await stack.enter_async_context(app.router.lifespan_context(app))
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30))
        yield client
