"""`chatserve serve`: the OpenAI-compatible server with the default model unless told otherwise;
`chatserve cluster` (replicas behind vLLM's router) and `chatserve bench` (chatserve/bench/) too.

Every flag is generated from a dataclass field (`EngineArgs`, `ServerSettings`, `ServeOptions`), so a
default, its type and its help text live in one place and a new field gets its flag for free:

- `--field-name` spelled with dashes; `metadata["aliases"]` adds other spellings (vLLM's);
- the type comes from the annotation: int, float, str; bool is `--x/--no-x`; a `Literal` gives the
  choices; `X | None` is optional (the value `none`, or an empty one, sets None);
- `tuple[str, ...]`, or `metadata["nargs"] = "+"` on a str field, takes one value or several,
  space-separated (vLLM's `--served-model-name A B`): the field gets the list (its environment
  variable: the values split at whitespace);
- the default is `$CHATSERVE_<FIELD>` when set (parsed like the flag; a bad value is an error naming
  the variable), else the field's default; a flag on the command line wins over both.

This module and `EngineArgs.from_env` are where the environment is read: the engine's fields that
other variables fill ($TORCH_EXTENSIONS_DIR: --kernel-build-dir; $XDG_CACHE_HOME: --cache-dir) come
from `EngineArgs.from_env` over the parsed flags (`engine_args_from`), and nothing below reads it again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from chatserve.config import EngineArgs
from chatserve.server.settings import ServerSettings

logger = logging.getLogger("chatserve")


@dataclass(frozen=True)
class ServeOptions:
    """How the `serve` process runs: where it listens, where sessions live, logging, shutdown.

    Neither the engine nor the app reads these, so they belong to neither `EngineArgs` nor
    `ServerSettings`; a dataclass of their own gives them flags, env vars and help the same way.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    redis_url: str | None = field(default=None, metadata={
        "help": "Redis for sessions, e.g. redis://127.0.0.1:6379/0 (default: in-memory, not persisted)",
        "secret": True})
    log_level: Literal["debug", "info", "warning", "error"] = field(default="info", metadata={
        "help": "log level of chatserve and uvicorn", "aliases": ("--uvicorn-log-level",)})
    shutdown_grace_s: float = field(default=10.0, metadata={
        "help": "on SIGTERM, seconds running streams get to finish before they are aborted"})
    limit_concurrency: int | None = field(default=1024, metadata={
        "help": "most open connections (streams and idle keep-alive ones included); past it uvicorn answers new "
                "requests 503 at once (none: no limit)"})
    drain_notice_s: float = field(default=0.0, metadata={
        "help": "on SIGTERM, seconds /health answers 503 (draining) while the server still listens, before it "
                "stops accepting connections: a router's health check then moves new requests away first "
                "(new requests in that window get 503 + Retry-After)"})


def _flag_groups() -> tuple[tuple[str, type], ...]:
    """The dataclasses whose fields become flags, in --help order. A field name in two of them
    (served_model_name) is one flag whose value goes to both."""
    return (("model and engine (EngineArgs)", EngineArgs), ("server (ServerSettings)", ServerSettings),
            ("process (ServeOptions)", ServeOptions))


ENV_PREFIX = "CHATSERVE_"


class FlagSpec(NamedTuple):
    """What one dataclass field says about its flag."""

    name: str  # the field name, which is also the argparse dest
    kind: type  # int, float, str or bool
    optional: bool  # `X | None`
    choices: tuple[Any, ...] | None  # from a Literal
    default: Any
    help: str
    aliases: tuple[str, ...]
    secret: bool  # never echo its value (from the environment) in --help
    nargs: str | None = None  # "+": one value or several (a list)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


