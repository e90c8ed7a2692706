"""What stands before every route (chatserve/server/middleware.py): the API key (default-deny, matched
on the route), the Host check (DNS rebinding) and the Origin check (cross-site pages), CORS for the
allowed origins, and the refusals in each API's own error shape. In-process, over the real app."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from chatserve.server import ServerSettings, create_app
from chatserve.server.middleware import OPEN_ROUTES, normalize_origin
from chatserve.sessions import InMemorySessionStore
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KEY = "sekrit-key"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply="Hello there.")


def make_app(engine: Any, *, bind_host: str | None = None, **settings: Any) -> Starlette:
    return create_app(engine, InMemorySessionStore(), ServerSettings(**settings), bind_host=bind_host)


@contextlib.asynccontextmanager
async def client_of(app: Any, base_url: str = "http://127.0.0.1:8000") -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, timeout=30) as client:
        yield client


def anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def concrete(path: str) -> str:
    """A request path for a route template: each {param} or {param:conv} as a plausible value."""
    return re.sub(r"\{([a-z_]+)(?::\w+)?\}", lambda m: "sess_0000000000000000000000000" if "session" in m[1]
                  else "x-1", path)


# ---- the API key: default-deny on the route ------------------------------------------------------------
async def test_every_route_but_the_open_ones_needs_the_key(engine) -> None:
    """Walks the app's own route table: a route added without being listed open is closed."""
    app = make_app(engine, api_key=KEY, serve_web=True)
    seen_open = set()
    async with client_of(app) as client:
        for route in app.router.routes:
            if isinstance(route, Mount):
                path, methods = route.path + "/app.js", ["GET"]
            else:
                assert isinstance(route, Route)
                path, methods = concrete(route.path), sorted(route.methods or ["GET"])
            for method in methods:
                resp = await client.request(method, path)
                if route.path in OPEN_ROUTES:
                    seen_open.add(route.path)
                    assert resp.status_code != 401, (method, path, resp.text)
                else:
                    assert resp.status_code == 401, (method, path, resp.status_code, resp.text)
                    if method != "HEAD":
                        if path.startswith("/v1/messages"):
                            anthropic_error(resp, 401, "authentication_error")
                        else:
                            assert_error(resp, 401, code="invalid_api_key")
                    assert resp.headers["www-authenticate"] == "Bearer"
    assert seen_open == {"/", "/static", "/health", "/metrics", "/get_server_info", "/kv_event_sources"}


@pytest.mark.parametrize("path", ["/nothing-here", "/v2/chat/completions", "/healthz", "/V1/models"])
async def test_a_path_no_route_matches_needs_the_key_too(engine, path) -> None:
    async with client_of(make_app(engine, api_key=KEY)) as client:
        assert_error(await client.get(path), 401)
        assert (await client.get(path, headers={"Authorization": f"Bearer {KEY}"})).status_code == 404


async def test_the_key_is_taken_wherever_a_client_sends_it(engine) -> None:
    async with client_of(make_app(engine, api_key=KEY)) as client:
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer  {KEY} "},
                        {"x-api-key": KEY}, {"X-Api-Key": f" {KEY}"},
                        {"Authorization": "Bearer wrong", "x-api-key": KEY}):
            resp = await client.get("/v1/models", headers=headers)
            assert resp.status_code == 200, (headers, resp.text)
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY})
        assert resp.status_code == 200, resp.text
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                        {"x-api-key": "wrong"}, {"api-key": KEY}):
            assert_error(await client.get("/v1/models", headers=headers), 401, code="invalid_api_key")
        # Anthropic's clients get Anthropic's shape, also on a path outside /v1/messages.
        anthropic_error(await client.post("/v1/messages", json={}), 401, "authentication_error")
        anthropic_error(await client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}), 401,
                        "authentication_error")


async def test_mounted_under_a_prefix_or_a_root_path_the_api_stays_closed(engine) -> None:
    """The check finds the route as the router does, so a prefix in front of the app changes nothing."""
    inner = make_app(engine, api_key=KEY)
    outer = Starlette(routes=[Mount("/api", app=inner)])
    async with client_of(outer) as client:
        assert_error(await client.get("/api/v1/models"), 401)
        assert_error(await client.get("/api/v1/sessions"), 401)
        assert (await client.get("/api/v1/models", headers={"x-api-key": KEY})).status_code == 200
        assert (await client.get("/api/health")).status_code == 200
    # uvicorn --root-path: the prefix arrives in scope["root_path"] and in the path
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(engine, api_key=KEY), root_path="/api"),
                                 base_url="http://127.0.0.1:8000") as client:
        assert_error(await client.get("/api/v1/models"), 401)
        assert (await client.get("/api/v1/models", headers={"x-api-key": KEY})).status_code == 200
        assert (await client.get("/api/health")).status_code == 200


