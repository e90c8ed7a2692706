"""Event logs: the numbered events of one run (a resumable stream), kept so a reader can come back.

A run (a Chat Completions stream asked to be resumable, a background response) appends every
event it emits; a reader follows the log from a cursor: it gets the events after the cursor, then
the live ones, until the run ends the log. So a client whose connection dropped reconnects with
the last sequence number it saw and loses nothing, and with a Redis behind it the reader may be on
any replica.

Contract (`tests/server/streams/test_event_log.py` runs the same tests over both logs):
- One writer per key. `append` numbers events 0, 1, 2, ... with no gap; `follow` yields them in
  order, each once.
- At most `max_events` entries are kept per log (the oldest trimmed); a cursor older than the
  oldest kept entry is `CursorExpired`, never a silent gap.
- A log expires `ttl_s` after its last write (append or end; Redis: between 3/4 ttl_s and ttl_s after an
  append, see `RedisEventLog.append`): finished logs do not pile up, and a log whose writer died (its
  process crashed) goes away by itself.
- `follow` marks a reader present while it iterates (a heartbeat), so the process driving the run
  can tell whether anyone anywhere is reading (`has_readers`), which is what a detached run's lease
  needs.

Redis layout (keys start with the session store's prefix, "chatserve:" by default):

    {prefix}events:{key}            stream  entry id "{seq}-1", field "e" = the event's JSON;
                                            the end marker is one more entry with field "end" = status
    {prefix}events:{key}:readers    string  reader heartbeat, PX READER_TTL_S

`{key}` is the run id (`chatcmpl-` plus the client's X-Request-Id, say) with every character
outside `A-Z a-z 0-9 . _ ~ -` percent-encoded (`key_part`), so no id can spell another run's key:
`x:readers` is `x%3Areaders`, not the heartbeat of run `x`, and `{`/`}` cannot pick a cluster slot.

The entry ids carry our own sequence number (`XADD` with an explicit id), so numbering is the
same on every replica, and Redis refuses a duplicate or out-of-order id: a second writer fails
loudly instead of interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from chatserve.server.errors import APIError, bad_request

READER_TTL_S = 3.0  # a reader's heartbeat lasts this long; followers refresh it at least every second
_HEARTBEAT_EVERY_S = 1.0
_BLOCK_MS = 500  # one XREAD BLOCK; below the session client's 1 s socket timeout
_READ_COUNT = 512
DEFAULT_MAX_EVENTS = 10_000
DEFAULT_TTL_S = 600.0


class EventLogError(Exception):
    """Base of the event log's errors."""


class EventLogUnavailable(EventLogError):
    """The log's backing store (Redis) did not answer or answered an error."""


class EventLogNotFound(EventLogError):
    """No such log: never written, expired, or deleted."""


class CursorExpired(EventLogError):
    """The cursor points before the oldest entry still kept: replaying from it would leave a gap."""

    def __init__(self, key: str, after: int, first: int) -> None:
        super().__init__(f"events after {after} of {key!r} are no longer kept (the oldest kept is {first}); "
                         f"resume from {first - 1} or later")
        self.first = first


class LogInfo(NamedTuple):
    next_seq: int  # events appended so far (the seq of the next one)
    first_seq: int  # oldest seq still kept
    ended: str | None  # None while the writer runs; its end status after end()


