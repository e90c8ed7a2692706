"""Ports and waiting: what every test that talks to another process needs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")

# One client for the tests' one-off requests (use it where a test would call `httpx.get`, `post` or
# `stream`): each of those builds a client, and with it an SSL context that parses the certifi
# bundle (~25 ms; ~30 s of the suite's test time at ~1,200 calls). No keep-alive: every request opens
# its own connection, as `httpx.get` does, so a server killed and restarted on the same port is never
# reached through a connection to the dead one. Thread-safe (httpx's pool), so bursts may share it.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], T], timeout: float = 30.0, what: str = "the condition",
               interval: float = 0.05) -> T:
    """Poll `cond` until it returns something truthy and return that; fail after `timeout` s.

    A deadline, not a fixed sleep: the test is as fast as the machine allows and still fails
    (naming `what`) instead of hanging when the condition never comes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
