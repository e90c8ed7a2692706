"""`chatserve cluster`: N replicas behind vLLM's router (`vllm-router`), sharing one Redis.

We do not write a router. vLLM's Rust router already fronts chatserve unchanged: its
`sticky_least_loaded` policy keeps a session on its replica by the `X-Session-Id` header, and
its default `cache_aware` policy places requests by the token ids our `/v1/chat/completions/render`
returns (server/openai/tokens.py), and its `kv_aware` policy by the KV blocks each replica reports
holding (KV cache events over ZMQ, engine/kv_event_publisher.py). What this module adds is the
launch: Redis if none answers, the replicas on consecutive ports (each a `chatserve serve`
process, with its KV event sockets under kv_aware), the router in front with
health checks tight enough that a dead replica leaves rotation within a few seconds, and a stop
that reaches every process it started, by PID, whatever way the launcher exits.

Replicas share nothing but Redis: session histories live there (a session whose replica dies
continues on another one, as a cache miss), and so do cancels (server/cancel_bus.py), so a
cancel may land on any replica.

Browsers: the router forwards a request's `Origin` but rewrites its `Host` to the replica's
address, so each replica allows the router's own origin (and, on a loopback host, its localhost
spellings) besides `--allowed-origins`, which also become the router's CORS origins
(`--cors-allowed-origins`, all vllm-router 0.1.17 offers: it has no Host check of its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import httpx

RouterPolicy = Literal["cache_aware", "sticky_least_loaded", "round_robin", "power_of_two", "consistent_hash",
                       "random", "kv_aware"]


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. `serve_args` go to every replica (model, dtype, threads, ...)."""

    replicas: int = 2
    host: str = "127.0.0.1"
    router_port: int = 8000
    first_replica_port: int = 8001
    policy: RouterPolicy = "cache_aware"
    redis_url: str = "redis://127.0.0.1:6379/0"
    threads_per_replica: int | None = None  # torch threads per replica (default: cores / replicas)
    serve_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    health_check_interval_s: int = 1
    health_failure_threshold: int = 2
    log_dir: Path | None = None  # one log file per process; None: inherit the launcher's output
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    kv_events: bool | None = None  # replicas publish KV events; None: only under the kv_aware policy
    kv_events_first_port: int = 5557  # replica i publishes on this + 2i and serves replays on this + 2i + 1
    allowed_origins: tuple[str, ...] = ()  # web origins besides the router's own (the replicas' --allowed-origins)

    def replica_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.first_replica_port + i}" for i in range(self.replicas)]

    @property
    def publishes_kv_events(self) -> bool:
        return self.policy == "kv_aware" if self.kv_events is None else self.kv_events

    def kv_event_endpoints(self, i: int) -> tuple[str, str]:
        """Replica i's KV event PUB address and its replay address (what it binds, what the router connects to)."""
        port = self.kv_events_first_port + 2 * i
        return f"tcp://{self.host}:{port}", f"tcp://{self.host}:{port + 1}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    def router_origins(self) -> list[str]:
        """The origins a page served through the router has: its URL, and on a loopback host the
        other loopback spellings of it."""
        from chatserve.server.middleware import is_loopback_host

        hosts = [self.host]
        if is_loopback_host(self.host):
            hosts += [h for h in ("127.0.0.1", "localhost", "[::1]") if h != self.host]
        return [f"http://{h}:{self.router_port}" for h in hosts]


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


