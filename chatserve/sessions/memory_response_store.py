"""InMemoryResponseStore: stored responses in this process (lost on restart), bounded in count.

Values are kept as JSON text, as Redis keeps them, so a caller that changes a returned dict never
changes what is stored, and a value that Redis could not store fails here too.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from chatserve.sessions.response_store import (
    DEFAULT_MAX_IN_MEMORY,
    DEFAULT_RESPONSE_TTL_S,
    ResponseStore,
    encode_json,
    is_valid_response_id,
)


class InMemoryResponseStore(ResponseStore):
    persistent = False
    backend = "memory"

    def __init__(self, ttl_seconds: float = DEFAULT_RESPONSE_TTL_S, max_responses: int = DEFAULT_MAX_IN_MEMORY) -> None:
        super().__init__(ttl_seconds)
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        # id -> (response JSON, input items JSON, token ids, expires_at (monotonic)); oldest write first
        self._data: OrderedDict[str, tuple[str, str, list[int], float]] = OrderedDict()

    def _live(self, response_id: str) -> tuple[str, str, list[int], float] | None:
        if not is_valid_response_id(response_id):
            return None
        entry = self._data.get(response_id)
        if entry is not None and entry[3] <= time.monotonic():
            del self._data[response_id]
            return None
        return entry

    async def put(self, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  token_ids: Sequence[int] | None = None) -> None:
        rid = response["id"]
        body = encode_json(response, "response")
        old = self._live(rid)
        items = encode_json(input_items, "input_items") if input_items is not None else (old[1] if old else "[]")
        tokens = [int(t) for t in token_ids] if token_ids is not None else (old[2] if old else [])
        self._data[rid] = (body, items, tokens, time.monotonic() + self.ttl_seconds)
        self._data.move_to_end(rid)
        while len(self._data) > self.max_responses:  # the least recently written goes first
            self._data.popitem(last=False)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._live(response_id)
        return json.loads(entry[0]) if entry else None

    async def get_input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._live(response_id)
        return json.loads(entry[1]) if entry else None

    async def get_token_ids(self, response_id: str) -> list[int] | None:
        entry = self._live(response_id)
        return list(entry[2]) if entry else None

    async def delete(self, response_id: str) -> bool:
        return self._live(response_id) is not None and self._data.pop(response_id, None) is not None

    async def ping(self) -> None:
        return None
