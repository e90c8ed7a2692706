"""Contract tests of the session stores: one suite, run against Redis and against memory.

The Redis store runs against a real server: the one on 127.0.0.1:6379 (or
$CHATSERVE_TEST_REDIS_URL), else a redis-server this module starts. Every test uses its
own key prefix and checks at teardown that no key under it is left. The outage tests
start, kill, freeze and restart a redis-server of their own on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis

from chatserve.sessions import (
    InMemorySessionStore,
    Message,
    RedisSessionStore,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    SessionStoreUnavailable,
    SessionValidationError,
    make_session_store,
)
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess, redis_for_tests

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- Redis servers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis to test against: the running one if it answers, else one of our own."""
    yield from redis_for_tests()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _keys_under(url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(url) as client:
        return sorted(client.scan_iter(match=f"{prefix}*", count=1000))


def _assert_no_keys_left(url: str, prefix: str) -> None:
    """Deletes whatever a test left under its prefix (so a failure does not litter the shared
    Redis), then fails if there was anything."""
    left = _keys_under(url, prefix)
    if left:
        with redis.Redis.from_url(url) as client:
            client.delete(*left)
    assert left == [], f"keys left behind under {prefix!r}"


async def _delete_all(store: SessionStore) -> None:
    while True:
        page = await store.list(limit=1000)
        for s in page.sessions:
            assert await store.delete(s.id)
        if not page.has_more:
            return


@pytest.fixture
def prefix() -> str:
    return f"chatserve-test-{uuid.uuid4().hex}:"


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        mem = InMemorySessionStore()
        yield mem
        mem.check_integrity()
        await mem.close()
        return
    url = request.getfixturevalue("redis_url")
    rs = RedisSessionStore(url, prefix=prefix)
    try:
        yield rs
        # Deleting through the API what the test left must leave no key at all behind:
        # sessions, messages, tokens, locks and both index zsets (expired ids pruned).
        await _delete_all(rs)
    finally:
        await rs.close()
    _assert_no_keys_left(url, prefix)


@pytest.fixture
async def redis_store(redis_url: str, prefix: str) -> AsyncIterator[RedisSessionStore]:
    rs = RedisSessionStore(redis_url, prefix=prefix)
    try:
        yield rs
        await _delete_all(rs)
    finally:
        await rs.close()
    _assert_no_keys_left(redis_url, prefix)


def _turn(i: int, finish_reason: str = "stop") -> tuple[Message, Message]:
    usage = {"prompt_tokens": 10 * i, "completion_tokens": i, "prompt_tokens_details": {"cached_tokens": 5 * i}}
    return Message("user", f"question {i} ✓ 你好 🙂"), Message("assistant", f"answer {i}", finish_reason, usage)


async def _state(store: SessionStore, sid: str) -> tuple[int, list[Message], list[int]]:
    session = await store.get(sid)
    assert session is not None
    return session.num_turns, await store.get_messages(sid), await store.get_history_tokens(sid)


# --- the contract, for both stores ----------------------------------------------------------


async def test_create_and_get(store: SessionStore) -> None:
    before = time.time()
    s = await store.create(
        system_prompt="You are terse.",
        metadata={"user": "ana", "tags": ("a", "b")},
        ttl_seconds=600,
        defaults={"temperature": 0.2, "max_tokens": 64},
        model="smollm2",
    )
    assert s.id.startswith("sess_") and before - 1 <= s.created_at <= time.time() + 1
    assert s.updated_at == s.created_at and s.num_turns == 0
    assert s.metadata == {"user": "ana", "tags": ["a", "b"]}  # what a JSON round trip gives
    assert await store.get(s.id) == s
    d = s.to_dict()
    assert {k: d[k] for k in ("id", "system_prompt", "ttl_seconds", "num_turns", "model")} == {
        "id": s.id,
        "system_prompt": "You are terse.",
        "ttl_seconds": 600,
        "num_turns": 0,
        "model": "smollm2",
    }
    assert isinstance(d["created_at"], int) and isinstance(d["updated_at"], int)
    assert d["defaults"] == {"temperature": 0.2, "max_tokens": 64}
    assert await store.get_messages(s.id) == [] and await store.get_history_tokens(s.id) == []
    assert await store.get_with_messages(s.id) == (s, [])

    plain = await store.create()
    assert plain.system_prompt is None and plain.metadata == {} and plain.defaults == {}
    assert plain.ttl_seconds == store.default_ttl_seconds

    with pytest.raises(SessionValidationError, match="metadata must be JSON-serialisable"):
        await store.create(metadata={"x": object()})
    for bad_ttl in (0, -5, float("inf"), "60", True):
        with pytest.raises(SessionValidationError, match="ttl_seconds"):
            await store.create(ttl_seconds=bad_ttl)  # type: ignore[arg-type]
    assert len((await store.list()).sessions) == 2  # the failed creates left nothing


async def test_list_newest_first_with_cursor_pagination(store: SessionStore) -> None:
    ids = [(await store.create(metadata={"i": i})).id for i in range(7)]
    newest_first = ids[::-1]

    page = await store.list(limit=3)
    assert [s.id for s in page.sessions] == newest_first[:3] and page.has_more
    page = await store.list(limit=3, after=page.sessions[-1].id)
    assert [s.id for s in page.sessions] == newest_first[3:6] and page.has_more
    page = await store.list(limit=3, after=page.sessions[-1].id)
    assert [s.id for s in page.sessions] == newest_first[6:] and not page.has_more
    assert [s.id for s in (await store.list(limit=7)).sessions] == newest_first
    assert not (await store.list(limit=7)).has_more

    # A cursor keeps its place even when its session is gone meanwhile.
    assert await store.delete(newest_first[2])
    page = await store.list(limit=2, after=newest_first[2])
    assert [s.id for s in page.sessions] == newest_first[3:5]
    assert [s.id for s in (await store.list(limit=3)).sessions] == [newest_first[0], newest_first[1], newest_first[3]]

    for bad in ({"limit": 0}, {"limit": 1001}, {"limit": 2.5}, {"after": "nope"}, {"after": "x:messages"}):
        with pytest.raises(SessionValidationError):
            await store.list(**bad)  # type: ignore[arg-type]


async def test_messages_and_token_history_round_trip(store: SessionStore) -> None:
    s = await store.create(system_prompt="sys")
    history: list[int] = []
    for i in range(1, 4):
        user, assistant = _turn(i, finish_reason="abort" if i == 2 else "stop")
        prompt = history + [1000 + i, 7, 8, 9]  # stored tokens + the newly templated user turn
        history = prompt + [i, 2**32 - 1, 0]  # + the generated ids
        updated = await store.append_turn(s.id, user, assistant, history, expected_num_turns=i - 1)
        assert updated.num_turns == i and updated.updated_at >= s.updated_at
        assert await store.get(s.id) == updated
        assert await store.get_history_tokens(s.id) == history

    messages = await store.get_messages(s.id)
    assert [m.role for m in messages] == ["user", "assistant"] * 3
    assert messages[2].content == "question 2 ✓ 你好 🙂"
    assert messages[3].finish_reason == "abort" and messages[5].finish_reason == "stop"
    assert messages[5].usage == {"prompt_tokens": 30, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 15}}
    assert messages[0].finish_reason is None and messages[0].usage is None
    assert [m.created_at for m in messages] == sorted(m.created_at for m in messages)
    assert messages[3].to_dict() == {
        "role": "assistant",
        "content": "answer 2",
        "finish_reason": "abort",
        "usage": messages[3].usage,
        "created_at": int(messages[3].created_at),
        "stats": None,
    }
    session, same_messages = await store.get_with_messages(s.id)  # type: ignore[misc]
    assert session.num_turns == 3 and same_messages == messages
    assert session.system_prompt == "sys"


