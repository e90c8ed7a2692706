"""RedisSessionStore: sessions shared by every server process and kept across restarts.

Key layout (every key starts with `prefix`, "chatserve:" by default):

    {prefix}session:{id}            hash    the Session record, one JSON value per field
    {prefix}session:{id}:messages   list    Message records (JSON), oldest first
    {prefix}session:{id}:tokens     string  history token ids, little-endian uint32
    {prefix}session:{id}:lock       string  turn-lock owner token (own TTL: the lock's)
    {prefix}sessions                zset    every session id, all scores 0: ids sort by
                                            creation time, so ZREVRANGEBYLEX lists newest first
    {prefix}sessions:expiry         zset    id -> expires_at (unix s), to prune dead ids
    {prefix}sessions:bytes          hash    id -> the bytes the session holds (record, messages, tokens)
    {prefix}sessions:total_bytes    string  the sum of that hash: what --session-max-bytes limits

The first three keys of a session share its TTL, set again by every write. The index keys
have no TTL; ids of expired sessions are pruned from them lazily (on create, on list, and when a
limit is reached, after checking the session hash is really gone; their bytes leave the total
then), so they do not grow without bound. The limits are checked inside Lua scripts, so replicas
sharing the Redis cannot pass them together: `create` and `fork` check the count (ZCARD of the
index) and the bytes, `acquire_turn_lock` the bytes.

Every Redis failure (connection refused, timeout, server error) surfaces as
SessionStoreUnavailable. redis.asyncio reconnects by itself, so the same store object
works again once Redis answers; one quick retry hides a connection the restart broke.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chatserve.sessions.errors import SessionBusy, SessionNotFound, SessionStoreUnavailable
from chatserve.sessions.models import (
    Message,
    Session,
    check_ttl,
    decode_token_ids,
    encode_token_ids,
    is_valid_session_id,
    ttl_ms,
)
from chatserve.sessions.store import (
    DEFAULT_SESSION_TTL_S,
    DEFAULT_TURN_LOCK_TTL_S,
    UNSET,
    SessionLimits,
    SessionPage,
    SessionStore,
    Unset,
    apply_update,
    busy_error,
    bytes_error,
    changed_error,
    check_list_args,
    check_turn_args,
    count_error,
    message_bytes,
    plan_fork,
    record_bytes,
    without_last_turn,
)

# KEYS: session hash, lock, total bytes. ARGV: token, ttl ms, max bytes (-1: none).
# -> {1, 0} taken, {0, pttl} busy, {-1, 0} no session, {-2, bytes held} the store is full.
_ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, redis.call('PTTL', KEYS[2])} end
local held = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[3]) >= 0 and held >= tonumber(ARGV[3]) then return {-2, held} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {1, 0}
"""
# A new session (create, fork), admitted against the limits and written whole.
# KEYS: session hash, messages, tokens, index, expiry, sizes, total bytes.
# ARGV: id, expires_at, ttl ms, size, max count (-1: none), max bytes (-1: none), the number of hash
# fields n, then n field/value pairs, the number of messages m, then m messages, then the tokens ("": none).
# -> {1, 0} written, {-1, count} too many sessions, {-2, bytes held} too many bytes.
_CREATE_LUA = """
local size, max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if max_count >= 0 then
  local count = redis.call('ZCARD', KEYS[4])
  if count >= max_count then return {-1, count} end
end
local held = tonumber(redis.call('GET', KEYS[7]) or '0')
if max_bytes >= 0 and held + size > max_bytes then return {-2, held} end
local i = 8
local nfields = tonumber(ARGV[7])
redis.call('HSET', KEYS[1], unpack(ARGV, i, i + 2 * nfields - 1))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
i = i + 2 * nfields
local nmessages = tonumber(ARGV[i])
i = i + 1
for first = i, i + nmessages - 1, 512 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, first, math.min(first + 511, i + nmessages - 1)))
end
if nmessages > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
i = i + nmessages
if ARGV[i] ~= '' then redis.call('SET', KEYS[3], ARGV[i], 'PX', ARGV[3]) end
redis.call('ZADD', KEYS[4], 0, ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[6], ARGV[1], size)
redis.call('INCRBY', KEYS[7], size)
return {1, 0}
"""
# KEYS: session hash, messages, tokens, lock, index, expiry, sizes, total bytes. ARGV: id. -> 1 deleted, 0 none.
_DELETE_LUA = """
local n = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
local size = redis.call('HGET', KEYS[7], ARGV[1])
if size then
  redis.call('HDEL', KEYS[7], ARGV[1])
  redis.call('DECRBY', KEYS[8], size)
  if redis.call('HLEN', KEYS[7]) == 0 then redis.call('DEL', KEYS[8]) end
end
return n
"""
# The ids whose session hash is gone leave both indexes, and their bytes the total.
# KEYS: index, expiry, sizes, total bytes. ARGV: the session key prefix, then ids. -> how many were dropped.
_DROP_DEAD_LUA = """
local dropped = 0
for i = 2, #ARGV do
  local sid = ARGV[i]
  if redis.call('EXISTS', ARGV[1] .. sid) == 0 then
    local size = redis.call('HGET', KEYS[3], sid)
    if size then
      redis.call('HDEL', KEYS[3], sid)
      redis.call('DECRBY', KEYS[4], size)
    end
    redis.call('ZREM', KEYS[1], sid)
    redis.call('ZREM', KEYS[2], sid)
    dropped = dropped + 1
  end
end
if redis.call('HLEN', KEYS[3]) == 0 then redis.call('DEL', KEYS[4]) end
return dropped
"""
# KEYS: lock. ARGV: token. -> 1 released, 0 not the owner.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lock. ARGV: token, ttl ms. -> 1 extended, 0 not the owner.
_REFRESH_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_MAX_WATCH_ATTEMPTS = 5
_PRUNE_BATCH = 256
_MAX_PRUNE_BATCHES = 64  # one prune pass drops at most this many batches of expired ids