async def test_without_a_key_everything_is_open(engine) -> None:
    async with client_of(make_app(engine)) as client:
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


# ---- Origin --------------------------------------------------------------------------------------------
async def test_a_page_elsewhere_cannot_drive_the_api(engine) -> None:
    async with client_of(make_app(engine)) as client:
        for origin in ("http://evil.example", "https://127.0.0.1:8000", "http://127.0.0.1:8001", "null",
                       "http://127.0.0.1:8000.evil.example", "garbage", "http://localhost:8000"):
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/sessions", "/tokenize", "/v1/responses"):
                # text/plain: the "simple request" a page may send without a preflight
                resp = await client.post(path, content=b'{"prompt": "x", "messages": [], "input": "x"}',
                                         headers={"Origin": origin, "Content-Type": "text/plain"})
                err = assert_error(resp, 403, code="origin_not_allowed")
                assert err["type"] == "permission_error" and "--allowed-origins" in err["message"]
            assert_error(await client.get("/v1/sessions", headers={"Origin": origin}), 403)
            resp = await client.post("/v1/messages", json={}, headers={"Origin": origin})
            assert "--allowed-origins" in anthropic_error(resp, 403, "permission_error")
            resp = await client.post("/v1/messages/count_tokens", json={}, headers={"Origin": origin})
            anthropic_error(resp, 403, "permission_error")
        assert engine.requests == []  # nothing reached the engine


async def test_curl_and_same_origin_pages_are_unaffected(engine) -> None:
    async with client_of(make_app(engine, serve_web=True)) as client:
        # no Origin, and no JSON Content-Type: `curl -d` sends form-urlencoded
        resp = await client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "Hi"}], '
                                 b'"max_tokens": 2}', headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert resp.status_code == 200, resp.text
        resp = await client.post("/v1/sessions", content=b"{}", headers={"Content-Type": "text/plain"})
        assert resp.status_code == 201, resp.text
        # the page served at / calls the API with its own origin
        for origin in ("http://127.0.0.1:8000", "HTTP://127.0.0.1:8000", "http://127.0.0.1:8000/"):
            resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
            assert resp.status_code == 200, (origin, resp.text)
        assert (await client.get("/static/app.js", headers={"Origin": "http://127.0.0.1:8000"})).status_code == 200
    async with client_of(make_app(engine), base_url="http://chat.example") as client:  # the default port
        assert (await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://chat.example"})
                ).status_code == 200
        assert_error(await client.post("/v1/chat/completions", json=CHAT,
                                       headers={"Origin": "https://chat.example"}), 403)


async def test_allowed_origins_may_call_and_get_cors_headers(engine) -> None:
    app = make_app(engine, allowed_origins=["https://app.example", "http://localhost:3000"])
    async with client_of(app) as client:
        for origin in ("https://app.example", "http://localhost:3000"):
            resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
            assert resp.status_code == 200, resp.text
            assert resp.headers["access-control-allow-origin"] == origin
            assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
            # the preflight of a JSON POST with a key
            resp = await client.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["access-control-allow-origin"] == origin
            assert "authorization" in resp.headers["access-control-allow-headers"].lower()
        resp = await client.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert_error(resp, 403, code="origin_not_allowed")
        assert "access-control-allow-origin" not in resp.headers
    async with client_of(make_app(engine, allowed_origins=["*"])) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://anything.example"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"