def flag_specs(cls: type) -> list[FlagSpec]:
    """One `FlagSpec` per field of the dataclass `cls`; an annotation we cannot spell as a flag is a
    TypeError at once (a new field must not silently lack its flag)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default; every option needs one to be a flag")
        tp, optional = hints[f.name], False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional = len(args) < len(typing.get_args(tp))
            if len(args) != 1:
                raise TypeError(f"{cls.__name__}.{f.name}: {tp} is not a flag type (one type, optionally | None)")
            tp = args[0]
        nargs = f.metadata.get("nargs")
        if typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, ...):
            tp, nargs = str, "+"
        choices = None
        if typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            tp = type(choices[0])
        if tp not in (int, float, str, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: {tp} is not a flag type (int, float, str, bool, Literal)")
        if "help" not in f.metadata:
            raise TypeError(f'{cls.__name__}.{f.name} has no metadata={{"help": ...}}; every flag needs a help text')
        if nargs not in (None, "+") or (nargs and tp is not str):
            raise TypeError(f'{cls.__name__}.{f.name}: nargs {nargs!r} (supported: "+", on a str field)')
        specs.append(FlagSpec(f.name, tp, optional, choices, f.default, f.metadata["help"],
                              tuple(f.metadata.get("aliases", ())), bool(f.metadata.get("secret", False)), nargs))
    return specs


def parse_value(spec: FlagSpec, text: str) -> Any:
    """A flag's or an environment variable's text as the field's type; ValueError says what was expected."""
    if spec.optional and (text.strip() == "" or (spec.kind is not str and text.strip().lower() == "none")):
        return None
    if spec.kind is bool:
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")
    try:
        value = spec.kind(text.strip()) if spec.kind is not str else text
    except ValueError:
        raise ValueError(f"expected {'an integer' if spec.kind is int else 'a number'}, got {text!r}") from None
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"expected one of {', '.join(map(str, spec.choices))}, got {text!r}")
    return value