class EventLog(ABC):
    """The numbered, bounded, expiring events of runs, one log per key. See the module docstring."""

    backend: str = "abstract"
    persistent: bool = False

    def __init__(self, *, max_events: int = DEFAULT_MAX_EVENTS, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_events = max_events
        self.ttl_s = ttl_s

    @abstractmethod
    async def append(self, key: str, event: dict[str, Any]) -> int:
        """Append one event; its sequence number (0 for the first of a key)."""

    async def append_many(self, key: str, events: list[dict[str, Any]]) -> list[int]:
        """Append several events in order (one round trip where the store allows); their sequence numbers."""
        return [await self.append(key, event) for event in events]

    @abstractmethod
    async def end(self, key: str, status: str = "completed") -> None:
        """The writer is done: followers stop after the last event; the log expires ttl_s from now."""

    @abstractmethod
    def follow(self, key: str, after: int = -1, *, heartbeat: bool = True) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(seq, event) for seq > after, then live ones until the log is ended. `heartbeat`: mark a
        reader present while iterating (off for readers the writing process counts itself)."""

    @abstractmethod
    async def info(self, key: str) -> LogInfo | None:
        """Where the log stands, or None if there is none."""

    async def exists(self, key: str) -> bool:
        return await self.info(key) is not None

    @abstractmethod
    async def has_readers(self, key: str) -> bool:
        """True when a follower (in any process sharing the store) iterated within READER_TTL_S."""

    @abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove the log; True if there was one."""

    async def close(self) -> None:
        """Release connections the log owns (a log sharing another store's client owns none)."""
        return None


# --- in process memory -----------------------------------------------------------------------


@dataclass
class _MemoryLog:
    entries: deque[tuple[int, dict[str, Any]]]
    next_seq: int = 0
    ended: str | None = None
    expires_at: float = 0.0
    reader_until: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryEventLog(EventLog):
    """The log without a Redis: this process only, lost on restart. Events are stored as JSON
    round-trips so both logs hand back equal (and unshared) dicts."""

    backend = "memory"
    persistent = False

    def __init__(self, *, max_events: int = DEFAULT_MAX_EVENTS, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(max_events=max_events, ttl_s=ttl_s)
        self._logs: dict[str, _MemoryLog] = {}

    def _get(self, key: str) -> _MemoryLog | None:
        log = self._logs.get(key)
        if log is not None and log.expires_at <= time.monotonic():
            del self._logs[key]
            log.notify()
            return None
        return log

    def _prune(self) -> None:
        now = time.monotonic()
        for key in [k for k, log in self._logs.items() if log.expires_at <= now]:
            self._logs.pop(key).notify()

    async def append(self, key: str, event: dict[str, Any]) -> int:
        log = self._get(key)
        if log is None:
            self._prune()
            log = self._logs[key] = _MemoryLog(deque(maxlen=self.max_events))
        if log.ended is not None:
            raise EventLogError(f"the log {key!r} has ended; a log has one writer and is not reopened")
        seq = log.next_seq
        log.entries.append((seq, json.loads(json.dumps(event))))
        log.next_seq += 1
        log.expires_at = time.monotonic() + self.ttl_s
        log.notify()
        return seq

    async def end(self, key: str, status: str = "completed") -> None:
        log = self._get(key)
        if log is None:
            log = self._logs[key] = _MemoryLog(deque(maxlen=self.max_events))
        log.ended = status
        log.expires_at = time.monotonic() + self.ttl_s
        log.notify()

    async def follow(self, key: str, after: int = -1, *,
                     heartbeat: bool = True) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        log = self._get(key)
        if log is None:
            raise EventLogNotFound(key)
        cursor = after
        while True:
            if heartbeat:
                log.reader_until = time.monotonic() + READER_TTL_S
            changed = log.changed
            first = log.entries[0][0] if log.entries else log.next_seq
            if cursor + 1 < first:
                raise CursorExpired(key, cursor, first)
            batch = [(seq, ev) for seq, ev in log.entries if seq > cursor]
            for seq, ev in batch:
                yield seq, json.loads(json.dumps(ev))
                cursor = seq
                if heartbeat:
                    log.reader_until = time.monotonic() + READER_TTL_S
            if batch:
                continue
            if log.ended is not None:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), _HEARTBEAT_EVERY_S)
            if self._get(key) is None and log.ended is None:  # gone before its end (expired, deleted)
                raise EventLogNotFound(key)

    async def info(self, key: str) -> LogInfo | None:
        log = self._get(key)
        if log is None:
            return None
        first = log.entries[0][0] if log.entries else log.next_seq
        return LogInfo(log.next_seq, first, log.ended)

    async def has_readers(self, key: str) -> bool:
        log = self._get(key)
        return log is not None and log.reader_until > time.monotonic()

    async def delete(self, key: str) -> bool:
        log = self._logs.pop(key, None)
        if log is not None:
            log.notify()
        return log is not None


# --- Redis Streams ---------------------------------------------------------------------------