async def _three_turns(store: SessionStore, **create: Any) -> tuple[str, list[list[int]]]:
    """A session of three turns whose replies record their token offsets; returns the history after each."""
    s = await store.create(**create)
    history: list[int] = []
    ends: list[list[int]] = []
    for i in range(3):
        prompt = history + [100 + i, 101 + i]
        history = prompt + [200 + i, 201 + i, 202 + i]
        user, assistant = _turn(i)
        assistant.prompt_end, assistant.history_end = len(prompt), len(history)
        assistant.stats = {"ttft_s": 0.01 * (i + 1), "decode_tokens_per_s": 50.0, "cached_tokens": i}
        await store.append_turn(s.id, user, assistant, history, expected_num_turns=i)
        ends.append(list(history))
    return s.id, ends


async def test_fork_keeps_the_exact_token_history_of_the_kept_turns(store: SessionStore) -> None:
    sid, ends = await _three_turns(store, system_prompt="sys", metadata={"title": "t"}, defaults={"temperature": 0.3})
    await store.update(sid, title="Source")
    source_messages = await store.get_messages(sid)
    for keep in range(4):
        fork = await store.fork(sid, keep)
        assert fork.id != sid and fork.num_turns == keep
        assert fork.forked_from == {"session_id": sid, "turn": keep}
        assert (fork.system_prompt, fork.defaults, fork.metadata, fork.title) == ("sys", {"temperature": 0.3}, {"title": "t"},
                                                                                  "Source")
        assert await store.get(fork.id) == fork
        assert await store.get_messages(fork.id) == source_messages[: 2 * keep]
        assert await store.get_history_tokens(fork.id) == (ends[keep - 1] if keep else [])
    # The stats of each reply travel with it.
    assert (await store.get_messages(sid))[3].stats == {"ttft_s": 0.02, "decode_tokens_per_s": 50.0, "cached_tokens": 1}

    # A fork is a session of its own: a turn on it leaves the source as it was.
    branch = await store.fork(sid, 1, title="Branch", metadata={"branch_at": 2})
    assert (branch.title, branch.metadata) == ("Branch", {"branch_at": 2})
    user, assistant = _turn(9)
    await store.append_turn(branch.id, user, assistant, ends[0] + [5, 6], expected_num_turns=1)
    assert await store.get_history_tokens(sid) == ends[2]
    assert await store.get_messages(sid) == source_messages
    assert (await store.get_messages(branch.id))[-1].content == "answer 9"

    for bad in (-1, 4, True, 1.0, "1"):
        with pytest.raises(SessionValidationError, match="keep_turns"):
            await store.fork(sid, bad)  # type: ignore[arg-type]
    with pytest.raises(SessionValidationError, match="title"):
        await store.fork(sid, 1, title="x" * 201)
    with pytest.raises(SessionNotFound):
        await store.fork("sess_" + "0" * 25, 0)
    with pytest.raises(SessionNotFound):
        await store.fork("not-an-id", 0)
    assert len((await store.list(limit=100)).sessions) == 1 + 4 + 1  # the refused forks stored nothing


