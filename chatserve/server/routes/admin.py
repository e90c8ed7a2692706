"""Operating the server: `/health`, `/metrics`, `/debug/cache`, and cancelling a request by id.

The cancel endpoint answers with the request's final state (what it was doing when cancelled,
how many blocks it gave back), also for a request that already finished, so repeating a cancel
or cancelling late is not an error.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.context import get_context
from chatserve.server.errors import APIError, error_body


async def health(request: Request) -> JSONResponse:
    ctx = get_context(request)
    if not ctx.engine.is_healthy():
        return JSONResponse({"status": "unhealthy", "reason": "the engine loop died"}, status_code=503)
    if not ctx.accepting:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(get_context(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def debug_cache(request: Request) -> JSONResponse:
    """Checks the KV-cache invariants between steps; 200 with the engine's stats, or 500 naming the break."""
    ctx = get_context(request)
    loop_before = ctx.engine.loop_state()  # before the check, which itself wakes the loop
    try:
        await ctx.engine.check_integrity()
    except AssertionError as exc:
        return JSONResponse(error_body(500, f"KV cache integrity check failed: {exc}", code="integrity"), status_code=500)
    now = time.time()
    live = [{"id": rec.id, "age_s": round(now - rec.created, 3), "engine_ids": rec.engine_ids,
             "abort_reason": rec.abort_reason} for rec in list(ctx.tracker.live.values())[:100]]
    return JSONResponse({"ok": True, "stats": ctx.engine.stats(), "loop": loop_before,
                         "live_requests": len(ctx.tracker.live),
                         "oldest_live": sorted(live, key=lambda r: -r["age_s"])[:20]})


async def cancel_request(request: Request) -> JSONResponse:
    ctx = get_context(request)
    rid = request.path_params["request_id"]
    rec = ctx.tracker.get(rid)
    if rec is None:
        raise APIError(404, f"no request with id {rid!r} is running or finished recently", param="request_id",
                       code="request_not_found")
    if not rec.finished and rec.owner is not None:
        await rec.owner.cancel()
    return JSONResponse(rec.final_state())


def routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/requests/{request_id:str}/cancel", cancel_request, methods=["POST"]),
        Route("/v1/requests/{request_id:str}", cancel_request, methods=["DELETE"]),
        Route("/debug/cache", debug_cache, methods=["GET"]),
    ]


__all__ = ["routes"]
