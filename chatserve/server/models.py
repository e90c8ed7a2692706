"""`GET /v1/models` and `GET /v1/models/{id}`: the served names, in the shape the client speaks.

One model, possibly under several names (`--served-model-name A B`). OpenAI's clients get OpenAI's
list; a request that carries `anthropic-version` (every Anthropic SDK and Claude Code send it) gets
Anthropic's (`type: "model"`, `display_name`, `created_at`, the window as `max_input_tokens` /
`max_tokens`, and `has_more` / `first_id` / `last_id` paging by `limit`, `after_id`, `before_id`).
An unknown id is a 404 in that client's error shape.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.anthropic.errors import anthropic_errors
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, bad_request
from chatserve.server.http_input import query_limit


def _anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def openai_model(ctx: ServerContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": ctx.started_at, "owned_by": "chatserve",
            "max_model_len": ctx.max_model_len}


def anthropic_model(ctx: ServerContext, name: str) -> dict[str, Any]:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.started_at))
    # the window less the one token a reply needs at least; a reply may fill what the prompt leaves
    room = ctx.max_model_len - 1
    return {"type": "model", "id": name, "display_name": name, "created_at": created, "max_input_tokens": room,
            "max_tokens": room}


@anthropic_errors
async def _anthropic_list(request: Request) -> Response:
    ctx = get_context(request)
    names = list(ctx.served_model_names)
    after, before = request.query_params.get("after_id"), request.query_params.get("before_id")
    for cursor, param in ((after, "after_id"), (before, "before_id")):
        if cursor is not None and cursor not in names:
            raise bad_request(f"{param} {cursor[:100]!r} is not a model id of this server", param=param)
    start = names.index(after) + 1 if after is not None else 0
    end = names.index(before) if before is not None else len(names)
    window = names[start:end]
    page = window[:query_limit(request, most=1000)]
    return JSONResponse({"data": [anthropic_model(ctx, n) for n in page], "has_more": len(window) > len(page),
                         "first_id": page[0] if page else None, "last_id": page[-1] if page else None})


@anthropic_errors
async def _anthropic_get(request: Request) -> Response:
    ctx = get_context(request)
    return JSONResponse(anthropic_model(ctx, _known(ctx, request.path_params["model_id"])))


def _known(ctx: ServerContext, name: str) -> str:
    if name not in ctx.served_model_names:
        raise APIError(404, f"model: {name[:200]}", param="model_id", code="model_not_found")
    return name


async def list_models(request: Request) -> Response:
    """One entry per served name, the name replies report first."""
    if _anthropic(request):
        return await _anthropic_list(request)
    ctx = get_context(request)
    return JSONResponse({"object": "list", "data": [openai_model(ctx, n) for n in ctx.served_model_names]})


async def get_model(request: Request) -> Response:
    if _anthropic(request):
        return await _anthropic_get(request)
    ctx = get_context(request)
    return JSONResponse(openai_model(ctx, _known(ctx, request.path_params["model_id"])))


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    ]


__all__ = ["routes"]