def _argparse_type(spec: FlagSpec) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse_value(spec, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = spec.kind.__name__  # argparse names the type in some messages
    return convert


def _default(spec: FlagSpec, environ: Mapping[str, str]) -> tuple[Any, bool]:
    """(the flag's default, whether it came from the environment)."""
    text = environ.get(spec.env_var)
    if text is None:
        return spec.default, False
    try:
        if spec.nargs and text.strip() and text.strip().lower() != "none":
            return [parse_value(spec, word) for word in text.split()], True
        return parse_value(spec, text), True
    except ValueError as exc:
        raise ValueError(f"${spec.env_var}: {exc} (it sets the default of {spec.flag}; fix or unset it)") from None


def _help(spec: FlagSpec, default: Any, from_env: bool) -> str:
    """The field's help plus the effective default; argparse %-formats help, so '%' is escaped."""
    if spec.kind is bool:
        shown = "on" if default else "off"
    else:
        shown = None if default is None else " ".join(default) if isinstance(default, list) else str(default)
    if from_env:
        tail = f"default: from ${spec.env_var}" if spec.secret or shown is None else f"default: {shown} from ${spec.env_var}"
    else:
        tail = "" if shown is None else f"default: {shown}"
    text = spec.help + (f" [{tail}]" if tail else "")
    return text.replace("%", "%%")


def _add_flag(group: argparse._ArgumentGroup, spec: FlagSpec, environ: Mapping[str, str]) -> None:
    default, from_env = _default(spec, environ)
    names = [spec.flag, *spec.aliases]
    if spec.kind is bool:
        action = group.add_argument(*names, dest=spec.name, action=argparse.BooleanOptionalAction, default=default)
    else:
        # str: the field name's last word (--served-model-name NAME, --redis-url URL); numbers: N or X
        metavar = None if spec.choices else {int: "N", float: "X", str: spec.name.rsplit("_", 1)[-1].upper()}[spec.kind]
        action = group.add_argument(*names, dest=spec.name, type=_argparse_type(spec), default=default,
                                    choices=spec.choices, metavar=metavar, nargs=spec.nargs)
    action.help = _help(spec, default, from_env)  # set after: BooleanOptionalAction edits the help it is given


def _bytes_as_gib(text: str) -> float:
    """vLLM's `--kv-cache-memory-bytes` (plain bytes, or 8G / 512M: K, M, G, T are powers of 1024 and
    k, m, g, t of 1000, as in vLLM) as our `kv_cache_memory_gb`, which is in GiB."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    s = text.strip()
    scale = units.get(s[-1:], 1)
    try:
        num = float(s[:-1] if scale != 1 else s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 8589934592 or 8G, got {text!r}") from None
    return int(num * scale) / 2**30


def _add_serve_args(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the same as --model, as in `vllm serve MODEL` (wins over --model)")
    seen: set[str] = set()
    for title, cls in _flag_groups():
        g = p.add_argument_group(title)
        for spec in flag_specs(cls):
            if spec.name not in seen:
                seen.add(spec.name)
                _add_flag(g, spec, environ)
        if cls is EngineArgs:
            # NOTE: default SUPPRESS, so the namespace's kv_cache_memory_gb default is the flag above's.
            g.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory_gb", type=_bytes_as_gib,
                           default=argparse.SUPPRESS, metavar="BYTES",
                           help="vLLM's spelling of --kv-cache-memory-gb, in bytes (8G = 8 GiB, 8g = 8e9 bytes)")


async def _over_connection_limit(scope: Any, receive: Any, send: Any) -> None:
    """uvicorn's answer past --limit-concurrency, in OpenAI's error shape instead of plain text."""
    import json

    body = json.dumps({"error": {
        "message": "the server has as many open connections as --limit-concurrency allows; retry shortly",
        "type": "service_unavailable_error", "param": None, "code": "too_many_connections"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _json_over_connection_limit() -> None:
    """uvicorn names the app it runs past `limit_concurrency` in each HTTP protocol module; ours answers
    in OpenAI's shape (a module this uvicorn lacks is skipped)."""
    import importlib

    for name in ("h11_impl", "httptools_impl"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
            if hasattr(module, "service_unavailable"):
                module.service_unavailable = _over_connection_limit


def _server_class(ctx: Any, grace_s: float, notice_s: float = 0.0) -> type:
    import uvicorn
    from sse_starlette.sse import AppStatus

    # NOTE: sse-starlette would cut every stream the moment SIGTERM arrives; we drain them ourselves.
    AppStatus.disable_automatic_graceful_drain()
    _json_over_connection_limit()

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
            ctx.accepting = False  # /health is 503 and new requests are refused from here on
            if notice_s > 0:  # still listening, so a router's health check sees "draining", not a dead socket
                await asyncio.sleep(notice_s)
            for server in self.servers:
                server.close()  # no new connections from here on
            await ctx.drain(grace_s)
            AppStatus.should_exit = True  # backstop: any SSE response still open ends now
            await super().shutdown(sockets)

    return Server


_CLUSTER_HELP = "start N replicas behind vllm-router, sharing one Redis"
_BENCH_HELP = "benchmarks: serve (online, over HTTP), latency and throughput (offline)"


def build_parser(environ: Mapping[str, str] | None = None, command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with flag defaults taken from `environ` (default: os.environ); passing it in lets
    tests try environments without touching the process's own. `command="serve"`: the other commands'
    flags are left out (their modules import httpx, rich and the bench datasets: a tenth of a second of
    every server start); `chatserve --help` still lists them.

    Raises ValueError naming the variable when a `$CHATSERVE_<FIELD>` does not parse.
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="chatserve", description="chatserve: streaming LLM chat inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        description="Start the OpenAI-compatible HTTP server.",
        epilog=f"Every flag's default can be set with ${ENV_PREFIX}<FLAG> in upper case with underscores "
               f"(--max-num-seqs: ${ENV_PREFIX}MAX_NUM_SEQS; booleans 1/0, true/false, yes/no, on/off; an empty "
               "value, or none, unsets an optional one); a flag on the command line wins over the environment.",
    )
    _add_serve_args(serve, environ)
    if command == "serve":
        sub.add_parser("cluster", help=_CLUSTER_HELP)
        sub.add_parser("bench", help=_BENCH_HELP)
        return parser
    _add_cluster_args(sub)
    _add_bench_args(sub, environ)
    return parser


def _add_engine_args(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Every EngineArgs flag of `serve` (and its $CHATSERVE_<FIELD> default), for the offline benchmarks."""
    g = p.add_argument_group("model and engine (EngineArgs)")
    for spec in flag_specs(EngineArgs):
        _add_flag(g, spec, environ)


def _add_bench_args(sub: Any, environ: Mapping[str, str]) -> None:
    """`chatserve bench serve|latency|throughput`, vLLM's `vllm bench` (chatserve/bench/)."""
    from chatserve.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help=_BENCH_HELP,
                           description="Benchmarks in the shape of `vllm bench`: `serve` against a running server "
                                       "(this one or any OpenAI-compatible one), `latency` and `throughput` in-process.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,latency,throughput}")
    p = kinds.add_parser("serve", help="online serving benchmark against a running server (vllm bench serve)",
                         description=(serve.__doc__ or "").split("\n\n")[0])
    serve.add_cli_args(p)
    p.set_defaults(bench_main=serve.main, bench_check=serve.check_args, bench_parser=p)
    for name, module, what in (("latency", latency, "latency of one batch, in-process (vllm bench latency)"),
                               ("throughput", throughput, "offline throughput, in-process (vllm bench throughput)")):
        p = kinds.add_parser(name, help=what, description=(module.__doc__ or "").split("\n\n")[0])
        _add_engine_args(p, environ)
        module.add_cli_args(p)  # after the engine flags: it may change their defaults (latency: no prefix cache)
        p.set_defaults(bench_main=module.main, bench_check=module.check_args, bench_parser=p)


def _add_cluster_args(sub: Any) -> None:
    """`chatserve cluster [options] [-- serve flags]`: replicas behind vLLM's router (chatserve/cluster.py)."""
    from typing import get_args

    from chatserve.cluster import ClusterSpec, RouterPolicy

    d = ClusterSpec()
    cluster = sub.add_parser(
        "cluster", help=_CLUSTER_HELP,
        description="Start Redis (if none answers at --redis-url), N `chatserve serve` replicas on consecutive "
                    "ports and vllm-router in front of them; Ctrl-C or SIGTERM stops every one of them.",
        epilog="Flags after `--` go to every replica, e.g. `chatserve cluster --replicas 2 -- --dtype float32`.")
    cluster.add_argument("--replicas", type=int, default=d.replicas, help=f"replica count [default: {d.replicas}]")
    cluster.add_argument("--host", default=d.host, help=f"address of the router and replicas [default: {d.host}]")
    cluster.add_argument("--port", type=int, default=d.router_port, help=f"the router's port [default: {d.router_port}]")
    cluster.add_argument("--first-replica-port", type=int, default=d.first_replica_port,
                         help=f"port of replica 0; replica i listens on this + i [default: {d.first_replica_port}]")
    cluster.add_argument("--policy", choices=get_args(RouterPolicy), default=d.policy,
                         help="vllm-router's policy: cache_aware needs nothing more; sticky_least_loaded keys on "
                              "the X-Session-Id header; kv_aware follows each replica's KV cache events (two ZMQ "
                              f"ports per replica from --kv-events-first-port) [default: {d.policy}]")
    cluster.add_argument("--kv-events-first-port", type=int, default=d.kv_events_first_port,
                         help="kv_aware: replica i publishes KV events on this + 2i and answers replays on this + "
                              f"2i + 1 [default: {d.kv_events_first_port}]")
    cluster.add_argument("--redis-url", default=d.redis_url, help=f"shared Redis [default: {d.redis_url}]")
    cluster.add_argument("--threads-per-replica", type=int, default=None,
                         help="torch threads per replica [default: cores / replicas]")
    cluster.add_argument("--log-dir", type=Path, default=None, help="one log file per process here [default: stdout]")
    cluster.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                         help="web origins (scheme://host[:port]) whose pages may call the cluster: the replicas' "
                              "--allowed-origins (besides the router's own origin) and the router's CORS origins "
                              "[default: none]")
    cluster.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for every replica")


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse the command line; the positional MODEL of `serve` (vLLM's spelling) lands in `model`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # (the first positional: the command)
    args = build_parser(environ, command="serve" if command == "serve" else None).parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    if getattr(args, "bench_check", None) is not None:  # what argparse cannot check flag by flag
        args.bench_check(args, args.bench_parser)
    return args


def options_from_args(cls: type, args: argparse.Namespace) -> Any:
    """`cls(**fields)` from the parsed namespace: every field has a flag of the same dest."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def engine_args_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EngineArgs:
    """The engine's options from the parsed flags, with the fields they leave unset (None) that other
    variables fill taken from `environ` (`EngineArgs.from_env`: --kernel-build-dir from
    $TORCH_EXTENSIONS_DIR, --cache-dir from $XDG_CACHE_HOME/chatserve)."""
    return EngineArgs.from_env(environ, **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)})


def _prefetch_tokenizer(engine_args: EngineArgs) -> None:
    """Start reading a GGUF's saved tokenizer now, beside the engine's imports (models/prefetch.py); a
    model that cannot be resolved is reported by the engine's own load, not here."""
    try:
        from chatserve.models.loader import resolve_model
        from chatserve.models.prefetch import prefetch_tokenizer

        prefetch_tokenizer(resolve_model(engine_args.model, engine_args.cache_dir))
    except (ValueError, OSError):
        pass


def serve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    options: ServeOptions = options_from_args(ServeOptions, args)
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = options_from_args(ServerSettings, args)
        if settings.instance_id is None:
            settings = dataclasses.replace(settings, instance_id=f"{options.host}:{options.port}")
        engine_args = engine_args_from(args, environ)
    except (ValueError, FileNotFoundError) as exc:
        print(f"chatserve: {exc}", file=sys.stderr)
        return 2
    _prefetch_tokenizer(engine_args)
    import uvicorn

    from chatserve.engine.async_engine import AsyncLLMEngine
    from chatserve.server import create_app
    from chatserve.sessions import make_session_store

    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"chatserve: {exc}", file=sys.stderr)
        return 2
    sessions = make_session_store(options.redis_url)
    cancel_bus = None
    if options.redis_url:
        from chatserve.server.cancel_bus import CancelBus

        cancel_bus = CancelBus(options.redis_url)
    app = create_app(engine, sessions, settings, cancel_bus, bind_host=options.host)
    url = f"http://{options.host}:{options.port}"
    print(f"chatserve: serving {app.state.ctx.model_name} at {url}  (web client: {url}/ , API: {url}/v1)", flush=True)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=5,  # after our own drain (see _server_class)
        timeout_keep_alive=30,
        limit_concurrency=options.limit_concurrency,
    )
    _server_class(app.state.ctx, options.shutdown_grace_s, options.drain_notice_s)(config).run()
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    try:
        args = parse_args(argv, environ)
    except ValueError as exc:  # a bad $CHATSERVE_<FIELD>
        print(f"chatserve: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(args, environ)
    if args.command == "cluster":
        return cluster(args)
    if args.command == "bench":
        return int(args.bench_main(args))
    return 2


def cluster(args: argparse.Namespace) -> int:
    from chatserve.cluster import ClusterSpec, serve_cluster

    serve_args = tuple(a for i, a in enumerate(args.serve_args) if not (i == 0 and a == "--"))
    spec = ClusterSpec(replicas=args.replicas, host=args.host, router_port=args.port,
                       first_replica_port=args.first_replica_port, policy=args.policy, redis_url=args.redis_url,
                       threads_per_replica=args.threads_per_replica, serve_args=serve_args, log_dir=args.log_dir,
                       kv_events_first_port=args.kv_events_first_port, allowed_origins=tuple(args.allowed_origins))
    try:
        return serve_cluster(spec)
    except RuntimeError as exc:
        print(f"chatserve cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
