"""The HTTP client of the serving benchmarks: one streamed request, timed chunk by chunk.

What every serving benchmark needs from a server, and nothing chatserve-specific unless asked:
the SSE stream of `/v1/chat/completions` or `/v1/completions` (each chunk with text is a token on
chatserve, vLLM and llama.cpp), the usage the last chunk reports (`stream_options.include_usage`),
the first model of `GET /v1/models`, and the Prometheus text of `/metrics` summed per name.
Only httpx and the standard library: `chatserve bench serve` and benchmarks/serving/bench_serving.py run on a
client machine against any OpenAI-compatible server without torch or the engine.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class StreamError(Exception):
    """The request failed in a way the results report (HTTP status, an error event, bad SSE data)."""


def api_root(url: str) -> str:
    """The server root from a base URL that may end in / or /v1 (vLLM's --base-url has no /v1)."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def chunk_text(obj: dict[str, Any]) -> str:
    """The generated text of one chunk: chat deltas' content or completions' text."""
    parts = []
    for ch in obj.get("choices") or []:
        delta = ch.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or "")
        elif "text" in ch:
            parts.append(ch.get("text") or "")
    return "".join(parts)


def finish_reason(obj: dict[str, Any]) -> str | None:
    for ch in obj.get("choices") or []:
        if ch.get("finish_reason"):
            return ch["finish_reason"]
    return None


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE response's `data:` lines until `[DONE]`; an error event or data
    that is not JSON raises StreamError."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise StreamError(f"bad SSE data: {data[:200]!r}") from exc
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            raise StreamError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
        yield obj


_PROM_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_REASON = re.compile(r'reason="([^"]*)"')


def parse_prometheus(text: str) -> dict[str, Any]:
    """{metric: sum over label sets} plus {"aborts_by_reason": {...}} for chatserve:request_aborts_total."""
    out: dict[str, Any] = {"aborts_by_reason": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
        if name == "chatserve:request_aborts_total" and labels:
            r = _REASON.search(labels)
            if r:
                out["aborts_by_reason"][r.group(1)] = out["aborts_by_reason"].get(r.group(1), 0.0) + value
    return out


async def first_model(client: httpx.AsyncClient, root: str) -> str | None:
    """The id of the first model `GET /v1/models` lists (what vLLM's bench uses without --model)."""
    try:
        r = await client.get(f"{root}/v1/models", timeout=10)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data:
                return data[0].get("id")
    except (httpx.HTTPError, ValueError):
        pass
    return None


@dataclass
class RequestOutput:
    """One streamed request as vLLM's benchmark records it: times in seconds."""

    success: bool = False
    error: str = ""
    generated_text: str = ""
    prompt_len: int = 0  # usage.prompt_tokens when the server reports it, else the dataset's estimate
    output_tokens: int = 0  # usage.completion_tokens when reported, else the chunks with text
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks with text
    latency: float = 0.0  # sent -> end of stream
    start_time: float = 0.0  # perf_counter when sent
    cached_tokens: int | None = None
    finish_reason: str | None = None
    usage_reported: bool = False


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                         headers: dict[str, str] | None = None, prompt_len: int = 0) -> RequestOutput:
    """POST `body` (stream: true) to `url`, time every chunk with text; never raises for a failed
    request (the output says why). A fresh UUID as X-Request-Id: some servers refuse other ids."""
    out = RequestOutput(prompt_len=prompt_len)
    hdrs = {"X-Request-Id": str(uuid.uuid4()), **(headers or {})}
    out.start_time = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=hdrs) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                raise StreamError(f"HTTP {r.status_code}: {raw[:300]}")
            async for obj in sse_events(r):
                now = time.perf_counter()
                text = chunk_text(obj)
                if text:
                    if last is None:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    out.generated_text += text
                out.finish_reason = finish_reason(obj) or out.finish_reason
                usage = obj.get("usage")
                if usage:
                    out.usage_reported = True
                    out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        out.cached_tokens = int(details["cached_tokens"])
        out.latency = time.perf_counter() - out.start_time
        if last is None:
            raise StreamError(f"stream ended without any text (finish_reason={out.finish_reason})")
        if not out.usage_reported:
            out.output_tokens = chunks
        out.success = True
    except StreamError as exc:
        out.error = str(exc)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out
