"""The OpenAI-compatible HTTP server (Starlette + SSE) over an `AsyncLLMEngine`."""

from chatserve.server.app import create_app
from chatserve.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