async def test_replace_last_turn_regenerates_in_place(store: SessionStore) -> None:
    sid, ends = await _three_turns(store)
    before = await store.get_messages(sid)
    user = before[4]
    new_reply = Message("assistant", "another answer", "stop", prompt_end=len(ends[1]) + 2, history_end=len(ends[1]) + 3)
    history = ends[1] + [102, 103, 999]
    updated = await store.append_turn(sid, user, new_reply, history, expected_num_turns=3, replace_last_turn=True)
    assert updated.num_turns == 3
    messages = await store.get_messages(sid)
    assert messages[:4] == before[:4] and messages[4] == user and messages[5].content == "another answer"
    assert len(messages) == 6
    assert await store.get_history_tokens(sid) == history
    with pytest.raises(SessionBusy):  # the guard holds for a replacement too
        await store.append_turn(sid, user, new_reply, history, expected_num_turns=2, replace_last_turn=True)
    empty = await store.create()
    with pytest.raises(SessionValidationError, match="no stored turn"):
        await store.append_turn(empty.id, user, new_reply, [1], replace_last_turn=True)
    assert await _state(store, empty.id) == (0, [], [])


async def test_update_renames_and_sets_defaults(store: SessionStore) -> None:
    s = await store.create(metadata={"a": 1}, defaults={"top_k": 5})
    assert s.title is None and s.forked_from is None
    renamed = await store.update(s.id, title="Plans for Tuesday ✓")
    assert renamed.title == "Plans for Tuesday ✓" and renamed.metadata == {"a": 1} and renamed.defaults == {"top_k": 5}
    assert renamed.updated_at >= s.updated_at
    assert await store.get(s.id) == renamed
    changed = await store.update(s.id, defaults={"temperature": 0.5, "seed": 3}, metadata={"b": [1, 2]})
    assert changed.title == "Plans for Tuesday ✓" and changed.defaults == {"temperature": 0.5, "seed": 3}
    assert changed.metadata == {"b": [1, 2]}
    assert (await store.update(s.id, title=None)).title is None
    for bad in ({"title": 3}, {"title": "x" * 201}, {"metadata": {"x": float("nan")}}, {"defaults": {"x": object()}}):
        with pytest.raises(SessionValidationError):
            await store.update(s.id, **bad)  # type: ignore[arg-type]
    assert (await store.get(s.id)).defaults == {"temperature": 0.5, "seed": 3}  # type: ignore[union-attr]
    with pytest.raises(SessionNotFound):
        await store.update("sess_" + "0" * 25, title="x")