def _seq_of(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


_KEY_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~-")


def key_part(key: str) -> str:
    """`key` with every character outside the unreserved URL alphabet percent-encoded (UTF-8): one
    to one, free of `:` (the separator of our key names) and `%` only as the escape."""
    if all(c in _KEY_SAFE for c in key):
        return key
    return "".join(c if c in _KEY_SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
                   for c in key)


class RedisEventLog(EventLog):
    """The log in Redis Streams, on the session store's client: every replica on the same Redis reads it."""

    backend = "redis"
    persistent = True

    def __init__(self, client: Any, *, prefix: str = "chatserve:", url: str = "redis",
                 max_events: int = DEFAULT_MAX_EVENTS, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(max_events=max_events, ttl_s=ttl_s)
        self._client = client
        self.prefix = prefix
        self.url = url
        self._next: dict[str, int] = {}  # this process's writers: the next seq of each key it writes
        self._expiry_set: dict[str, float] = {}  # when each key's TTL was last set (monotonic)

    def stream_key(self, key: str) -> str:
        return f"{self.prefix}events:{key_part(key)}"

    def readers_key(self, key: str) -> str:
        return f"{self.prefix}events:{key_part(key)}:readers"

    def _errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        from chatserve.sessions.redis_store import redis_errors

        return redis_errors(self.url, doing, EventLogUnavailable, "event log", "resumable streams")

    async def append(self, key: str, event: dict[str, Any]) -> int:
        return (await self.append_many(key, [event]))[0]

    async def append_many(self, key: str, events: list[dict[str, Any]]) -> list[int]:
        first = self._next.get(key, 0)
        skey = self.stream_key(key)
        now = time.monotonic()
        # NOTE: one pipelined round trip per batch; the TTL is set with the first batch and refreshed once a
        # quarter of it has passed (not with every event), so a log expires between 3/4 ttl_s and ttl_s
        # after its last write.
        refresh = now - self._expiry_set.get(key, -1e18) >= self.ttl_s / 4
        with self._errors("append stream events"):
            async with self._client.pipeline(transaction=False) as pipe:
                for i, event in enumerate(events):
                    pipe.xadd(skey, {"e": json.dumps(event, ensure_ascii=False, separators=(",", ":"))},
                              id=f"{first + i}-1", maxlen=self.max_events, approximate=False)
                if refresh:
                    pipe.pexpire(skey, int(self.ttl_s * 1000))
                await pipe.execute()
        if refresh:
            self._expiry_set[key] = now
        self._next[key] = first + len(events)
        return list(range(first, first + len(events)))

    async def end(self, key: str, status: str = "completed") -> None:
        seq = self._next.pop(key, None)
        self._expiry_set.pop(key, None)
        with self._errors("end a stream's event log"):
            if seq is None:  # not written here: after the last entry there is (if any)
                last = await self._client.xrevrange(self.stream_key(key), count=1)
                seq = _seq_of(last[0][0]) + 1 if last else 0
            async with self._client.pipeline(transaction=False) as pipe:
                # max_events + 1: the marker takes no event's place (the same bound as the memory log)
                pipe.xadd(self.stream_key(key), {"end": status}, id=f"{seq}-1", maxlen=self.max_events + 1,
                          approximate=False)
                pipe.pexpire(self.stream_key(key), int(self.ttl_s * 1000))
                await pipe.execute()

    async def follow(self, key: str, after: int = -1, *,
                     heartbeat: bool = True) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        skey = self.stream_key(key)
        with self._errors("read a stream's event log"):
            first = await self._client.xrange(skey, count=1)
        if not first:
            raise EventLogNotFound(key)
        first_seq = _seq_of(first[0][0])
        if after + 1 < first_seq:
            raise CursorExpired(key, after, first_seq)
        cursor = after
        beat_at = 0.0
        while True:
            now = time.monotonic()
            with self._errors("read a stream's event log"):
                if heartbeat and now >= beat_at:
                    await self._client.set(self.readers_key(key), b"1", px=int(READER_TTL_S * 1000))
                    beat_at = now + _HEARTBEAT_EVERY_S
                start = f"{cursor}-1" if cursor >= 0 else "0-0"
                reply = await self._client.xread({skey: start}, count=_READ_COUNT, block=_BLOCK_MS)
            if not reply:
                with self._errors("read a stream's event log"):
                    if not await self._client.exists(skey):
                        raise EventLogNotFound(key)
                continue
            for entry_id, fields in reply[0][1]:
                seq = _seq_of(entry_id)
                if seq != cursor + 1:  # trimmed under a slow reader
                    raise CursorExpired(key, cursor, seq)
                if b"end" in fields:
                    return
                yield seq, json.loads(fields[b"e"])
                cursor = seq

    async def info(self, key: str) -> LogInfo | None:
        skey = self.stream_key(key)
        with self._errors("read a stream's event log"):
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xrange(skey, count=1)
                pipe.xrevrange(skey, count=1)
                first, last = await pipe.execute()
        if not first:
            return None
        last_id, last_fields = last[0]
        ended = last_fields.get(b"end")
        next_seq = _seq_of(last_id) + (0 if ended is not None else 1)
        return LogInfo(next_seq, _seq_of(first[0][0]), ended.decode() if ended is not None else None)

    async def has_readers(self, key: str) -> bool:
        with self._errors("check a stream's readers"):
            return bool(await self._client.exists(self.readers_key(key)))

    async def delete(self, key: str) -> bool:
        self._next.pop(key, None)
        self._expiry_set.pop(key, None)
        with self._errors("delete a stream's event log"):
            return bool(await self._client.delete(self.stream_key(key), self.readers_key(key)))


def make_event_log(sessions: Any, *, max_events: int = DEFAULT_MAX_EVENTS, ttl_s: float = DEFAULT_TTL_S) -> EventLog:
    """A RedisEventLog on the session store's client (same Redis, prefix, timeouts) when sessions live
    in Redis, else a MemoryEventLog (this process only, like the sessions)."""
    from chatserve.sessions.factory import is_redis_session_store

    if is_redis_session_store(sessions):
        return RedisEventLog(sessions.client, prefix=sessions.prefix, url=sessions.url, max_events=max_events,
                             ttl_s=ttl_s)
    return MemoryEventLog(max_events=max_events, ttl_s=ttl_s)


@contextlib.contextmanager
def event_log_errors(param: str) -> Iterator[None]:
    """The log's errors as the HTTP answers the resume routes promise, naming `param` (the cursor)."""
    try:
        yield
    except EventLogUnavailable as exc:
        raise APIError(503, str(exc), code="event_log_unavailable", headers={"Retry-After": "1"}) from None
    except EventLogNotFound as exc:
        raise APIError(404, f"no stream {exc} to resume: it never was resumable, or its events expired",
                       param=param, code="not_found") from None
    except CursorExpired as exc:
        raise bad_request(str(exc), param=param, code="cursor_expired") from None
