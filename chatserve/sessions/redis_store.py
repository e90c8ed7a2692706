"""RedisSessionStore: sessions shared by every server process and kept across restarts.

Key layout (every key starts with `prefix`, "chatserve:" by default):

    {prefix}session:{id}            hash    the Session record, one JSON value per field
    {prefix}session:{id}:messages   list    Message records (JSON), oldest first
    {prefix}session:{id}:tokens     string  history token ids, little-endian uint32
    {prefix}session:{id}:lock       string  turn-lock owner token (own TTL: the lock's)
    {prefix}sessions                zset    every session id, all scores 0: ids sort by
                                            creation time, so ZREVRANGEBYLEX lists newest first
    {prefix}sessions:expiry         zset    id -> expires_at (unix s), to prune dead ids

The first three keys of a session share its TTL, set again by every write. The two index
zsets have no TTL; ids of expired sessions are pruned from them lazily (on create and on
list, after checking the session hash is really gone), so they do not grow without bound.

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
    SessionPage,
    SessionStore,
    Unset,
    apply_update,
    busy_error,
    changed_error,
    check_list_args,
    check_turn_args,
    plan_fork,
    without_last_turn,
)

# KEYS: session hash, lock. ARGV: token, ttl ms. -> {1, 0} taken, {0, pttl} busy, {-1, 0} no session.
_ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, 0} end
return {0, redis.call('PTTL', KEYS[2])}
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
    ) -> None:
        super().__init__(default_ttl_seconds)
        self.url = _redacted(url)
        self.prefix = prefix
        self._index_key = f"{prefix}sessions"
        self._expiry_key = f"{prefix}sessions:expiry"
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
    ) -> Session:
        """Optimistic read-modify-write of one session under WATCH, retried on conflicts.

        `plan(current)` checks preconditions (raising leaves Redis untouched) and returns the
        new record plus a function queueing extra writes. The record, the extras, the TTL of
        all keys and the expiry index then go in one MULTI/EXEC: all applied or none.
        `read_more(pipe)`, awaited before `plan`, reads other keys of the session under the same
        WATCH (they only ever change together with the hash, so the hash's WATCH covers them).
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
                        new_session, queue_extra = plan(Session.from_record(_decode_hash(raw)))
                        await self._after_watch(session_id)
                        pipe.multi()
                        pipe.hset(k.session, mapping=new_session.to_record())
                        if queue_extra is not None:
                            queue_extra(pipe)
                        ms = ttl_ms(new_session.ttl_seconds)
                        for key in (k.session, k.messages, k.tokens):
                            pipe.pexpire(key, ms)
                        pipe.zadd(self._expiry_key, {session_id: new_session.expires_at})
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

    async def _prune_expired(self) -> None:
        """Drops from both indexes the ids whose expiry time passed and whose hash is gone."""
        ids = await self._client.zrangebyscore(self._expiry_key, "-inf", time.time(), start=0, num=_PRUNE_BATCH)
        if ids:
            await self._drop_dead(ids)

    async def _drop_dead(self, ids: Sequence[bytes]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.exists(self.keys(sid.decode()).session)
            alive = await pipe.execute()
        dead = [sid for sid, n in zip(ids, alive) if not n]
        if dead:
            # NOTE: a session never comes back once its hash is gone (ids are never reused and
            # every write is WATCHed on the hash), so removing its index entries is safe.
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.zrem(self._index_key, *dead)
                pipe.zrem(self._expiry_key, *dead)
                await pipe.execute()

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
        session_id, ttl, record = session.id, session.ttl_seconds, session.to_record()
        k = self.keys(session_id)
        with self._errors("create a session"):
            await self._prune_expired()
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(k.session, mapping=record)
                pipe.pexpire(k.session, ttl_ms(ttl))
                pipe.zadd(self._index_key, {session_id: 0})
                pipe.zadd(self._expiry_key, {session_id: session.expires_at})
                await pipe.execute()
        return Session.from_record(record)

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
        with self._errors("delete a session"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(k.session)
                pipe.delete(k.messages, k.tokens, k.lock)
                pipe.zrem(self._index_key, session_id)
                pipe.zrem(self._expiry_key, session_id)
                deleted, *_ = await pipe.execute()
        return deleted == 1

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
        k = self.keys(session.id)
        ms = ttl_ms(session.ttl_seconds)
        messages = [m.to_record() for m in plan.messages]
        with self._errors("store the forked session"):
            await self._prune_expired()
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(k.session, mapping=session.to_record())
                pipe.pexpire(k.session, ms)
                if messages:
                    pipe.rpush(k.messages, *messages)
                    pipe.pexpire(k.messages, ms)
                if plan.token_ids:
                    pipe.set(k.tokens, encode_token_ids(plan.token_ids), px=ms)
                pipe.zadd(self._index_key, {session.id: 0})
                pipe.zadd(self._expiry_key, {session.id: session.expires_at})
                await pipe.execute()
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

        async def read_messages(pipe: Any) -> None:
            stored[:] = [Message.from_record(m) for m in await pipe.lrange(k.messages, 0, -1)]

        def plan(current: Session) -> tuple[Session, Callable[[Any], None]]:
            if expected_num_turns is not None and current.num_turns != expected_num_turns:
                raise changed_error(session_id, expected_num_turns, current.num_turns)
            keep = without_last_turn(session_id, stored) if replace_last_turn else None
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

        return await self._update(session_id, "store a turn", plan, read_messages if replace_last_turn else None)

    # --- turn lock ---------------------------------------------------------------------

    async def acquire_turn_lock(self, session_id: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> str:
        ttl = check_ttl(ttl_s, "ttl_s")
        if not is_valid_session_id(session_id):
            raise SessionNotFound(session_id)
        k = self.keys(session_id)
        token = secrets.token_hex(16)
        with self._errors("lock a session for a turn"):
            status, pttl = await self._acquire_script(keys=[k.session, k.lock], args=[token, ttl_ms(ttl)])
        if status == -1:
            raise SessionNotFound(session_id)
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
