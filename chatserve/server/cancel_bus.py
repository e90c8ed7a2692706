"""Cancels that work on any replica: a cancel for a request this process does not hold goes over Redis.

Behind a router the cancel endpoint (`POST /v1/requests/{id}/cancel`) may land on any replica:
under `cache_aware` nothing ties it to the one running the request, and even with a session
header a client that cancels a plain chat request sends none. Rather than ask every client to
repeat routing headers, the replica that does not know the id publishes the cancel on a Redis
channel every replica subscribes to; the owner cancels and answers on a short-lived reply list,
so the caller gets the request's final state exactly as if it had reached the owner. A cancel
nobody owns is the same 404 as on one server.

Redis is the one thing replicas already share (sessions live there), so this adds no new
dependency; without a Redis URL the bus is off and cancels are local only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

CHANNEL = "chatserve:cancel"
_REPLY_PREFIX = "chatserve:cancel:reply:"
_REPLY_TTL_S = 30

# A local cancel: the request's final state if this process holds it, else None.
LocalCancel = Callable[[str], Awaitable[dict[str, Any] | None]]


class CancelBusUnavailable(Exception):
    """Redis did not answer, so a replica that might own the request could not be asked."""


class CancelBus:
    """Publish cancels this process cannot serve; serve the ones other replicas publish."""

    def __init__(self, redis_url: str, *, channel: str = CHANNEL, socket_timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.channel = channel
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=socket_timeout_s,
                                              socket_connect_timeout=socket_timeout_s)
        self._listener: asyncio.Task | None = None
        self.ready = asyncio.Event()  # subscribed (tests wait for it before cancelling through a peer)

    async def start(self, local_cancel: LocalCancel) -> None:
        self._listener = asyncio.get_running_loop().create_task(self._listen(local_cancel))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
        with contextlib.suppress(Exception):
            await self._redis.aclose()

    async def cancel_remote(self, request_id: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
        """Ask the other replicas; the owner's final state, or None when nobody holds `request_id`."""
        reply_key = _REPLY_PREFIX + uuid.uuid4().hex
        try:
            listeners = await self._redis.publish(self.channel, json.dumps({"id": request_id, "reply": reply_key}))
            if listeners == 0:
                return None
            # Every listener answers, ourselves included (the owner with the state, the others with
            # null), so the wait ends as soon as all have spoken instead of running to the timeout.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            for _ in range(listeners):
                left = deadline - loop.time()
                if left <= 0:
                    break
                item = await self._redis.blpop([reply_key], timeout=max(left, 0.01))
                if item is None:
                    break
                state = json.loads(item[1])
                if state is not None:
                    return state
            return None
        except Exception as exc:  # noqa: BLE001 - any Redis failure means "could not ask"
            raise CancelBusUnavailable(str(exc)) from exc
        finally:
            with contextlib.suppress(Exception):
                await self._redis.delete(reply_key)

    async def _listen(self, local_cancel: LocalCancel) -> None:
        """Subscribe and serve peers' cancels until closed; a lost connection is retried with backoff."""
        backoff = 0.2
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.ready.set()
                backoff = 0.2
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        await self._serve(message["data"], local_cancel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: keep serving locally, retry the bus
                self.ready.clear()
                logger.warning("cancel bus: lost Redis (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _serve(self, data: bytes | str, local_cancel: LocalCancel) -> None:
        try:
            msg = json.loads(data)
            request_id, reply_key = str(msg["id"]), str(msg["reply"])
        except (ValueError, KeyError, TypeError):
            logger.warning("cancel bus: ignoring a malformed message %r", data[:200])
            return
        if not reply_key.startswith(_REPLY_PREFIX):
            return
        state = await local_cancel(request_id)
        try:
            await self._redis.rpush(reply_key, json.dumps(state))
            await self._redis.expire(reply_key, _REPLY_TTL_S)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cancel bus: could not answer a cancel of %s: %s", request_id, exc)
