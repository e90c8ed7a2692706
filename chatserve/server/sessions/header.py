"""`X-Session-Id` on the session API: what a router keys session affinity on.

vLLM's router (`--policy sticky_least_loaded`, `consistent_hash`) keeps requests that carry the
same `X-Session-Id` on one replica, so a session's turns find their KV blocks where the last
turn left them. Clients therefore send the header on every session call; this middleware makes
it part of the contract: a header that names another session than the path is a 400 (a client
bug that would otherwise route turns by one id and run them on another), and every session
response carries the id it concerns (a route that makes a new session, create or fork, sets its
own, which is kept).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

from chatserve.server.errors import error_body

_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)")
HEADER = b"x-session-id"
# What can be echoed as a header value: visible ASCII (a path segment may decode to any byte).
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]{1,256}$")


class SessionHeader:
    """Pure ASGI (streams pass through untouched), like the auth middleware."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        match = _SESSION_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        sid = match.group(1)
        sent = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == HEADER), None)
        if sent is not None and sent.strip() != sid:
            response = JSONResponse(error_body(
                400, f"X-Session-Id {sent.strip()!r} names another session than the path ({sid!r}); send the "
                     "session's own id (routers route by the header, the server runs the path's session)",
                param="X-Session-Id", code="session_id_mismatch"), status_code=400)
            await response(scope, receive, send)
            return

        valid = _HEADER_SAFE.match(sid) is not None

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                # An id with control characters ("%0D" in the path) is not echoed: such a header
                # would break the response itself. No session has such an id anyway (a 404).
                if valid and not any(k.lower() == HEADER for k, _ in headers):
                    headers.append((HEADER, sid.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