async def test_failed_append_writes_nothing(store: SessionStore) -> None:
    s = await store.create()
    await store.append_turn(s.id, *_turn(1), [1, 2, 3])
    before = await _state(store, s.id)
    user, assistant = _turn(2)
    bad_calls = [
        (user, Message("assistant", "x", "stop", {"unserialisable": object()}), [1, 2]),
        (user, Message("assistant", "x", "stop", {"nan": float("nan")}), [1, 2]),
        (user, Message("user", "x"), [1, 2]),
        (Message("assistant", "x"), assistant, [1, 2]),
        (Message("user", 42), assistant, [1, 2]),  # type: ignore[arg-type]
        (user, assistant, [1, -1]),
        (user, assistant, [1, 2**32]),
        (user, assistant, [1, "2"]),
        (user, assistant, []),
    ]
    for u, a, tokens in bad_calls:
        with pytest.raises(SessionValidationError):
            await store.append_turn(s.id, u, a, tokens)  # type: ignore[arg-type]
        assert await _state(store, s.id) == before


async def test_expected_num_turns_guards_against_lost_updates(store: SessionStore) -> None:
    s = await store.create()
    await store.append_turn(s.id, *_turn(1), [1, 2], expected_num_turns=0)
    with pytest.raises(SessionBusy, match="changed while this turn ran"):
        await store.append_turn(s.id, *_turn(2), [9, 9, 9], expected_num_turns=0)
    num_turns, messages, tokens = await _state(store, s.id)
    assert (num_turns, len(messages), tokens) == (1, 2, [1, 2])
    await store.append_turn(s.id, *_turn(2), [1, 2, 3])  # without the guard: always appends
    assert (await store.get(s.id)).num_turns == 2  # type: ignore[union-attr]