@dataclass
class Cluster:
    """The running processes, by name ("redis", "replica-0", ..., "router")."""

    spec: ClusterSpec
    processes: dict[str, Process] = field(default_factory=dict)

    def replica(self, i: int) -> Process:
        return self.processes[f"replica-{i}"]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.processes[name]
        if p.proc.poll() is None:
            p.proc.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to every process we started (router first, Redis last), SIGKILL to any still up."""
        order = sorted(self.processes.values(), key=lambda p: (p.name != "router", p.name == "redis"))
        for p in order:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)


def router_command(spec: ClusterSpec, prometheus_port: int) -> list[str]:
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    return [exe, "--host", spec.host, "--port", str(spec.router_port), "--policy", spec.policy,
            "--worker-urls", *spec.replica_urls(),
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(spec.health_check_interval_s),
            "--health-failure-threshold", str(spec.health_failure_threshold),
            "--health-success-threshold", "1",
            "--health-check-timeout-secs", "2",
            "--worker-startup-check-interval", "1",
            "--worker-startup-timeout-secs", str(int(spec.startup_timeout_s)),
            "--prometheus-host", spec.host, "--prometheus-port", str(prometheus_port),
            "--request-id-headers", "x-request-id",
            *(("--cors-allowed-origins", *spec.allowed_origins) if spec.allowed_origins else ()),
            *(kv_event_router_args(spec) if spec.policy == "kv_aware" else ()),
            *spec.router_args]


def kv_event_router_args(spec: ClusterSpec) -> list[str]:
    """kv_aware's static event sources: each replica's PUB and replay addresses, with the block size
    and model the replicas report (`GET /get_server_info`; the replicas must be up).

    Static, because vllm-router 0.1.17 discovers sources by itself only from vLLM's own
    `vllm_config` in /get_server_info, which chatserve does not imitate."""
    if not spec.publishes_kv_events:
        raise RuntimeError("the kv_aware policy needs replicas that publish KV events (kv_events=False)")
    info = httpx.get(f"{spec.replica_urls()[0]}/get_server_info", timeout=10).json()
    args = ["--kv-event-block-size", str(info["kv_block_size"]), "--kv-event-model", str(info["model_id"])]
    for i, url in enumerate(spec.replica_urls()):
        pub, replay = spec.kv_event_endpoints(i)
        args += ["--kv-event-source", f"{url}={pub}", "--kv-event-replay-source", f"{url}={replay}"]
    return args


def replica_command(spec: ClusterSpec, i: int) -> list[str]:
    threads = spec.threads_per_replica or max(1, (os.cpu_count() or 1) // spec.replicas)
    # Draining, a replica keeps answering /health with 503 for as long as the router needs to see it
    # (its interval x failure threshold, plus one), so new requests move away before the socket closes.
    notice_s = spec.health_check_interval_s * spec.health_failure_threshold + 1
    kv_events: list[str] = []
    if spec.publishes_kv_events:
        pub, replay = spec.kv_event_endpoints(i)
        kv_events = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
    if any(a == "--allowed-origins" or a.startswith("--allowed-origins=") for a in spec.serve_args):
        raise RuntimeError("give --allowed-origins to `chatserve cluster` itself (before `--`): the replicas and the "
                           "router's CORS settings both need it")
    origins = [*spec.router_origins(), *spec.allowed_origins]
    return [sys.executable, "-m", "chatserve", "serve", "--host", spec.host,
            "--port", str(spec.first_replica_port + i), "--redis-url", spec.redis_url,
            "--allowed-origins", *origins,  # (before a flag: a positional MODEL in serve_args must not join the list)
            "--num-threads", str(threads), "--drain-notice-s", str(notice_s), *kv_events, *spec.serve_args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (e.g. for the router's Prometheus listener: it has no "pick one" value)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def consecutive_free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A port p with p .. p + count - 1 all free now (replicas listen on consecutive ports)."""
    for _ in range(100):
        first = free_port(host)
        try:
            for offset in range(1, count):
                with socket.socket() as sock:
                    sock.bind((host, first + offset))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _redis_answers(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _wait_answering(url: str, proc: Process, deadline: float) -> None:
    """Until GET `url` is a 200 (a replica's /health, the router's /v1/models once it forwards);
    fails at once, with the process's log, if the process exits. One client for the whole wait
    (`httpx.get` builds a client, and with it an SSL context, per call); no keep-alive, so each
    poll is a new connection, as a fresh process's first request is."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(0.25)
    raise RuntimeError(f"{proc.name} did not answer at {url}:\n{proc.log()[-3000:]}")


@contextlib.contextmanager
def run_cluster(spec: ClusterSpec) -> Iterator[Cluster]:
    """Start everything, wait until the router answers, yield; stop everything on the way out."""
    cluster = Cluster(spec)
    env = {**os.environ, **spec.env}
    logs: list[IO[bytes]] = []

    def start(name: str, args: Sequence[str]) -> Process:
        log_path = spec.log_dir / f"{name}.log" if spec.log_dir else None
        out: IO[bytes] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "wb")  # noqa: SIM115 - closed after the processes stop
            logs.append(out)
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
        cluster.processes[name] = Process(name, proc, log_path)
        return cluster.processes[name]

    try:
        if not _redis_answers(spec.redis_url):
            redis_server = shutil.which("redis-server")
            if redis_server is None:
                raise RuntimeError(f"no Redis answers at {spec.redis_url} and redis-server is not installed")
            port = httpx.URL(spec.redis_url.replace("redis://", "http://")).port or 6379
            redis = start("redis", [redis_server, "--port", str(port), "--bind", spec.host, "--save", "",
                                    "--appendonly", "no"])
            deadline = time.monotonic() + 20
            while not _redis_answers(spec.redis_url):
                if redis.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start:\n{redis.log()[-2000:]}")
                time.sleep(0.05)
        deadline = time.monotonic() + spec.startup_timeout_s
        for i in range(spec.replicas):
            start(f"replica-{i}", replica_command(spec, i))
        for i, url in enumerate(spec.replica_urls()):
            _wait_answering(f"{url}/health", cluster.replica(i), deadline)
        router = start("router", router_command(spec, free_port(spec.host)))
        _wait_answering(f"{spec.router_url}/v1/models", router, deadline)  # up once it forwards
        yield cluster
    finally:
        cluster.stop()
        for fh in logs:
            fh.close()


def serve_cluster(spec: ClusterSpec) -> int:
    """The `chatserve cluster` command: start, print where, run until SIGINT/SIGTERM, stop all."""
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with run_cluster(spec) as cluster:
        print(f"chatserve cluster: {spec.replicas} replicas behind vllm-router ({spec.policy}) at "
              f"{spec.router_url}/v1  (replicas: {', '.join(spec.replica_urls())}; redis: {spec.redis_url})",
              flush=True)
        while not stop["now"]:
            for p in cluster.processes.values():
                if p.proc.poll() is not None and p.name in ("router", "redis"):
                    print(f"chatserve cluster: {p.name} exited with {p.proc.returncode}; stopping", flush=True)
                    return 1
            time.sleep(0.5)
    return 0
