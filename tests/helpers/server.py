"""Start a real `chatserve serve` process on 127.0.0.1 and a free port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from . import prefork
from .net import HTTP, free_port

ROOT = Path(__file__).resolve().parents[2]
# The API key of the session-wide shared server (the `shared_server` fixture in tests/conftest.py).
SHARED_API_KEY = "shared-server-key"


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen | prefork.ForkedProcess
    log_path: Path
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Prometheus text parsed into {name{labels}: value}, and {name: value} for unlabelled-by-us ones."""
        text = HTTP.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
            base = re.sub(r'\{model_name="[^"]*"\}$', "", name)
            out.setdefault(base, float(value))
        return out

    def gauge(self, name: str) -> float:
        return self.metrics()[f"chatserve:{name}"]

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits; returns the metrics seen last."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["chatserve:num_requests_running"] == 0 and m["chatserve:num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: running={m['chatserve:num_requests_running']} "
                                     f"waiting={m['chatserve:num_requests_waiting']}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(*extra_args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0, log_path: Path | None = None,
                 real_process: bool = False) -> ServerProcess:
    """`python -m chatserve serve` with `extra_args`, once /health answers 200.

    A fork of the worker's warm forkserver (tests/helpers/prefork.py: the imports done once), or with
    `real_process` (or an environment that differs in what is read at import) a new interpreter.
    Its output goes to `log_path` (a temporary file by default), so a failure can show it.
    The environment is offline and has no CHATSERVE_API_KEY: only `api_key` sets one.
    """
    port = free_port()
    log = log_path or Path(tempfile.mkstemp(prefix="chatserve-server-", suffix=".log")[1])
    args = [sys.executable, "-m", "chatserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env.pop("CHATSERVE_API_KEY", None)
    log.write_bytes(b"")
    proc = prefork.start(args[1:], env=full_env, cwd=ROOT, stdout=log, real=real_process)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, proc, log, api_key, args)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if HTTP.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in {startup_timeout}s:\n{server.log()[-4000:]}")
