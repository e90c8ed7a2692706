"""Session records: typed dataclasses, their JSON codecs, and the id scheme.

Two representations of each record:

- ``to_dict()`` is the public JSON object the HTTP API returns (timestamps as integer
  unix seconds, like OpenAI's ``created``).
- ``to_record()`` / ``from_record()`` is the lossless form the stores keep (float
  timestamps). Both stores keep records as JSON, so what comes back is exactly what a
  JSON round trip gives (tuples become lists, and so on) whichever store is in use.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chatserve.sessions.errors import SessionValidationError

# NOTE: ids are "sess_" + 13 hex digits of creation time in microseconds + 12 random hex
# digits. Fixed width, so lexicographic order == creation order; listing and its `after`
# cursor rely on that (a cursor keeps working even after its session is deleted).
SESSION_ID_RE = re.compile(r"^sess_[0-9a-f]{25}$")

MESSAGE_ROLES = ("user", "assistant")


def is_valid_session_id(session_id: object) -> bool:
    """Whether `session_id` is shaped like an id we issue (anything else is simply unknown)."""
    return isinstance(session_id, str) and SESSION_ID_RE.match(session_id) is not None


class SessionIdGenerator:
    """Issues time-ordered ids; strictly increasing within one generator (one store)."""

    def __init__(self) -> None:
        self._last_us = 0

    def __call__(self) -> tuple[str, float]:
        """Returns (id, created_at in unix seconds)."""
        now_us = time.time_ns() // 1000
        self._last_us = max(now_us, self._last_us + 1)
        return f"sess_{self._last_us:013x}{secrets.token_hex(6)}", self._last_us / 1e6


def dumps_json(value: Any, what: str) -> str:
    """Strict JSON (no NaN/Infinity) or a SessionValidationError naming the field."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise SessionValidationError(f"{what} must be JSON-serialisable: {e}") from e


def json_round_trip(value: Any, what: str) -> Any:
    return json.loads(dumps_json(value, what))


def check_ttl(ttl_seconds: object, what: str = "ttl_seconds") -> float:
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float)):
        raise SessionValidationError(f"{what} must be a number of seconds, got {ttl_seconds!r}")
    if not math.isfinite(ttl_seconds) or ttl_seconds < 0.001:
        raise SessionValidationError(f"{what} must be a positive, finite number of seconds, got {ttl_seconds!r}")
    return ttl_seconds


def ttl_ms(ttl_seconds: float) -> int:
    return max(1, int(round(ttl_seconds * 1000)))


