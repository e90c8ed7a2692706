"""The OpenAI-compatible HTTP server (Starlette + SSE) over an `AsyncLLMEngine`.

One subpackage per concept, layered; each imports only from the layers below it:

    app.py                       create_app: every family's routes, the middleware, the lifespan
    openai/ responses/ sessions/ the API families: their routes and bodies (never import one another)
    admin.py kv_events.py web.py the endpoints that are no API family: health, metrics, cancel; KV
                                 events for vLLM's router; the browser client
    chat/                        one chat turn under every family: shared body fields, sampling
                                 params, prompts, the Generation, choices and chunks, tools,
                                 structured outputs, the chunk stream and the logged stream
    context.py                   ServerContext: the engine, stores and registries every route reads
    streams/                     SSE and keepalive, the disconnect race, event logs, runs and their
                                 disconnect policy, reading a logged stream back
    errors.py settings.py metrics.py tracker.py middleware.py http_input.py cancel_bus.py
                                 the foundation: error shape, settings, Prometheus metrics, the
                                 request tracker, API key, body parsing, cross-replica cancels

What two families share lives in chat/ or streams/, never in one of them.
"""

from typing import TYPE_CHECKING, Any

from chatserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from chatserve.server.app import create_app

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    """`create_app` on first use: importing `chatserve.server.settings` (the CLI does, for its flags)
    must not import the app, the engine and torch."""
    if name == "create_app":
        from chatserve.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
