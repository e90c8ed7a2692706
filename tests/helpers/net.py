"""Ports and waiting: what every test that talks to another process needs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