@dataclass
class Session:
    """A conversation's metadata. `num_turns` counts finished (stored) turns."""

    id: str
    created_at: float
    updated_at: float
    expires_at: float  # wall-clock estimate; the store's own TTL is authoritative
    ttl_seconds: float
    system_prompt: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)  # sampling params: temperature, top_p, max_tokens, ...
    model: str | None = None
    num_turns: int = 0
    title: str | None = None  # set by PATCH (rename); the page shows it in its chat list
    # Set on a session made by `fork`: {"session_id": the source, "turn": turns kept from it}.
    forked_from: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The session object of the HTTP API."""
        return {
            "id": self.id,
            "object": "session",
            "created_at": int(self.created_at),
            "updated_at": int(self.updated_at),
            "expires_at": int(self.expires_at),
            "system_prompt": self.system_prompt,
            "metadata": self.metadata,
            "ttl_seconds": self.ttl_seconds,
            "num_turns": self.num_turns,
            "defaults": self.defaults,
            "model": self.model,
            "title": self.title,
            "forked_from": self.forked_from,
        }

    def to_record(self) -> dict[str, str]:
        """Field -> JSON text (a Redis hash maps onto this one to one)."""
        return {
            "id": dumps_json(self.id, "id"),
            "created_at": dumps_json(self.created_at, "created_at"),
            "updated_at": dumps_json(self.updated_at, "updated_at"),
            "expires_at": dumps_json(self.expires_at, "expires_at"),
            "ttl_seconds": dumps_json(self.ttl_seconds, "ttl_seconds"),
            "system_prompt": dumps_json(self.system_prompt, "system_prompt"),
            "metadata": dumps_json(self.metadata, "metadata"),
            "defaults": dumps_json(self.defaults, "defaults"),
            "model": dumps_json(self.model, "model"),
            "num_turns": dumps_json(self.num_turns, "num_turns"),
            "title": dumps_json(self.title, "title"),
            "forked_from": dumps_json(self.forked_from, "forked_from"),
        }

    @classmethod
    def from_record(cls, record: dict[str, str | bytes]) -> Session:
        v = {k: json.loads(x) for k, x in record.items()}
        return cls(
            id=v["id"],
            created_at=v["created_at"],
            updated_at=v["updated_at"],
            expires_at=v["expires_at"],
            ttl_seconds=v["ttl_seconds"],
            system_prompt=v["system_prompt"],
            metadata=v["metadata"],
            defaults=v["defaults"],
            model=v["model"],
            num_turns=v["num_turns"],
            title=v.get("title"),  # records written before rename/fork existed lack these two
            forked_from=v.get("forked_from"),
        )


@dataclass
class Message:
    """One stored message of a turn. `finish_reason` ("stop", "length", "abort", ...) and
    `usage` (the OpenAI usage object) are set on the assistant message only."""

    role: str
    content: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    # Assistant only: how the reply ran (ttft_s, decode_tokens_per_s, prompt/cached/completion
    # tokens), kept so a reloaded page still shows each reply's numbers.
    stats: dict[str, Any] | None = None
    # Assistant only: where this turn's prompt ends and where the turn ends in the session's token
    # history. `fork` keeps history[:history_end] of its last kept turn; `regenerate` prompts with
    # history[:prompt_end] of the last turn, so both reuse the cached KV exactly.
    prompt_end: int | None = None
    history_end: int | None = None
    # Assistant only: the reply's reasoning (a reasoning model's thinking, split off by the server's
    # reasoning parser), kept apart from `content`, the answer. The token history holds it exactly as
    # generated, markers included, so the next turn's prompt still matches the cache in full.
    reasoning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message object of the HTTP API (`reasoning` only on a reply that reasoned)."""
        out = {
            "role": self.role,
            "content": self.content,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "created_at": int(self.created_at),
            "stats": self.stats,
        }
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        return out

    def to_record(self) -> str:
        if self.role not in MESSAGE_ROLES:
            raise SessionValidationError(f"message role must be one of {MESSAGE_ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise SessionValidationError(f"message content must be a string, got {type(self.content).__name__}")
        fields = {
            "role": self.role,
            "content": self.content,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "created_at": self.created_at,
            "stats": self.stats,
            "prompt_end": self.prompt_end,
            "history_end": self.history_end,
        }
        if self.reasoning is not None:  # (records without it read back as None: older turns, non-reasoning models)
            if not isinstance(self.reasoning, str):
                raise SessionValidationError(f"message reasoning must be a string, got {type(self.reasoning).__name__}")
            fields["reasoning"] = self.reasoning
        return dumps_json(fields, f"{self.role} message")

    @classmethod
    def from_record(cls, record: str | bytes) -> Message:
        return cls(**json.loads(record))


def turn_bounds(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """[start, end) of each stored turn in a session's messages: a turn is the messages up to and
    including the assistant reply that ends it (today one user message and one reply)."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for i, m in enumerate(messages):
        if m.role == "assistant":
            bounds.append((start, i + 1))
            start = i + 1
    return bounds


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (4 bytes a token); a turn always has some."""
    try:
        packed = array("I", token_ids)
    except (TypeError, OverflowError) as e:
        raise SessionValidationError(f"history_token_ids must be ints in [0, 2**32): {e}") from e
    if len(packed) == 0:
        raise SessionValidationError("history_token_ids must not be empty (it holds the whole conversation)")
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte unsigned int
        raise RuntimeError("array('I') is not 4 bytes on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def decode_token_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    packed = array("I")
    packed.frombytes(blob)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()
