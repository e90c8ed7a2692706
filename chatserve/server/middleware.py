"""What every request passes before it reaches a route, as pure ASGI middleware (outermost first):

1. `ErrorCount`: the count of error statuses for /metrics and the `X-Chatserve-Instance` header; a
   client that hung up before its body arrived (`ClientDisconnect`) ends here quietly instead of
   reaching uvicorn as an exception (there is nobody left to answer).
2. `BrowserGuard`: what keeps web pages away from the API without touching curl or the SDKs.
   - **Host** (DNS rebinding, Jupyter's rule): bound to a loopback address, the `Host` header must
     name a loopback host (`localhost`, `*.localhost`, 127.0.0.0/8, ::1), the bind address, or one
     of `--allowed-hosts`; bound to anything else, it is checked only when `--allowed-hosts` is given.
     A page on `evil.example` whose name is re-pointed at 127.0.0.1 sends `Host: evil.example`.
   - **Origin**: a request that carries an `Origin` (browsers send it on every cross-origin request
     and on every POST) must come from the request's own scheme, host and port, or from one of
     `--allowed-origins` (`*`: any). Clients that send no `Origin` (curl, the SDKs) pass, and no
     `Content-Type` is ever required (`curl -d` sends form-urlencoded).
   Both refusals are a 403 in the API's own error shape (Anthropic's on /v1/messages).
3. CORS (Starlette's `CORSMiddleware`), only when `--allowed-origins` lists origins: preflights and
   `Access-Control-Allow-Origin` for those pages.
4. `ApiKeyAuth`: with `--api-key`, every request needs the key (`Authorization: Bearer KEY`, as
   OpenAI's clients and Anthropic's `auth_token` send it, or `x-api-key: KEY`, as Anthropic's do)
   unless the route it reaches is on the open list (`OPEN_ROUTES`: the web page and its static
   files, /health, /metrics, and what a router asks a worker). Default-deny: the route is found the
   way the router finds it (root path and percent-decoding included), so a new route, or the app
   mounted under a prefix, is closed until it is listed.

Pure ASGI (no response buffering, unlike Starlette's BaseHTTPMiddleware), so SSE streams and
client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from chatserve.server.errors import anthropic_error_body, error_body
from chatserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_ANTHROPIC_PREFIX = "/v1/messages"

#: Routes open without the API key, by their path template: the web page (`/`) and its files
#: (`/static`), the probes (`/health`, `/metrics`), and what vLLM's router asks a worker before it
#: routes by KV events (`/get_server_info`, `/kv_event_sources`: the model name and block size, no
#: user data). Everything else, and a path no route matches, needs the key.
OPEN_ROUTES = frozenset({"/", "/static", "/health", "/metrics", "/get_server_info", "/kv_event_sources"})

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _is_anthropic(scope: dict) -> bool:
    return scope["path"].startswith(_ANTHROPIC_PREFIX) or _header(scope, b"anthropic-version") is not None


async def refuse(scope: dict, receive: Any, send: Any, status: int, message: str, code: str,
                 headers: dict[str, str] | None = None) -> None:
    """An error answered before any route runs, in the shape of the API the request was for."""
    if _is_anthropic(scope):
        body = anthropic_error_body(status, message, None)
    else:
        body = error_body(status, message, code=code)
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class ErrorCount:
    """Counts error statuses for /metrics (refusals of the middleware below included) and adds the
    instance header to every response."""

    def __init__(self, app: Any, metrics: ServerMetrics, instance_id: str | None = None) -> None:
        self.app = app
        self.metrics = metrics
        # Behind a router a client cannot tell which replica answered; every response says so.
        self.instance_header = [(b"x-chatserve-instance", instance_id.encode("latin-1"))] if instance_id else []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                if message["status"] >= 400:
                    self.metrics.observe_error(message["status"])
                if self.instance_header:
                    message = {**message, "headers": [*message.get("headers", ()), *self.instance_header]}
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except ClientDisconnect:
            logger.debug("%s %s: the client left before its request body arrived", scope["method"], scope["path"])


# ---- Host and Origin --------------------------------------------------------------------------------
def _split_host(value: str) -> tuple[str, int | None] | None:
    """`host[:port]` (IPv6 in brackets) as (lower-case host without brackets, port); None if malformed."""
    try:
        parts = urlsplit("//" + value)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host or parts.path or parts.query or parts.fragment or parts.username is not None:
        return None
    return host.lower(), port


def is_loopback_host(host: str) -> bool:
    """`localhost`, a name under `.localhost` (RFC 6761: browsers resolve those to loopback themselves),
    or a loopback address."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_matches(host: str, patterns: Iterable[str]) -> bool:
    """`*` any host; `.example.com` the name and every name under it; else the exact name."""
    host = host.rstrip(".")
    for pattern in patterns:
        p = pattern.lower().strip().strip("[]").rstrip(".")
        if p == "*" or p == host or (p.startswith(".") and (host == p[1:] or host.endswith(p))):
            return True
    return False


