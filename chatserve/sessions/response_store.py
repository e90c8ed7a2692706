"""The ResponseStore interface: stored Responses API objects, in Redis or in memory.

What a stored response holds, and why:

- the response object as the API returns it (status, output, usage, ...), rewritten as the run
  moves from queued / in_progress to its final status, so `GET /v1/responses/{id}` and a cancel
  from any replica see where it is;
- its input items (what `GET /v1/responses/{id}/input_items` lists);
- the **exact token ids** of the conversation up to and including its output (prompt ids plus
  generated ids, as the model saw and produced them), written once the run ends. A request with
  `previous_response_id` continues from these tokens (plus only its new items, rendered with the
  sentinel cut of session turns), so the prefix cache matches the whole earlier conversation.

Semantics shared by every store (the contract tests in tests/sessions/test_response_store.py hold both
to them): ids are issued by the server (`new_response_id`); an id that is unknown, expired,
deleted or not shaped like one is "not found" (None / False); every key of a response shares one
TTL, restarted by every write; `delete` removes every key; backend failures raise
ResponseStoreUnavailable (HTTP 503), and the same store works again once the backend is back.
"""

from __future__ import annotations

import abc
import re
import secrets
import time
from collections.abc import Sequence
from typing import Any

from chatserve.sessions.errors import SessionStoreError
from chatserve.sessions.models import check_ttl, dumps_json

DEFAULT_RESPONSE_TTL_S = 24 * 3600.0
DEFAULT_MAX_IN_MEMORY = 10_000

# NOTE: "resp_" + 13 hex digits of creation time in microseconds + 19 random hex digits: the same
# width as OpenAI's ids, unguessable, and sortable by creation time.
RESPONSE_ID_RE = re.compile(r"^resp_[0-9a-f]{32}$")


class ResponseStoreUnavailable(SessionStoreError):
    """The backing store (Redis) cannot be reached or failed. HTTP 503; retry later."""


def new_response_id() -> str:
    return f"resp_{time.time_ns() // 1000:013x}{secrets.token_hex(10)[:19]}"


def new_item_id(prefix: str) -> str:
    """An output or input item's id: "msg_...", "fc_...", "fco_..."."""
    return f"{prefix}_{secrets.token_hex(16)}"


def is_valid_response_id(response_id: object) -> bool:
    return isinstance(response_id, str) and RESPONSE_ID_RE.match(response_id) is not None


class ResponseStore(abc.ABC):
    """Async storage of responses. Not thread-safe: use it from one event loop."""

    persistent: bool = False
    backend: str = ""

    def __init__(self, ttl_seconds: float = DEFAULT_RESPONSE_TTL_S) -> None:
        self.ttl_seconds = check_ttl(ttl_seconds, "ttl_seconds")

    @abc.abstractmethod
    async def put(self, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  token_ids: Sequence[int] | None = None) -> None:
        """Writes `response` (its `id` is the key) and restarts the TTL of every key of it.
        `input_items` / `token_ids` None keeps what is stored (a status update); given, they replace it."""

    @abc.abstractmethod
    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The response object, or None."""

    @abc.abstractmethod
    async def get_input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """Its input items, oldest first, or None if there is no such response."""

    @abc.abstractmethod
    async def get_token_ids(self, response_id: str) -> list[int] | None:
        """The exact token ids of the conversation through this response ([] while it runs), or None."""

    @abc.abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Removes every key of the response; True if it existed."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Returns if the backend answers; raises ResponseStoreUnavailable otherwise."""


def encode_json(value: Any, what: str) -> str:
    """Strict JSON of a response or its items (SessionValidationError names `what` otherwise)."""
    return dumps_json(value, what)
