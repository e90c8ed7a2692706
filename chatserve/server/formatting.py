"""OpenAI's response and chunk objects, built from `ChoiceDelta`s. Exactly their field names."""

from __future__ import annotations

import json
from typing import Any

from chatserve.outputs import Logprob

from chatserve.server.serving import ChoiceDelta


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked[:n]


def _token_text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def chat_logprobs(delta: ChoiceDelta, top_n: int) -> dict[str, Any] | None:
    if delta.logprobs is None:
        return None
    content = []
    for tid, entry in zip(delta.token_ids, delta.logprobs):
        chosen = entry[tid]
        text = _token_text(chosen)
        content.append({
            "token": text,
            "logprob": chosen.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": _token_text(lp), "logprob": lp.logprob, "bytes": list(_token_text(lp).encode("utf-8"))}
                for _, lp in _top(entry, top_n)
            ],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(delta: ChoiceDelta, top_n: int, offset: int) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists; text_offset counts from `offset`."""
    if delta.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, entry in zip(delta.token_ids, delta.logprobs):
        chosen = entry[tid]
        text = _token_text(chosen)
        tokens.append(text)
        token_lps.append(chosen.logprob)
        tops.append({_token_text(lp): lp.logprob for _, lp in _top(entry, top_n)} if top_n else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chunk(kind: str, cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Any,
           include_usage: bool) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": cid, "object": kind, "created": created, "model": model, "system_fingerprint": None, "choices": choices,
    }
    if include_usage:
        obj["usage"] = usage
    return obj


def chat_chunk(cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Any = None,
               include_usage: bool = False) -> dict[str, Any]:
    return _chunk("chat.completion.chunk", cid, created, model, choices, usage, include_usage)


def completion_chunk(cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Any = None,
                     include_usage: bool = False) -> dict[str, Any]:
    return _chunk("text_completion", cid, created, model, choices, usage, include_usage)
