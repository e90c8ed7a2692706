"""Operating the server: `/health`, `/metrics`, `/v1/cache/stats`, `/debug/cache`, and cancelling a request by id.

The cancel endpoint answers with the request's final state (what it was doing when cancelled,
how many blocks it gave back), also for a request that already finished, so repeating a cancel
or cancelling late is not an error. Behind a router, a cancel for a request another replica holds
is passed to it over Redis (cancel_bus.py).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.cancel_bus import CancelBusUnavailable
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


async def cache_stats(request: Request) -> JSONResponse:
    """The KV pool and the prefix cache in numbers the web page's cache panel shows: the same
    snapshot (and the same usage formula) as the `chatserve:kv_cache_*` and prefix-cache metrics."""
    s = get_context(request).engine.stats()
    total = int(s.get("num_total_blocks", 0))
    free = int(s.get("num_free_blocks", 0))
    cached = int(s.get("num_cached_blocks", 0))
    used = max(total - free - cached, 0)
    queries = int(s.get("prefix_cache_queries_tokens", 0))
    hits = int(s.get("prefix_cache_hits_tokens", 0))
    return JSONResponse({
        "object": "cache.stats",
        "total_blocks": total,
        "free_blocks": free,
        "cached_blocks": cached,
        "used_blocks": used,
        "kv_cache_usage_perc": used / max(total, 1),
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefill_tokens_computed": int(s.get("num_prefill_tokens_computed", 0)),
        "num_running": int(s.get("num_running", 0)),
        "num_waiting": int(s.get("num_waiting", 0)),
    })


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
    state = await ctx.tracker.cancel(rid)
    if state is None and ctx.cancel_bus is not None:  # behind a router: maybe another replica holds it
        try:
            state = await ctx.cancel_bus.cancel_remote(rid)
        except CancelBusUnavailable as exc:
            raise APIError(503, f"request {rid!r} is not on this replica and the other replicas cannot be asked "
                                f"right now (Redis: {exc})", code="cancel_bus_unavailable") from None
    if state is None:
        raise APIError(404, f"no request with id {rid!r} is running or finished recently", param="request_id",
                       code="request_not_found")
    return JSONResponse(state)


def routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/requests/{request_id:str}/cancel", cancel_request, methods=["POST"]),
        Route("/v1/requests/{request_id:str}", cancel_request, methods=["DELETE"]),
        Route("/debug/cache", debug_cache, methods=["GET"]),
        Route("/v1/cache/stats", cache_stats, methods=["GET"]),
    ]


__all__ = ["routes"]
