"""OpenAI's error shape for every failure, so clients' error handling works unchanged.

Routes raise `APIError`; the handlers here turn it, the input processor's `PromptError` (a 400
naming the field to fix), Starlette's 404/405 and any unexpected exception into
`{"error": {"message", "type", "param", "code"}}` with the right status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response

from chatserve.engine.input_processor import PromptError
from chatserve.server.json_checks import escape_surrogates, has_surrogates

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status we return.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}


class JSONResponse(StarletteJSONResponse):
    """Starlette's JSONResponse (compact UTF-8, no NaN), except that a lone surrogate in the content
    (a model's reply can decode to one: a tool call whose arguments say "\\ud800") is written as its
    escape instead of failing to encode: every body the server answers with, or stores and reads back,
    can be sent."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
        if has_surrogates(text):
            text = escape_surrogates(text)
        return text.encode("utf-8")


class APIError(Exception):
    """Raised anywhere in a route; the app turns it into `{"error": {...}}` with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


# Anthropic's `error.type` for each status (its Messages API and the clients built on it read these).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "api_error", 503: "api_error", 529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str, request_id: str | None) -> dict[str, Any]:
    """Anthropic's shape, `{"type": "error", "error": {"type", "message"}, "request_id"}`: the Messages routes'
    (server/anthropic/errors.py) and the middleware's refusals of them, beside OpenAI's above."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message},
            "request_id": request_id}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def prompt_error(exc: PromptError) -> APIError:
    """The input processor validated the prompt (once) and named the field; pass both on."""
    return APIError(400, str(exc), param=exc.param, code=exc.code)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _prompt_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PromptError)
    return prompt_error(exc).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route for {request.method} {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    if request.url.path.startswith("/v1/messages"):  # the router's 404/405 on the Messages API: Anthropic's shape
        return JSONResponse(anthropic_error_body(exc.status_code, message, None), status_code=exc.status_code,
                            headers=exc.headers)
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(500, "internal server error; the server logged the details", code="internal_error"),
                        status_code=500)


def exception_handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """Starlette's `exception_handlers`: every failure leaves in OpenAI's shape."""
    return {APIError: _api_error, PromptError: _prompt_error, HTTPException: _http_error, Exception: _internal_error}
