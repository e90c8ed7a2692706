"""Reading and checking what arrives over HTTP before it reaches pydantic or the engine."""

from __future__ import annotations

import asyncio
import uuid
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.requests import Request

from chatserve.server.errors import APIError, bad_request
from chatserve.server.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed `limit`, without buffering more."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if size > limit:
            raise APIError(413, f"the request body is {size} bytes; the limit is {limit} bytes", code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


# Error types raised by the request models themselves (protocol.py) that are also the 400's `code`.
_CODED = {"unsupported_field", "unsupported_content", "unknown_field"}


def _describe(err: ValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code) of the first error; param is the field's path, e.g. "messages.0.content".

    NOTE: err.errors() builds a dict per error (seconds for 700k of them), so it is called once; and
    the request models keep the count small: every list fails fast (its first bad item ends it) and the
    lists with a limit are counted before their items are read (chat/protocol.py, `check_length`)."""
    errors = err.errors(include_url=False, include_input=False)
    first = errors[0]
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    parts = [str(p) for p in first.get("loc", ()) if p != "__root__"]
    if "field" in ctx:  # our own errors name the field inside the object that raised them
        parts.append(str(ctx["field"]))
    loc = ".".join(parts)
    msg = first.get("msg", "invalid value")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {ctx.get('error', msg)}", None, None
    if kind == "model_type" and not loc:
        return "the body must be a JSON object", None, None
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    more = len(errors) - 1
    suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more > 0 else ""
    code = kind if kind in _CODED else None
    return (f"{loc}: {msg}{suffix}" if loc else f"{msg}{suffix}"), (loc or None), code


def parse_model(model: type[M], body: bytes, settings: ServerSettings | None = None) -> M:
    """Validate a JSON body into `model`; any problem is a 400 naming the field. `settings` bound the
    lists that have a flag (`tools`, `stop_token_ids`, ...; their defaults without it)."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        parsed = model.model_validate_json(text, context={"settings": settings})
    except ValidationError as exc:
        message, param, code = _describe(exc)
        raise bad_request(message, param=param, code=code) from None
    except (RecursionError, ValueError) as exc:
        raise bad_request(f"the body could not be parsed: {exc}") from None
    _no_inf_nan(text)
    return parsed


def _no_inf_nan(text: str) -> None:
    """NaN and Infinity are not JSON: a typed number field refuses them itself, but one inside a free
    object (tool parameters, metadata, ...) would pass, and then every reply that echoes it fails to
    encode. Only a body that spells one of them anywhere is parsed again, strictly."""
    if "NaN" not in text and "Infinity" not in text:
        return
    try:
        from_json(text, allow_inf_nan=False)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc} (NaN and Infinity are not JSON numbers)") from None


_INLINE_BODY_BYTES = 64 * 1024
"""Bodies up to this size are validated on the event loop (well under a millisecond); larger ones in a thread."""


async def parse_model_off_loop(model: type[M], body: bytes, settings: ServerSettings | None = None) -> M:
    """parse_model, in a worker thread for a large body, so it never holds the event loop (other
    requests' tokens keep flowing while it is checked)."""
    if len(body) <= _INLINE_BODY_BYTES:
        return parse_model(model, body, settings)
    return await asyncio.to_thread(parse_model, model, body, settings)


async def read_model(request: Request, model: type[M], settings: ServerSettings) -> M:
    return await parse_model_off_loop(model, await read_body(request, settings.max_body_bytes), settings)


def request_id_from(request: Request, settings: ServerSettings) -> str:
    """The client's X-Request-Id if it is printable ASCII of sane length, else a fresh one."""
    rid = request.headers.get("x-request-id")
    if rid is None or rid == "":
        return uuid.uuid4().hex
    if len(rid) > settings.request_id_max_len:
        raise bad_request(f"X-Request-Id is {len(rid)} characters; at most {settings.request_id_max_len} are allowed",
                          param="X-Request-Id")
    if not all(33 <= ord(c) < 127 for c in rid):
        raise bad_request("X-Request-Id must be printable ASCII without spaces", param="X-Request-Id")
    return rid


def query_limit(request: Request, *, default: int = 20, most: int = 100) -> int:
    """A list route's `limit` query parameter: an integer in [1, most] (a 400 naming `limit` otherwise)."""
    raw = request.query_params.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"limit must be an integer, got {raw[:40]!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be in [1, {most}], got {limit}", param="limit")
    return limit