async def test_turn_lock_busy_expiry_and_owner_only_release(store: SessionStore) -> None:
    s = await store.create()
    token = await store.acquire_turn_lock(s.id, ttl_s=0.4)
    with pytest.raises(SessionBusy, match="already has a turn in progress") as busy:
        await store.acquire_turn_lock(s.id, ttl_s=5)
    assert busy.value.session_id == s.id and 0 < busy.value.retry_after <= 0.4  # type: ignore[operator]
    assert not await store.release_turn_lock(s.id, "not-the-token")
    assert not await store.refresh_turn_lock(s.id, "not-the-token", ttl_s=5)
    with pytest.raises(SessionBusy):  # a wrong token released nothing
        await store.acquire_turn_lock(s.id)

    await asyncio.sleep(0.6)  # the owner "died": the lock expires by itself
    token2 = await store.acquire_turn_lock(s.id, ttl_s=0.4)
    assert token2 != token
    assert not await store.release_turn_lock(s.id, token)  # the old owner cannot free the new lock
    assert not await store.refresh_turn_lock(s.id, token)
    assert await store.refresh_turn_lock(s.id, token2, ttl_s=5)
    await asyncio.sleep(0.6)  # outlives its first ttl thanks to the refresh
    with pytest.raises(SessionBusy):
        await store.acquire_turn_lock(s.id)
    assert await store.release_turn_lock(s.id, token2)
    assert not await store.release_turn_lock(s.id, token2)

    async with store.turn_lock(s.id, ttl_s=5) as token3:
        with pytest.raises(SessionBusy):
            async with store.turn_lock(s.id):
                pass
        assert await store.refresh_turn_lock(s.id, token3, ttl_s=5)
    assert await store.release_turn_lock(s.id, await store.acquire_turn_lock(s.id))

    other = await store.create()  # locks are per session
    assert await store.release_turn_lock(other.id, await store.acquire_turn_lock(other.id))
    for bad_ttl in (0, -1, float("nan")):
        with pytest.raises(SessionValidationError):
            await store.acquire_turn_lock(s.id, ttl_s=bad_ttl)


async def test_ttl_refreshed_by_turns_and_expiry_removes_session(store: SessionStore) -> None:
    keep = await store.create(ttl_seconds=60)
    s = await store.create(ttl_seconds=0.6)
    await asyncio.sleep(0.35)
    await store.append_turn(s.id, *_turn(1), [1, 2, 3])
    await asyncio.sleep(0.35)  # 0.7 s after creation: alive only thanks to the refresh
    assert (await store.get(s.id)).num_turns == 1  # type: ignore[union-attr]
    touched = await store.touch(s.id)
    assert touched.num_turns == 1 and touched.expires_at > s.expires_at
    await asyncio.sleep(0.35)  # 0.7 s after the append: alive only thanks to the touch
    assert await store.get_history_tokens(s.id) == [1, 2, 3]
    assert [x.id for x in (await store.list()).sessions] == [s.id, keep.id]

    await asyncio.sleep(0.7)  # now untouched for longer than its TTL
    assert await store.get(s.id) is None
    assert await store.get_with_messages(s.id) is None
    with pytest.raises(SessionNotFound):
        await store.get_messages(s.id)
    with pytest.raises(SessionNotFound):
        await store.append_turn(s.id, *_turn(2), [1])
    assert [x.id for x in (await store.list()).sessions] == [keep.id]
    assert not await store.delete(s.id)


async def test_delete_removes_the_session_and_its_lock(store: SessionStore, request: pytest.FixtureRequest) -> None:
    s = await store.create()
    other = await store.create()
    await store.append_turn(s.id, *_turn(1), [1, 2, 3])
    token = await store.acquire_turn_lock(s.id)
    assert await store.delete(s.id)
    assert not await store.delete(s.id)
    assert await store.get(s.id) is None
    assert [x.id for x in (await store.list()).sessions] == [other.id]
    assert not await store.release_turn_lock(s.id, token)  # the lock went with the session
    with pytest.raises(SessionNotFound):  # a turn in flight cannot store into a deleted session
        await store.append_turn(s.id, *_turn(2), [1, 2, 3, 4])
    assert await store.get(s.id) is None
    assert (await store.get(other.id)) is not None
    if isinstance(store, RedisSessionStore):
        assert _keys_under(request.getfixturevalue("redis_url"), store.keys(s.id).session) == []


UNKNOWN_IDS = ["sess_" + "0" * 25, "sess_" + "f" * 25, "nope", "", "*", "sess_0:messages", "../x"]