class _Keys(NamedTuple):
    session: str
    messages: str
    tokens: str
    lock: str


def _decode_hash(raw: dict[bytes, bytes]) -> dict[str, bytes]:
    return {k.decode(): v for k, v in raw.items()}


def _redacted(url: str) -> str:
    """host:port/db of a Redis URL, without credentials (for error messages and logs)."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@contextlib.contextmanager
def redis_errors(url: str, doing: str, error: type[Exception], what: str, heals: str) -> Iterator[None]:
    """Every Redis failure as `error` with a message naming the Redis, what failed and what heals it
    (shared by the stores that live in Redis: sessions, the event log). WatchError passes through."""
    try:
        yield
    except WatchError:
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError) as e:
        raise error(
            f"{what} unavailable: cannot reach Redis at {url} to {doing} "
            f"({type(e).__name__}: {e}); {heals} work again as soon as Redis answers"
        ) from e
    except RedisError as e:
        raise error(f"{what} failed: Redis at {url} answered an error to {doing} ({type(e).__name__}: {e})") from e


class RedisSessionStore(SessionStore):
    persistent = True
    backend = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "chatserve:",
        default_ttl_seconds: float = DEFAULT_SESSION_TTL_S,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        limits: SessionLimits | None = None,
    ) -> None:
        super().__init__(default_ttl_seconds, limits)
        self.url = _redacted(url)
        self.prefix = prefix
        self._index_key = f"{prefix}sessions"
        self._expiry_key = f"{prefix}sessions:expiry"
        self._sizes_key = f"{prefix}sessions:bytes"
        self._total_key = f"{prefix}sessions:total_bytes"
        # NOTE: short timeouts and a single fast retry on connection errors only: an outage
        # must turn into SessionStoreUnavailable within a few seconds, while a pooled
        # connection broken by a Redis restart is replaced transparently.
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=False,
        )
        self._acquire_script = self._client.register_script(_ACQUIRE_LUA)
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._refresh_script = self._client.register_script(_REFRESH_LUA)
        self._create_script = self._client.register_script(_CREATE_LUA)
        self._delete_script = self._client.register_script(_DELETE_LUA)
        self._drop_dead_script = self._client.register_script(_DROP_DEAD_LUA)

    def keys(self, session_id: str) -> _Keys:
        """The per-session keys (public so tests and operators can inspect them)."""
        base = f"{self.prefix}session:{session_id}"
        return _Keys(base, f"{base}:messages", f"{base}:tokens", f"{base}:lock")

    @property
    def client(self) -> aioredis.Redis:
        """The store's Redis client (its pool, timeouts and retry), shared by what else lives in the same
        Redis (the event log of resumable streams) instead of a second connection setup."""
        return self._client

    def _errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return redis_errors(self.url, doing, SessionStoreUnavailable, "session store", "sessions")

    async def _after_watch(self, session_id: str) -> None:
        """Runs between WATCH and MULTI of every read-modify-write; a no-op.

        NOTE: a seam for tests, which override it to land a concurrent write exactly there.
        """

    async def _update(
        self,
        session_id: str,
        doing: str,
        plan: Callable[[Session], tuple[Session, Callable[[Any], None] | None]],
        read_more: Callable[[Any], Awaitable[None]] | None = None,
        body_bytes: Callable[[Any, int], Awaitable[int]] | None = None,
    ) -> Session:
        """Optimistic read-modify-write of one session under WATCH, retried on conflicts.

        `plan(current)` checks preconditions (raising leaves Redis untouched) and returns the
        new record plus a function queueing extra writes. The record, the extras, the TTL of
        all keys, the expiry index and the session's bytes then go in one MULTI/EXEC: all applied
        or none. `read_more(pipe)`, awaited before `plan`, reads other keys of the session under the
        same WATCH (they only ever change together with the hash, so the hash's WATCH covers them).
        `body_bytes(pipe, old)`, awaited after `plan`: the bytes of the messages and tokens once the
        extras are written, given what they are now (None: unchanged).
        """
        if not is_valid_session_id(session_id):
            raise SessionNotFound(session_id)
        k = self.keys(session_id)
        with self._errors(doing):
            async with self._client.pipeline(transaction=True) as pipe:
                for _ in range(_MAX_WATCH_ATTEMPTS):
                    try:
                        await pipe.watch(k.session)
                        raw = await pipe.hgetall(k.session)
                        if not raw:
                            raise SessionNotFound(session_id)
                        if read_more is not None:
                            await read_more(pipe)
                        counted = await pipe.hget(self._sizes_key, session_id)
                        if counted is None:  # stored before sessions' bytes were counted: count it now
                            old_body = message_bytes(await pipe.lrange(k.messages, 0, -1)) + await pipe.strlen(k.tokens)
                        else:
                            old_body = int(counted) - record_bytes(raw)
                        new_session, queue_extra = plan(Session.from_record(_decode_hash(raw)))
                        new_body = old_body if body_bytes is None else await body_bytes(pipe, old_body)
                        record = new_session.to_record()
                        size = record_bytes(record) + new_body
                        await self._after_watch(session_id)
                        pipe.multi()
                        pipe.hset(k.session, mapping=record)
                        if queue_extra is not None:
                            queue_extra(pipe)
                        ms = ttl_ms(new_session.ttl_seconds)
                        for key in (k.session, k.messages, k.tokens):
                            pipe.pexpire(key, ms)
                        pipe.zadd(self._expiry_key, {session_id: new_session.expires_at})
                        pipe.hset(self._sizes_key, session_id, size)
                        pipe.incrby(self._total_key, size - (0 if counted is None else int(counted)))
                        await pipe.execute()
                        return new_session
                    except WatchError:
                        continue  # someone wrote the session meanwhile: read it again
                    finally:
                        await pipe.reset()
        raise SessionBusy(
            f"session {session_id!r} is being changed concurrently; retry the request",
            session_id=session_id,
        )

    async def _prune_expired(self, *, all_of_them: bool = False) -> None:
        """Drops from the indexes (and the byte count) the ids whose expiry time passed and whose hash
        is gone: one batch, or with `all_of_them` (a limit is reached) every one there is."""
        now = time.time()
        for _ in range(_MAX_PRUNE_BATCHES if all_of_them else 1):
            ids = await self._client.zrangebyscore(self._expiry_key, "-inf", now, start=0, num=_PRUNE_BATCH)
            dropped = await self._drop_dead(ids) if ids else 0
            if len(ids) < _PRUNE_BATCH or dropped == 0:
                return

    async def _drop_dead(self, ids: Sequence[bytes]) -> int:
        # NOTE: a session never comes back once its hash is gone (ids are never reused and every
        # write is WATCHed on the hash), so removing its index entries and its bytes is safe; the
        # script checks and drops each id in one step, so two replicas pruning at once count it once.
        keys = [self._index_key, self._expiry_key, self._sizes_key, self._total_key]
        return int(await self._drop_dead_script(keys=keys, args=[f"{self.prefix}session:", *ids]))

    async def count(self) -> int:
        """Live sessions as the count limit sees them (expired ones pruned first)."""
        with self._errors("count sessions"):
            await self._prune_expired(all_of_them=True)
            return int(await self._client.zcard(self._index_key))

    async def total_bytes(self) -> int:
        """The bytes all live sessions hold, as the byte limit sees them (expired ones pruned first)."""
        with self._errors("count the sessions' bytes"):
            await self._prune_expired(all_of_them=True)
            return int(await self._client.get(self._total_key) or 0)

    async def _write_new(self, session: Session, messages: Sequence[str], tokens: bytes, doing: str) -> None:
        """Admits a new session against the limits and writes it whole (one script), or raises
        SessionLimitExceeded with nothing written."""
        k = self.keys(session.id)
        record = session.to_record()
        size = record_bytes(record) + message_bytes(messages) + len(tokens)
        keys = [k.session, k.messages, k.tokens, self._index_key, self._expiry_key, self._sizes_key, self._total_key]
        fields = [x for item in record.items() for x in item]
        args = [session.id, repr(session.expires_at), ttl_ms(session.ttl_seconds), size,
                -1 if self.limits.max_count is None else self.limits.max_count,
                -1 if self.limits.max_bytes is None else self.limits.max_bytes,
                len(record), *fields, len(messages), *messages, tokens]
        with self._errors(doing):
            await self._prune_expired()
            status, held = await self._create_script(keys=keys, args=args)
            if status < 0:  # full: maybe only of expired sessions not pruned yet
                await self._prune_expired(all_of_them=True)
                status, held = await self._create_script(keys=keys, args=args)
        if status == -1:
            assert self.limits.max_count is not None
            raise count_error(self.limits.max_count)
        if status == -2:
            assert self.limits.max_bytes is not None
            raise bytes_error(self.limits.max_bytes, int(held), size)

    # --- sessions ----------------------------------------------------------------------

    async def create(
        self,
        *,
        system_prompt: str | None = None,
        metadata: dict[str, Any] | None = None,
        ttl_seconds: float | None = None,
        defaults: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Session:
        session = self._new_session(system_prompt, metadata, ttl_seconds, defaults, model)
        await self._write_new(session, [], b"", "create a session")
        return Session.from_record(session.to_record())

    async def get(self, session_id: str) -> Session | None:
        if not is_valid_session_id(session_id):
            return None
        with self._errors("read a session"):
            raw = await self._client.hgetall(self.keys(session_id).session)
        return Session.from_record(_decode_hash(raw)) if raw else None

    async def get_with_messages(self, session_id: str) -> tuple[Session, list[Message]] | None:
        if not is_valid_session_id(session_id):
            return None
        k = self.keys(session_id)
        with self._errors("read a session"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hgetall(k.session)
                pipe.lrange(k.messages, 0, -1)
                raw, messages = await pipe.execute()
        if not raw:
            return None
        return Session.from_record(_decode_hash(raw)), [Message.from_record(m) for m in messages]

    async def list(self, limit: int = 20, after: str | None = None) -> SessionPage:
        check_list_args(limit, after)
        live: list[Session] = []
        cursor = "+" if after is None else f"({after}"
        with self._errors("list sessions"):
            await self._prune_expired()
            while len(live) <= limit:  # one more than asked, to know whether more follow
                want = limit + 1 - len(live)
                ids = await self._client.zrevrangebylex(self._index_key, cursor, "-", start=0, num=want)
                if not ids:
                    break
                async with self._client.pipeline(transaction=False) as pipe:
                    for sid in ids:
                        pipe.hgetall(self.keys(sid.decode()).session)
                    records = await pipe.execute()
                live.extend(Session.from_record(_decode_hash(r)) for r in records if r)
                dead = [sid for sid, r in zip(ids, records) if not r]
                if dead:  # expired (or deleted) since they were indexed
                    await self._drop_dead(dead)
                if len(ids) < want:
                    break
                cursor = f"({ids[-1].decode()}"
        return SessionPage(live[:limit], len(live) > limit)

    async def delete(self, session_id: str) -> bool:
        if not is_valid_session_id(session_id):
            return False
        k = self.keys(session_id)
        keys = [k.session, k.messages, k.tokens, k.lock, self._index_key, self._expiry_key, self._sizes_key,
                self._total_key]
        with self._errors("delete a session"):
            deleted = await self._delete_script(keys=keys, args=[session_id])
        return int(deleted) == 1

    async def touch(self, session_id: str) -> Session:
        def plan(current: Session) -> tuple[Session, None]:
            current.expires_at = time.time() + current.ttl_seconds
            return current, None

        return await self._update(session_id, "refresh a session's TTL", plan)

    async def update(
        self,
        session_id: str,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
        defaults: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        def plan(current: Session) -> tuple[Session, None]:
            now = time.time()
            apply_update(current, title, metadata, defaults)
            current.updated_at = now
            current.expires_at = now + current.ttl_seconds
            return current, None

        return await self._update(session_id, "update a session", plan)

    async def fork(
        self,
        session_id: str,
        keep_turns: int,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        if not is_valid_session_id(session_id):
            raise SessionNotFound(session_id)
        src = self.keys(session_id)
        with self._errors("read the session to fork"):
            async with self._client.pipeline(transaction=True) as pipe:  # one consistent snapshot
                pipe.hgetall(src.session)
                pipe.lrange(src.messages, 0, -1)
                pipe.get(src.tokens)
                raw, raw_messages, blob = await pipe.execute()
        if not raw:
            raise SessionNotFound(session_id)
        plan = plan_fork(Session.from_record(_decode_hash(raw)), [Message.from_record(m) for m in raw_messages],
                         decode_token_ids(blob), keep_turns, self._new_id(), title, metadata)
        session = plan.session
        messages = [m.to_record() for m in plan.messages]
        tokens = encode_token_ids(plan.token_ids) if plan.token_ids else b""
        await self._write_new(session, messages, tokens, "store the forked session")
        return session

    # --- turns ---------------------------------------------------------------------------

    async def get_messages(self, session_id: str) -> list[Message]:
        found = await self.get_with_messages(session_id)
        if found is None:
            raise SessionNotFound(session_id)
        return found[1]

    async def get_history_tokens(self, session_id: str) -> list[int]:
        if not is_valid_session_id(session_id):
            raise SessionNotFound(session_id)
        k = self.keys(session_id)
        with self._errors("read a session's token history"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(k.session)
                pipe.get(k.tokens)
                exists, blob = await pipe.execute()
        if not exists:
            raise SessionNotFound(session_id)
        return decode_token_ids(blob)

    async def append_turn(
        self,
        session_id: str,
        user_message: Message,
        assistant_message: Message,
        history_token_ids: Sequence[int],
        *,
        expected_num_turns: int | None = None,
        replace_last_turn: bool = False,
    ) -> Session:
        check_turn_args(user_message, assistant_message, expected_num_turns)
        # NOTE: serialise everything before touching Redis: a bad value fails with nothing written.
        new_messages = [user_message.to_record(), assistant_message.to_record()]
        tokens = encode_token_ids(history_token_ids)
        k = self.keys(session_id)
        stored: list[Message] = []
        stored_bytes: list[int] = []  # each stored message's record bytes
        dropped_bytes = [0]  # bytes of the messages regenerate replaces

        async def read_messages(pipe: Any) -> None:
            raw = await pipe.lrange(k.messages, 0, -1)
            stored[:] = [Message.from_record(m) for m in raw]
            stored_bytes[:] = [len(m) for m in raw]

        async def body_bytes(pipe: Any, old: int) -> int:
            return old - dropped_bytes[0] + message_bytes(new_messages) - await pipe.strlen(k.tokens) + len(tokens)

        def plan(current: Session) -> tuple[Session, Callable[[Any], None]]:
            if expected_num_turns is not None and current.num_turns != expected_num_turns:
                raise changed_error(session_id, expected_num_turns, current.num_turns)
            keep = without_last_turn(session_id, stored) if replace_last_turn else None
            dropped_bytes[0] = sum(stored_bytes[keep:]) if keep is not None else 0
            now = time.time()
            current.num_turns += 0 if replace_last_turn else 1
            current.updated_at = now
            current.expires_at = now + current.ttl_seconds

            def queue(pipe: Any) -> None:
                if keep is not None:  # regenerate: drop the last turn's messages first
                    if keep == 0:
                        pipe.delete(k.messages)
                    else:
                        pipe.ltrim(k.messages, 0, keep - 1)
                pipe.rpush(k.messages, *new_messages)
                pipe.set(k.tokens, tokens)

            return current, queue

        return await self._update(session_id, "store a turn", plan, read_messages if replace_last_turn else None,
                                  body_bytes)

    # --- turn lock ---------------------------------------------------------------------

    async def acquire_turn_lock(self, session_id: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> str:
        ttl = check_ttl(ttl_s, "ttl_s")
        if not is_valid_session_id(session_id):
            raise SessionNotFound(session_id)
        k = self.keys(session_id)
        token = secrets.token_hex(16)
        max_bytes = self.limits.max_bytes
        args = [token, ttl_ms(ttl), -1 if max_bytes is None else max_bytes]
        with self._errors("lock a session for a turn"):
            status, pttl = await self._acquire_script(keys=[k.session, k.lock, self._total_key], args=args)
            if status == -2:  # full: maybe only of expired sessions not pruned yet
                await self._prune_expired(all_of_them=True)
                status, pttl = await self._acquire_script(keys=[k.session, k.lock, self._total_key], args=args)
        if status == -1:
            raise SessionNotFound(session_id)
        if status == -2:
            assert max_bytes is not None
            raise bytes_error(max_bytes, int(pttl))
        if status == 0:
            raise busy_error(session_id, max(0, pttl) / 1000 if pttl >= 0 else None)
        return token

    async def release_turn_lock(self, session_id: str, token: str) -> bool:
        if not is_valid_session_id(session_id):
            return False
        with self._errors("unlock a session"):
            return bool(await self._release_script(keys=[self.keys(session_id).lock], args=[token]))

    async def refresh_turn_lock(self, session_id: str, token: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> bool:
        ttl = check_ttl(ttl_s, "ttl_s")
        if not is_valid_session_id(session_id):
            return False
        with self._errors("extend a session's turn lock"):
            return bool(await self._refresh_script(keys=[self.keys(session_id).lock], args=[token, ttl_ms(ttl)]))

    # --- health and lifetime -------------------------------------------------------------

    async def ping(self) -> None:
        with self._errors("ping"):
            await self._client.ping()

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
