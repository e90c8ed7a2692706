"""RedisResponseStore: stored responses shared by every replica and kept across restarts.

Key layout (every key starts with the session store's prefix, "chatserve:" by default):

    {prefix}response:{id}           string  the response object (JSON)
    {prefix}response:{id}:input     string  its input items (JSON list)
    {prefix}response:{id}:tokens    string  the conversation's token ids through it, little-endian uint32

All three share one TTL, set again by every write (one MULTI/EXEC), so they expire together.
It runs on the session store's Redis client (its pool, timeouts, retry and error wording:
`redis_store.redis_errors`), not a second connection setup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import redis.asyncio as aioredis

from chatserve.sessions.models import decode_token_ids, encode_token_ids, ttl_ms
from chatserve.sessions.redis_store import RedisSessionStore, redis_errors
from chatserve.sessions.response_store import (
    DEFAULT_RESPONSE_TTL_S,
    ResponseStore,
    ResponseStoreUnavailable,
    encode_json,
    is_valid_response_id,
)


class _Keys(NamedTuple):
    response: str
    input: str
    tokens: str


class RedisResponseStore(ResponseStore):
    persistent = True
    backend = "redis"

    def __init__(self, client: aioredis.Redis, *, url: str, prefix: str = "chatserve:",
                 ttl_seconds: float = DEFAULT_RESPONSE_TTL_S) -> None:
        super().__init__(ttl_seconds)
        self._client = client
        self.url = url
        self.prefix = prefix

    @classmethod
    def beside(cls, sessions: RedisSessionStore, ttl_seconds: float = DEFAULT_RESPONSE_TTL_S) -> RedisResponseStore:
        """A response store in the same Redis, under the same prefix, on the same client as `sessions`."""
        return cls(sessions.client, url=sessions.url, prefix=sessions.prefix, ttl_seconds=ttl_seconds)

    def keys(self, response_id: str) -> _Keys:
        """The keys of one response (public so tests and operators can inspect them)."""
        base = f"{self.prefix}response:{response_id}"
        return _Keys(base, f"{base}:input", f"{base}:tokens")

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return redis_errors(self.url, doing, ResponseStoreUnavailable, "response store", "stored responses")

    async def put(self, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  token_ids: Sequence[int] | None = None) -> None:
        k = self.keys(response["id"])
        body = encode_json(response, "response")  # serialise first: a bad value writes nothing
        items = encode_json(input_items, "input_items") if input_items is not None else None
        tokens = encode_token_ids(token_ids) if token_ids else None
        ms = ttl_ms(self.ttl_seconds)
        with self._errors("store a response"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(k.response, body, px=ms)
                if items is not None:
                    pipe.set(k.input, items, px=ms)
                else:
                    pipe.pexpire(k.input, ms)
                if tokens is not None:
                    pipe.set(k.tokens, tokens, px=ms)
                elif token_ids is not None:  # [] replaces: no tokens (yet)
                    pipe.delete(k.tokens)
                else:
                    pipe.pexpire(k.tokens, ms)
                await pipe.execute()

    async def get(self, response_id: str) -> dict[str, Any] | None:
        if not is_valid_response_id(response_id):
            return None
        with self._errors("read a response"):
            raw = await self._client.get(self.keys(response_id).response)
        return json.loads(raw) if raw else None

    async def get_input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        if not is_valid_response_id(response_id):
            return None
        k = self.keys(response_id)
        with self._errors("read a response's input items"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(k.response)
                pipe.get(k.input)
                exists, raw = await pipe.execute()
        if not exists:
            return None
        return json.loads(raw) if raw else []

    async def get_token_ids(self, response_id: str) -> list[int] | None:
        if not is_valid_response_id(response_id):
            return None
        k = self.keys(response_id)
        with self._errors("read a response's token ids"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(k.response)
                pipe.get(k.tokens)
                exists, blob = await pipe.execute()
        return decode_token_ids(blob) if exists else None

    async def delete(self, response_id: str) -> bool:
        if not is_valid_response_id(response_id):
            return False
        with self._errors("delete a response"):
            deleted = await self._client.delete(*self.keys(response_id))
        return deleted > 0

    async def ping(self) -> None:
        with self._errors("ping"):
            await self._client.ping()