async def test_unknown_ids(store: SessionStore) -> None:
    real = await store.create()
    await store.append_turn(real.id, *_turn(1), [1, 2])
    token = await store.acquire_turn_lock(real.id)
    # Ids that name another key of a real session must not reach it.
    for sid in UNKNOWN_IDS + [real.id + ":messages", real.id + ":tokens", real.id + ":lock", real.id.upper()]:
        assert await store.get(sid) is None
        assert await store.get_with_messages(sid) is None
        assert not await store.delete(sid)
        assert not await store.release_turn_lock(sid, token)
        assert not await store.refresh_turn_lock(sid, token)
        for call in (
            store.get_messages(sid),
            store.get_history_tokens(sid),
            store.touch(sid),
            store.append_turn(sid, *_turn(2), [1, 2, 3]),
            store.acquire_turn_lock(sid),
        ):
            with pytest.raises(SessionNotFound, match="does not exist") as e:
                await call
            assert e.value.session_id == sid
    assert await _state(store, real.id) == (1, await store.get_messages(real.id), [1, 2])
    assert await store.release_turn_lock(real.id, token)


async def test_ping_and_health(store: SessionStore) -> None:
    await store.ping()
    health = await store.health()
    assert health["ok"] and health["error"] is None
    assert health["persistent"] is isinstance(store, RedisSessionStore)


async def test_factory_chooses_the_store(caplog: pytest.LogCaptureFixture, redis_url: str) -> None:
    with caplog.at_level(logging.WARNING, logger="chatserve.sessions"):
        mem = make_session_store(None)
    assert isinstance(mem, InMemorySessionStore) and not mem.persistent
    assert "sessions are not persisted" in caplog.text
    caplog.clear()
    rs = make_session_store(redis_url, prefix=f"chatserve-test-{uuid.uuid4().hex}:", default_ttl_seconds=30)
    try:
        assert isinstance(rs, RedisSessionStore) and rs.persistent and rs.default_ttl_seconds == 30
        assert "not persisted" not in caplog.text
        await rs.ping()
    finally:
        await rs.close()


# --- Redis only ---------------------------------------------------------------------------------


