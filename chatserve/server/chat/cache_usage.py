"""The `chatserve` extension of `usage`: how much of the prompt the prefix cache served, and why not more
(`tiers`: how many matched tokens came from memory, the disk tier and the Redis tier, and why the tier
lookup stopped), (and, with speculative decoding, how many draft tokens were verified and kept: `speculative`).

OpenAI clients ignore unknown `usage` fields, so this rides next to
`prompt_tokens_details.cached_tokens` in every reply, zeros included (see docs/prefix-cache.md, "Why a request
missed the cache"). It is read from each engine request's `RequestStats`, the one record of it.
"""

from __future__ import annotations

from typing import Any

from chatserve.outputs import RequestStats


def tier_report(stats: RequestStats | None) -> dict[str, Any]:
    """Where the matched tokens came from: the tree (``memory``) or loaded from the ``disk`` / ``redis``
    tiers below it, and why the tier lookup stopped (``tier_miss_reason``: None when there was no lookup)."""
    if stats is None or stats.first_scheduled_time is None:
        return {"memory": 0, "disk": 0, "redis": 0, "tier_miss_reason": None}
    disk, redis = stats.num_disk_cached_tokens, stats.num_redis_cached_tokens
    return {"memory": max(0, stats.num_cached_tokens - disk - redis), "disk": disk, "redis": redis,
            "tier_miss_reason": stats.kv_tier_stop}


def prefix_cache_report(stats: RequestStats | None) -> dict[str, Any]:
    """One engine request's lookup; a request never admitted (aborted while queued) reports zeros."""
    if stats is None or stats.first_scheduled_time is None:
        return {"matched_tokens": 0, "miss_reason": "new", "diverged_at": None, "lease_hit": False,
                "session_history_matched": None, "tiers": tier_report(None)}
    return {
        "matched_tokens": stats.num_cached_tokens,
        "miss_reason": stats.cache_miss_reason,
        "diverged_at": stats.cache_diverged_at,
        "lease_hit": stats.cache_lease_hit,
        "session_history_matched": stats.session_history_matched,
        "tiers": tier_report(stats),
    }


def usage_extension(per_prompt: list[RequestStats | None]) -> dict[str, Any]:
    """The whole HTTP request's object: its only prompt's report, or with several prompts (completions)
    the first one's, `matched_tokens` summed, and every prompt's own report under `per_prompt`."""
    reports = [prefix_cache_report(s) for s in per_prompt] or [prefix_cache_report(None)]
    out = dict(reports[0])
    if len(reports) > 1:
        out["matched_tokens"] = sum(r["matched_tokens"] for r in reports)
        out["tiers"] = {k: sum(r["tiers"][k] for r in reports) for k in ("memory", "disk", "redis")}
        out["tiers"]["tier_miss_reason"] = reports[0]["tiers"]["tier_miss_reason"]
        out["per_prompt"] = reports
    drafts = sum(s.num_spec_draft_tokens for s in per_prompt if s is not None)
    if drafts:
        accepted = sum(s.num_spec_accepted_tokens for s in per_prompt if s is not None)
        out["speculative"] = {"draft_tokens": drafts, "accepted_tokens": accepted}
    return out
