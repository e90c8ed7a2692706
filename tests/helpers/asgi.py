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


@contextlib.asynccontextmanager
async def tiny_model_client(folder: Any, *, max_model_len: int = 256, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`app_client` over a real `AsyncLLMEngine` on a tiny float32 checkpoint (served as "tiny"), the
    app's lifespan run: for HTTP tests whose tokens come from a real forward pass."""
    from chatserve import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(
        model=str(folder), dtype="float32", num_threads=1, max_model_len=max_model_len, block_size=16,
        served_model_name="tiny"))
    try:
        async with app_client(engine, lifespan=True, **settings) as client:
            yield client
    finally:
        await engine.shutdown()