async def test_session_survives_a_new_store_object(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create(system_prompt="sys", metadata={"k": "v"}, defaults={"top_p": 0.9})
    for i in range(1, 3):
        await redis_store.append_turn(s.id, *_turn(i), list(range(10 * i)))
    expected = await redis_store.get_with_messages(s.id)

    # A new process would do exactly this: a new client, same URL and prefix.
    fresh = RedisSessionStore(redis_url, prefix=redis_store.prefix)
    try:
        assert await fresh.get_with_messages(s.id) == expected
        assert await fresh.get_history_tokens(s.id) == list(range(20))
        assert [x.id for x in (await fresh.list()).sessions] == [s.id]
        await fresh.append_turn(s.id, *_turn(3), list(range(30)), expected_num_turns=2)
    finally:
        await fresh.close()
    assert (await redis_store.get(s.id)).num_turns == 3  # type: ignore[union-attr]


class _InterferingStore(RedisSessionStore):
    """Lands a write of another client between this store's WATCH and its MULTI/EXEC."""

    def __init__(self, *args, interfere, times: int = 1, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.interfere = interfere
        self.times = times

    async def _after_watch(self, session_id: str) -> None:
        if self.times > 0:
            self.times -= 1
            await self.interfere(session_id)


@contextlib.asynccontextmanager
async def _interfering(redis_url: str, prefix: str, interfere, times: int = 1):  # type: ignore[no-untyped-def]
    store = _InterferingStore(redis_url, prefix=prefix, interfere=interfere, times=times)
    try:
        yield store
    finally:
        await store.close()


async def test_append_racing_a_delete_writes_nothing(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create()
    await redis_store.append_turn(s.id, *_turn(1), [1, 2])

    async def delete(sid: str) -> None:
        assert await redis_store.delete(sid)

    async with _interfering(redis_url, redis_store.prefix, delete) as racing:
        with pytest.raises(SessionNotFound):
            await racing.append_turn(s.id, *_turn(2), [1, 2, 3, 4])
    # Without WATCH the RPUSH/SET would have re-created the deleted session's keys.
    assert _keys_under(redis_url, redis_store.keys(s.id).session) == []
    assert (await redis_store.list()).sessions == []


async def test_append_racing_another_turn_is_refused_whole(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create()

    async def other_turn(sid: str) -> None:
        await redis_store.append_turn(sid, Message("user", "other"), Message("assistant", "other", "stop"), [5, 5])

    async with _interfering(redis_url, redis_store.prefix, other_turn) as racing:
        with pytest.raises(SessionBusy, match="changed while this turn ran"):
            await racing.append_turn(s.id, *_turn(1), [1, 2, 3], expected_num_turns=0)
    num_turns, messages, tokens = await _state(redis_store, s.id)
    assert (num_turns, [m.content for m in messages], tokens) == (1, ["other", "other"], [5, 5])


async def test_append_retries_after_a_harmless_concurrent_write(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create()

    async def touch(sid: str) -> None:
        await redis_store.touch(sid)

    async with _interfering(redis_url, redis_store.prefix, touch, times=2) as racing:
        updated = await racing.append_turn(s.id, *_turn(1), [1, 2, 3], expected_num_turns=0)
        assert racing.times == 0  # both conflicts happened, and the third attempt went through
    assert updated.num_turns == 1
    num_turns, messages, tokens = await _state(redis_store, s.id)
    assert (num_turns, len(messages), tokens) == (1, 2, [1, 2, 3])  # applied exactly once


async def test_all_keys_share_the_ttl_and_index_is_pruned(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create(ttl_seconds=30)
    await redis_store.append_turn(s.id, *_turn(1), [1, 2])
    k = redis_store.keys(s.id)
    with redis.Redis.from_url(redis_url) as client:
        ttls = [client.pttl(key) for key in (k.session, k.messages, k.tokens)]
        assert all(29_000 < t <= 30_000 for t in ttls), ttls
        assert client.ttl(f"{redis_store.prefix}sessions") == -1  # the index has no TTL...

        dying = [await redis_store.create(ttl_seconds=0.2) for _ in range(3)]
        await redis_store.append_turn(dying[0].id, *_turn(1), [1])
        assert client.zcard(f"{redis_store.prefix}sessions") == 4
        await asyncio.sleep(0.4)
        assert [x.id for x in (await redis_store.list(limit=1)).sessions] == [s.id]
        # ...but listing pruned the expired ids from both index zsets.
        assert client.zrange(f"{redis_store.prefix}sessions", 0, -1) == [s.id.encode()]
        assert client.zrange(f"{redis_store.prefix}sessions:expiry", 0, -1) == [s.id.encode()]
        assert [key for d in dying for key in client.keys(f"{redis_store.prefix}session:{d.id}*")] == []


async def test_forked_keys_share_the_ttl_and_go_with_delete(redis_store: RedisSessionStore, redis_url: str) -> None:
    s = await redis_store.create(ttl_seconds=30)
    await redis_store.append_turn(s.id, *_turn(1), [1, 2])
    fork = await redis_store.fork(s.id, 1)
    empty = await redis_store.fork(s.id, 0)
    with redis.Redis.from_url(redis_url) as client:
        k = redis_store.keys(fork.id)
        ttls = [client.pttl(key) for key in (k.session, k.messages, k.tokens)]
        assert all(29_000 < t <= 30_000 for t in ttls), ttls
        assert client.exists(redis_store.keys(empty.id).tokens) == 0  # no history yet: no key at all
        assert 29_000 < client.pttl(redis_store.keys(empty.id).session) <= 30_000
        await redis_store.update(fork.id, title="renamed")
        assert all(29_000 < client.pttl(key) <= 30_000 for key in (k.session, k.messages, k.tokens))
        assert await redis_store.delete(fork.id)
        assert client.keys(f"{redis_store.prefix}session:{fork.id}*") == []


async def test_outage_raises_unavailable_fast_then_recovers(own_redis: RedisProcess) -> None:
    store = RedisSessionStore(own_redis.url, prefix="chatserve-outage:", socket_timeout=0.5, connect_timeout=0.5)
    try:
        s = await store.create()
        await store.append_turn(s.id, *_turn(1), [1, 2, 3])
        token = await store.acquire_turn_lock(s.id)

        own_redis.kill()
        calls = [
            store.get(s.id),
            store.get_with_messages(s.id),
            store.list(),
            store.create(),
            store.get_messages(s.id),
            store.get_history_tokens(s.id),
            store.append_turn(s.id, *_turn(2), [1, 2, 3, 4]),
            store.touch(s.id),
            store.delete(s.id),
            store.acquire_turn_lock(s.id),
            store.release_turn_lock(s.id, token),
            store.refresh_turn_lock(s.id, token),
            store.ping(),
        ]
        for call in calls:
            # the store gives up on its own (1 s socket timeouts, one retry); the module's timeout mark
            # is only the hang guard
            with pytest.raises(SessionStoreUnavailable, match="cannot reach Redis at redis://127.0.0.1:"):
                await call
        health = await store.health()
        assert not health["ok"] and "cannot reach Redis" in health["error"]
        with pytest.raises(SessionStoreUnavailable):
            async with store.turn_lock(s.id):
                pass

        own_redis.start()  # same port, empty (no persistence): the same object works again
        await store.ping()
        assert await store.get(s.id) is None
        s2 = await store.create()
        await store.append_turn(s2.id, *_turn(1), [4, 5])
        async with store.turn_lock(s2.id):
            pass
        assert [x.id for x in (await store.list()).sessions] == [s2.id]
        assert await store.get_history_tokens(s2.id) == [4, 5]

        own_redis.kill()  # a quick restart between two calls: the pooled connections are stale,
        own_redis.start()  # yet the next call succeeds (one reconnecting retry)
        assert await store.get(s2.id) is None
        s2 = await store.create()
        await store.append_turn(s2.id, *_turn(1), [4, 5])

        own_redis.freeze()  # a hung server: the socket timeout bounds the wait
        with pytest.raises(SessionStoreUnavailable, match="Timeout"):  # the socket timeout ended the wait
            await store.get(s2.id)
        own_redis.thaw()
        assert (await store.get(s2.id)).num_turns == 1  # type: ignore[union-attr]
        assert (await store.health())["ok"]
    finally:
        await store.close()


class _CountingListener:
    """A TCP listener that counts the connections made to it and either closes each one at once (a
    Redis that drops connections) or holds it without a byte of reply (a hung Redis)."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._held: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.answer == "close":
            writer.close()
        else:
            self._held.append(writer)

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._held:
            writer.close()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.mark.parametrize("answer", ["close", "hang"])
async def test_an_outage_costs_each_call_one_connection_and_one_retry(answer: str) -> None:
    """Why an outage answers fast (what a bound on elapsed time would check, counted instead): each
    call opens at most two connections (the one retry, on connection errors only), and a hung server
    costs one socket timeout, not a retry loop. A retry storm, or retries on timeouts, fails here."""
    listener = _CountingListener(answer)
    per_call = {"close": 2, "hang": 1}[answer]
    async with listener as url:
        store = RedisSessionStore(url, prefix="chatserve-count:", socket_timeout=0.2, connect_timeout=0.2)
        try:
            calls = [store.get("sess_" + "0" * 25), store.list(), store.create(), store.ping()]
            for made, call in enumerate(calls, start=1):
                with pytest.raises(SessionStoreUnavailable):
                    await call
                assert listener.connections == per_call * made, (answer, made, listener.connections)
        finally:
            await store.close()
