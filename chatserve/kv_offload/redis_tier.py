"""The Redis tier: blocks shared by every replica of the same model, bounded by a TTL and a size.

Keys: ``<prefix><fingerprint hex>:<key hex>`` hold one entry each, with an expiry (``ttl_s``,
refreshed by each read). A sorted set ``<prefix><fingerprint hex>:lru`` scores each key by its
last write or read; after a write, members older than the TTL are dropped from it and, while it
holds more than ``max_bytes`` worth of entries (every block of one model has the same size, so a
byte bound is a count bound), the oldest keys are deleted: least recently used out, across
replicas. Redis's own ``maxmemory`` policy stays the last line of defence.

Redis down or slow: every command has a short socket timeout; a failure marks the tier down for
``retry_after_s`` seconds, during which reads miss at once and writes are dropped (counted). The
engine continues on memory and disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from .tier import Tier

__all__ = ["RedisTier"]

logger = logging.getLogger(__name__)

_ERRORS = (redis.RedisError, OSError)


class RedisTier(Tier):
    name = "redis"

    def __init__(
        self, url: str, *, prefix: str = "chatserve:kv:", ttl_s: float = 3600.0, max_bytes: int = 4 << 30,
        timeout_s: float = 0.5, retry_after_s: float = 5.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"kv_offload_redis_ttl_s must be > 0, got {ttl_s}")
        if max_bytes <= 0:
            raise ValueError(f"kv_offload_redis_max_gb must be > 0, got {max_bytes} bytes")
        self.url = url
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_bytes = int(max_bytes)
        self.retry_after_s = retry_after_s
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.write_errors = 0
        self.read_errors = 0
        self.num_evicted = 0
        self.num_rejected = 0

    def _key(self, name: str) -> str:
        fp, key = name.split("/")
        return f"{self.prefix}{fp}:{key}"

    def _lru_key(self, name: str) -> str:
        return f"{self.prefix}{name.split('/')[0]}:lru"

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:  # (logs the URL without its password)
        with self._lock:
            first = self.available()
            self._down_until = time.monotonic() + self.retry_after_s
        if first:
            logger.warning("KV Redis tier %s: %s failed (%s); skipping Redis for %.0fs", _without_password(self.url), what, exc,
                           self.retry_after_s)

    def get_run(self, names: Sequence[str]) -> list[bytes]:
        if not names or not self.available():
            return []
        keys = [self._key(n) for n in names]
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            present = pipe.execute()
            run = 0
            while run < len(keys) and present[run]:
                run += 1
            if run == 0:
                return []
            values: list[Any] = self.client.mget(keys[:run])
            out: list[bytes] = []
            for v in values:
                if v is None:
                    break  # expired between the two calls
                out.append(bytes(v))
            if out:
                now = time.time()
                pipe = self.client.pipeline(transaction=False)
                for k in keys[: len(out)]:
                    pipe.pexpire(k, self.ttl_ms)
                pipe.zadd(self._lru_key(names[0]), {k: now for k in keys[: len(out)]})
                pipe.execute()
            return out
        except _ERRORS as exc:
            self.read_errors += 1
            self._failed("a read", exc)
            return []

    def count_run(self, names: Sequence[str]) -> int:
        if not names or not self.available():
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self._key(n))
            present = pipe.execute()
        except _ERRORS as exc:
            self.read_errors += 1
            self._failed("a lookup", exc)
            return 0
        run = 0
        while run < len(present) and present[run]:
            run += 1
        return run

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        if not items:
            return 0
        if not self.available():
            self.write_errors += len(items)
            return 0
        items = [(n, v) for n, v in items if len(v) <= self.max_bytes]
        self.num_rejected += 0 if items else 1
        if not items:
            return 0
        now = time.time()
        by_lru: dict[str, dict[str, float]] = {}
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, value in items:
                key = self._key(name)
                pipe.set(key, value, px=self.ttl_ms)
                by_lru.setdefault(self._lru_key(name), {})[key] = now
            for lru, members in by_lru.items():
                pipe.zadd(lru, members)
                pipe.zremrangebyscore(lru, "-inf", now - self.ttl_ms / 1000)
                pipe.zcard(lru)
            results = pipe.execute()
            max_entries = max(1, self.max_bytes // max(len(v) for _, v in items))
            for i, lru in enumerate(by_lru):
                card = int(results[len(items) + 3 * i + 2])
                if card > max_entries:
                    oldest: list[Any] = self.client.zpopmin(lru, card - max_entries)
                    victims: list[Any] = [m for m, _ in oldest]
                    if victims:
                        self.client.delete(*victims)
                        self.num_evicted += len(victims)
        except _ERRORS as exc:
            self.write_errors += len(items)
            self._failed("a write", exc)
            return 0
        return sum(len(v) for _, v in items)

    def delete(self, name: str) -> None:
        if not self.available():
            return
        key = self._key(name)
        try:
            self.client.delete(key)
            self.client.zrem(self._lru_key(name), key)
        except _ERRORS as exc:
            self._failed("a delete", exc)

    def describe(self) -> dict[str, object]:
        return {"url": _without_password(self.url), "prefix": self.prefix, "ttl_s": self.ttl_ms / 1000, "max_bytes": self.max_bytes,
                "available": self.available(), "evicted": self.num_evicted}

    def close(self) -> None:
        try:
            self.client.close()
        except _ERRORS:
            pass


def _without_password(url: str) -> str:
    """The URL as stats and logs may show it: ``redis://user:***@host``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