def normalize_origin(origin: str) -> str | None:
    """`scheme://host[:port]` lower-cased with the default port dropped; None for what is not one
    (`null`, a path, junk)."""
    try:
        parts = urlsplit(origin.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if not scheme or not host or parts.path not in ("", "/") or parts.query or parts.username is not None:
        return None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc += f":{port}"
    return f"{scheme}://{netloc}"


class BrowserGuard:
    """The Host check (DNS rebinding) and the Origin check (cross-site requests); see the module
    docstring. `bind_host`: the address the server listens on (None: unknown, as in-process tests run
    it; the Host is then checked only against `allowed_hosts`, when given)."""

    def __init__(self, app: Any, *, allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = (),
                 bind_host: str | None = None) -> None:
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.allowed_origins = {o for o in (normalize_origin(x) if x != "null" else "null" for x in allowed_origins) if o}
        self.allowed_hosts = tuple(allowed_hosts)
        loopback_bind = bind_host is not None and is_loopback_host(bind_host)
        self.check_host = loopback_bind or bool(self.allowed_hosts)
        self.bind_host = bind_host.lower().strip("[]") if bind_host else None

    def host_allowed(self, host: str) -> bool:
        return is_loopback_host(host) or host == self.bind_host or _host_matches(host, self.allowed_hosts)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_host = _header(scope, b"host")
        host_value = raw_host.decode("latin-1") if raw_host is not None else None
        if self.check_host and host_value is not None:
            split = _split_host(host_value)
            if split is None or not self.host_allowed(split[0]):
                await refuse(scope, receive, send, 403,
                             f"the Host header {host_value[:100]!r} is not a name this server answers to; start it "
                             "with --allowed-hosts NAME to allow it (a loopback-bound server answers only to "
                             "loopback names unless told, which keeps DNS-rebinding pages out)", "host_not_allowed")
                return
        raw_origin = _header(scope, b"origin")
        if raw_origin is not None and not self.any_origin:
            origin = raw_origin.decode("latin-1")
            normalized = "null" if origin.strip() == "null" else normalize_origin(origin)
            own = normalize_origin(f"{scope.get('scheme', 'http')}://{host_value}") if host_value else None
            if normalized is None or (normalized != own and normalized not in self.allowed_origins):
                await refuse(scope, receive, send, 403,
                             f"requests from the web origin {origin[:100]!r} are not allowed: a page may call this "
                             "API only from the server's own origin, or from one given to --allowed-origins",
                             "origin_not_allowed")
                return
        await self.app(scope, receive, send)


# ---- the API key -------------------------------------------------------------------------------------
class ApiKeyAuth:
    """Default-deny: with a key, every request needs it unless its route is on `open_routes`."""

    def __init__(self, app: Any, api_key: str | None, routes: Sequence[BaseRoute],
                 open_routes: Iterable[str] = OPEN_ROUTES) -> None:
        self.app = app
        self.api_key = api_key
        self.routes = routes  # the app's own list: routes added later count too
        self.open_routes = frozenset(open_routes)

    def route_of(self, scope: dict) -> BaseRoute | None:
        """The route the router will hand this request to (a path match with another method counts: the
        405 it gets says nothing more than a 401 would); None when no route matches."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route
            if match == Match.PARTIAL and partial is None:
                partial = route
        return partial

    def is_open(self, scope: dict) -> bool:
        route = self.route_of(scope)
        return route is not None and getattr(route, "path", None) in self.open_routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.api_key or self._authorized(scope) or self.is_open(scope):
            await self.app(scope, receive, send)
            return
        await refuse(scope, receive, send, 401,
                     "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                     "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _authorized(self, scope: dict) -> bool:
        """The key as OpenAI's clients send it (`Authorization: Bearer`, also Anthropic's `auth_token`)
        or as Anthropic's do (`x-api-key`); any one of the request's headers carrying it will do."""
        assert self.api_key is not None
        key = self.api_key.encode()
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                ok |= scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
            elif name == b"x-api-key":
                ok |= hmac.compare_digest(value.strip(), key)
        return ok


def add_middleware(app: Any, *, api_key: str | None, metrics: ServerMetrics, routes: Sequence[BaseRoute],
                   instance_id: str | None = None, allowed_origins: Sequence[str] = (),
                   allowed_hosts: Sequence[str] = (), bind_host: str | None = None) -> None:
    """Install the chain on a Starlette app (its last added middleware runs first)."""
    app.add_middleware(ApiKeyAuth, api_key=api_key, routes=routes)
    cors = ["*"] if "*" in allowed_origins else [o for o in map(normalize_origin, allowed_origins) if o]
    if cors:
        app.add_middleware(CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id", "X-Session-Id", "X-Chatserve-Instance"], max_age=600)
    app.add_middleware(BrowserGuard, allowed_origins=allowed_origins, allowed_hosts=allowed_hosts, bind_host=bind_host)
    app.add_middleware(ErrorCount, metrics=metrics, instance_id=instance_id)
