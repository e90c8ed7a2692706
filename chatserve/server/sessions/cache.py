"""Where a session meets the prefix cache: the lease its turns ask for, and what the cache holds of it."""

from __future__ import annotations

from typing import Any

from chatserve.core.session_kv import SessionKV
from chatserve.server.settings import ServerSettings
from chatserve.sessions import Session


def lease_seconds(settings: ServerSettings, session: Session) -> float:
    """The session's own `defaults.kv_lease_seconds`, else the server's `--kv-lease-seconds`."""
    own = session.defaults.get("kv_lease_seconds")
    return float(own) if own is not None else settings.kv_lease_seconds


def turn_kv(settings: ServerSettings, session: Session, prompt_ids: list[int], history: list[int]) -> SessionKV:
    """What the engine is told about one turn: lease the branch under the session id when the turn
    ends, and how many leading prompt tokens are stored history (so the reply can say whether the
    cache still held them)."""
    shared = 0
    for a, b in zip(prompt_ids, history):
        if a != b:
            break
        shared += 1
    return SessionKV(session.id, lease_seconds(settings, session), shared)


def report_for_api(raw: dict[str, Any]) -> dict[str, Any]:
    """The `kv_cache` object of `GET /v1/sessions/{id}` (`leased_until` in integer unix seconds)."""
    out = dict(raw)
    if out.get("leased_until") is not None:
        out["leased_until"] = int(out["leased_until"])
    return out
