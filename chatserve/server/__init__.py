"""The OpenAI-compatible HTTP server (Starlette + SSE) over an `AsyncLLMEngine`."""

from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
