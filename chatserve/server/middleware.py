"""The API key check, the count of error responses and the instance header, as one pure ASGI middleware.

Pure ASGI (no response buffering, unlike Starlette's BaseHTTPMiddleware), so SSE streams and
client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from chatserve.server.anthropic.errors import error_body as anthropic_error_body
from chatserve.server.errors import error_body
from chatserve.server.metrics import ServerMetrics

_PROTECTED_PREFIXES = ("/v1/", "/debug/", "/tokenize", "/detokenize")
_ANTHROPIC_PREFIX = "/v1/messages"


class AuthAndErrorCount:
    """Bearer-key check on the API paths (the web client and /health, /metrics stay open), and a
    count of error statuses for /metrics."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, instance_id: str | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        # Behind a router a client cannot tell which replica answered; every response says so.
        self.instance_header = [(b"x-chatserve-instance", instance_id.encode("latin-1"))] if instance_id else []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith(_PROTECTED_PREFIXES) and not self._authorized(scope):
            self.metrics.observe_error(401)
            message = "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
            if scope["path"].startswith(_ANTHROPIC_PREFIX) or _header(scope, b"anthropic-version") is not None:
                body = anthropic_error_body(401, message, None)
            else:
                body = error_body(401, message, code="invalid_api_key")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                if message["status"] >= 400:
                    self.metrics.observe_error(message["status"])
                if self.instance_header:
                    message = {**message, "headers": [*message.get("headers", ()), *self.instance_header]}
            await send(message)

        await self.app(scope, receive, counting_send)

    def _authorized(self, scope: dict) -> bool:
        """The key as OpenAI's clients send it (`Authorization: Bearer`) or as Anthropic's do (`x-api-key`)."""
        assert self.api_key is not None
        key = self.api_key.encode()
        authorization = _header(scope, b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key):
                return True
        x_api_key = _header(scope, b"x-api-key")
        return x_api_key is not None and hmac.compare_digest(x_api_key.strip(), key)


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None
