"""Anthropic's error shape on the Messages routes: `{"type": "error", "error": {"type", "message"}, "request_id"}`.

The rest of the server raises `APIError` (OpenAI's vocabulary); `anthropic_errors` wraps a
Messages route so whatever it raises leaves in Anthropic's shape, with Anthropic's status where
it differs (a full queue is `overloaded_error` 529, which Anthropic's clients retry), the field a
400 is about named in its message, and a `request-id` header. Nothing escapes to the server's
generic handler: an unexpected exception is an `api_error` 500, logged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatserve.engine.input_processor import PromptError
from chatserve.server.errors import APIError
from chatserve.server.errors import anthropic_error_body as error_body

logger = logging.getLogger(__name__)

def anthropic_status(exc: APIError) -> int:
    """Anthropic's status for one of ours: a full queue or a draining server is 529 (overloaded)."""
    if exc.status == 503 and (exc.code == "queue_full" or "Retry-After" in exc.headers):
        return 529
    return exc.status


def error_event(status: int, message: str, request_id: str | None) -> dict[str, Any]:
    """The `event: error` frame of a stream that fails after its headers went out."""
    return error_body(status, message, request_id)


def from_api_error(exc: APIError, request_id: str | None) -> JSONResponse:
    status = anthropic_status(exc)
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    headers = {**exc.headers, **({"request-id": request_id} if request_id else {})}
    return JSONResponse(error_body(status, message, request_id), status_code=status, headers=headers)


Handler = Callable[[Request], Awaitable[Response]]


def anthropic_errors(handler: Handler) -> Handler:
    """Wrap a Messages route: every failure it raises answers in Anthropic's shape."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        request.state.anthropic_request_id = None
        try:
            return await handler(request)
        except APIError as exc:
            return from_api_error(exc, request.state.anthropic_request_id)
        except PromptError as exc:
            return from_api_error(APIError(400, str(exc), param=exc.param, code=exc.code),
                                  request.state.anthropic_request_id)
        except Exception:  # noqa: BLE001 - answered in the API's shape, never a bare 500
            logger.exception("unhandled error on %s %s", request.method, request.url.path)
            return from_api_error(APIError(500, "internal server error; the server logged the details"),
                                  request.state.anthropic_request_id)

    return wrapped