async def test_a_preflight_needs_no_key_but_the_request_does(engine) -> None:
    app = make_app(engine, api_key=KEY, allowed_origins=["https://app.example"])
    async with client_of(app) as client:
        resp = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert resp.status_code == 200
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"})
        assert_error(resp, 401)
        assert resp.headers["access-control-allow-origin"] == "https://app.example"  # the page can read why
        resp = await client.post("/v1/chat/completions", json=CHAT,
                                 headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200


def test_origins_are_normalized() -> None:
    assert normalize_origin("HTTP://Example.COM:80") == "http://example.com"
    assert normalize_origin("https://example.com:443/") == "https://example.com"
    assert normalize_origin("http://[::1]:8000") == "http://[::1]:8000"
    for bad in ("null", "example.com", "http://", "http://a/b", "http://a?x", "http://u@a", "http://a:99999"):
        assert normalize_origin(bad) is None, bad


# ---- Host (DNS rebinding) ------------------------------------------------------------------------------
@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1"])
async def test_loopback_bound_server_answers_only_loopback_names(engine, bind) -> None:
    app = make_app(engine, bind_host=bind)
    async with client_of(app) as client:
        for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "127.1.2.3", "app.localhost:8000"):
            resp = await client.get("/v1/sessions", headers={"Host": host})
            assert resp.status_code == 200, (host, resp.text)
        for host in ("evil.example:8000", "evil.example", "10.0.0.1:8000", "127.0.0.1.evil.example", "a b", "x:y:z"):
            # the rebinding page's own request is same-origin: only the Host gives it away
            resp = await client.get("/v1/sessions", headers={"Host": host, "Origin": f"http://{host}"})
            err = assert_error(resp, 403, code="host_not_allowed")
            assert "--allowed-hosts" in err["message"]
            resp = await client.post("/v1/messages", json={}, headers={"Host": host})
            anthropic_error(resp, 403, "permission_error")


async def test_allowed_hosts_extend_the_loopback_names(engine) -> None:
    app = make_app(engine, bind_host="127.0.0.1", allowed_hosts=["chat.internal", ".corp.example"])
    async with client_of(app) as client:
        for host in ("chat.internal:8000", "corp.example", "a.b.corp.example:8000", "localhost:8000"):
            assert (await client.get("/health", headers={"Host": host})).status_code == 200, host
        for host in ("evil.example", "corp.example.evil", "xcorp.example"):
            assert_error(await client.get("/health", headers={"Host": host}), 403, code="host_not_allowed")


async def test_bound_to_all_interfaces_the_host_is_checked_only_when_listed(engine) -> None:
    async with client_of(make_app(engine, bind_host="0.0.0.0")) as client:
        assert (await client.get("/v1/sessions", headers={"Host": "whatever.example:8000"})).status_code == 200
    async with client_of(make_app(engine, bind_host="0.0.0.0", allowed_hosts=["chat.example"])) as client:
        assert (await client.get("/v1/sessions", headers={"Host": "chat.example:8000"})).status_code == 200
        assert (await client.get("/v1/sessions", headers={"Host": "127.0.0.1:8000"})).status_code == 200
        assert_error(await client.get("/v1/sessions", headers={"Host": "other.example"}), 403)
    async with client_of(make_app(engine, bind_host="192.168.1.5")) as client:
        assert (await client.get("/v1/sessions", headers={"Host": "192.168.1.5:8000"})).status_code == 200


async def test_refusals_are_counted_in_metrics(engine) -> None:
    async with client_of(make_app(engine, bind_host="127.0.0.1", api_key=KEY)) as client:
        assert (await client.get("/v1/models", headers={"Host": "evil.example"})).status_code == 403
        assert (await client.get("/v1/models", headers={"Origin": "http://evil.example"})).status_code == 403
        assert (await client.get("/v1/models")).status_code == 401
        text = (await client.get("/metrics")).text
    assert re.search(r'http_errors_total\{[^}]*status="403"[^}]*\} 2\.0', text), text
    assert re.search(r'http_errors_total\{[^}]*status="401"[^}]*\} 1\.0', text), text


async def test_a_client_that_leaves_mid_body_ends_quietly(engine, caplog) -> None:
    """Nobody is left to answer: no exception reaches the server (uvicorn would log a traceback)."""
    app = make_app(engine)
    messages = [{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", b"100000")],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234)}
    await app(scope, receive, send)  # returns, does not raise
    assert sent == [] and engine.requests == []
    assert "Traceback" not in caplog.text and "unhandled error" not in caplog.text


async def test_the_routers_own_404_and_405_on_the_messages_api_are_in_anthropics_shape(engine) -> None:
    async with client_of(make_app(engine)) as client:
        anthropic_error(await client.get("/v1/messages"), 405, "invalid_request_error")
        anthropic_error(await client.get("/v1/messages/nope"), 404, "not_found_error")
        assert_error(await client.get("/v1/chat/completions"), 405)
