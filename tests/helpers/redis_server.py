"""A throwaway redis-server of the test's own, for outages: kill it, freeze it, restart it.

Tests that only need *a* Redis use the shared one on 127.0.0.1:6379; these are for tests that
must break Redis without disturbing anyone else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import redis

from .net import free_port

REDIS_SERVER = shutil.which("redis-server")


def redis_answers(url: str) -> bool:
    """True when a Redis at `url` answers PING within half a second."""
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def redis_for_tests() -> Iterator[str]:
    """A Redis URL to test against: $CHATSERVE_TEST_REDIS_URL or the running one if it answers, else a
    redis-server of our own for as long as the generator runs (tests skip with neither)."""
    import pytest

    url = os.environ.get("CHATSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_answers(url):
        yield url
        return
    if REDIS_SERVER is None:
        pytest.skip(f"no Redis answers at {url} and redis-server is not installed")
    server = RedisProcess()
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


class RedisProcess:
    """redis-server on a port of its own, without persistence; `start` again after `kill` reuses
    the port, so clients configured with `url` reconnect to the new process."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not redis_answers(self.url):
            assert self.proc.poll() is None, "redis-server exited at startup"
            assert time.monotonic() < deadline, f"redis-server did not answer within {timeout:g} s"
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test froze it
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (timeouts, not refusals)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
