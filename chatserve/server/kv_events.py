"""What vLLM's router asks a worker before routing by KV events: `GET /get_server_info` and
`GET /kv_event_sources` (vLLM's names and shapes).

The router's `kv_aware` policy subscribes to each worker's KV event stream (blocks stored and
removed, engine/kv_event_publisher.py) and must know the worker's block size to hash prompts the
same way. `/get_server_info` says who this worker is and its block size; `/kv_event_sources`
says where its events are published, keyed by data-parallel rank (one engine: rank "0"), and is
empty when events are off (`--kv-events-endpoint` unset).

A publisher bound to every interface (`tcp://*:5557`) is advertised at the host name the caller
used to reach this server: that is the address the router can connect to (it refuses wildcards).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatserve.server.context import get_context

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def connect_address(endpoint: str, host: str | None) -> str:
    """``endpoint`` with a wildcard bind host replaced by ``host`` (the one the caller reached us at)."""
    bind_host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if bind_host in _WILDCARD_HOSTS and host:
        return f"tcp://{host}:{port}"
    return endpoint


async def get_server_info(request: Request) -> JSONResponse:
    ctx = get_context(request)
    engine = ctx.engine
    instance = ctx.settings.instance_id or f"{request.url.hostname}:{request.url.port}"
    return JSONResponse({
        "model_id": ctx.model_name,
        "model_path": ctx.model_name,
        "instance_id": instance,
        "worker_type": "regular",
        "kv_block_size": engine.block_size,
        "effective_attention_block_size": engine.block_size,
        "max_model_len": engine.max_model_len,
        "enable_kv_cache_events": engine.kv_events_config is not None,
    })


async def kv_event_sources(request: Request) -> JSONResponse:
    cfg = get_context(request).engine.kv_events_config
    if cfg is None:
        return JSONResponse({})
    host = request.url.hostname
    return JSONResponse({"0": {
        "publisher": "zmq",
        "enable_kv_cache_events": True,
        "endpoint": connect_address(cfg.endpoint, host),
        "replay_endpoint": connect_address(cfg.replay_endpoint, host) if cfg.replay_endpoint else None,
        "topic": cfg.topic,
        "hwm": cfg.hwm,
        "buffer_steps": cfg.buffer_steps,
    }})


def routes() -> list[Route]:
    return [
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
    ]
