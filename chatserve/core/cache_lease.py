"""What a request asks of the prefix cache beyond its tokens: its salt and the prefixes to lease.

* ``cache_salt`` (vLLM's answer to prefix-cache timing side channels, CVE-2025-46570): a request
  shares KV blocks only with requests of the same salt, in the radix tree, the disk and Redis tiers
  and the KV events (the salt is part of the first block's hash, so the whole chain differs).
* ``CacheLease``: keep the prompt's first ``position`` tokens (whole blocks) cached for ``ttl_s``
  seconds after the request ends, renewed by each later request that matches them (Anthropic's
  ``cache_control`` breakpoints, OpenAI's ``prompt_cache_key``). Soft, like a session's lease: the
  blocks go last when memory is short, never at the cost of a request.

Plain Python: the engine checks these once (``check_cache_salt``, ``check_cache_leases``) and the
block manager acts on them when the request's sequences end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CacheLease", "MAX_CACHE_LEASES", "check_cache_leases", "check_cache_salt"]

MAX_CACHE_LEASES = 4
"""Most leases one request may ask for (Anthropic allows 4 ``cache_control`` breakpoints)."""


@dataclass(frozen=True)
class CacheLease:
    """Lease the prompt's prefix up to ``position`` for ``ttl_s`` seconds.

    ``position``: how many leading prompt tokens the prefix holds (a breakpoint's end, exclusive);
    only whole KV blocks are cached, so ``position // block_size`` blocks are leased, and a position
    past the prompt means the whole prompt. ``ttl_s``: seconds the prefix stays leased after the
    request ends and after each later hit on it (Anthropic: 300 or 3600).
    """

    position: int
    ttl_s: float


def check_cache_salt(salt: object) -> str | None:
    """``salt`` if it is None or a non-empty str; ValueError otherwise (vLLM's rule and wording)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def check_cache_leases(leases: Iterable[CacheLease | tuple[int, float]] | None) -> tuple[CacheLease, ...]:
    """Leases as ``CacheLease``s (a ``(position, ttl_s)`` pair, tuple or list, is taken too), checked: at most
    ``MAX_CACHE_LEASES``, positions ints >= 0, TTLs finite and > 0. Raises ValueError naming the rule."""
    if leases is None:
        return ()
    out: list[CacheLease] = []
    for item in leases:
        lease = item if isinstance(item, CacheLease) else _from_pair(item)
        pos, ttl = lease.position, lease.ttl_s
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise ValueError(f"cache lease position must be an int >= 0 (a prompt token count), got {pos!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"cache lease ttl_s must be a positive number of seconds, got {ttl!r}")
        out.append(lease)
    if len(out) > MAX_CACHE_LEASES:
        raise ValueError(f"a request may lease at most {MAX_CACHE_LEASES} prompt prefixes, got {len(out)}")
    return tuple(out)


def _from_pair(item: object) -> CacheLease:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(f"a cache lease is a CacheLease or a (position, ttl_s) pair, got {item!r}")
    return CacheLease(item[0], item[1])
