#!/usr/bin/env python3
"""Serving benchmark over HTTP: TTFT, inter-token latency and throughput against chatserve or any
OpenAI-compatible server (llama.cpp's, vLLM's, ...).

``chatserve bench serve`` (chatserve/bench/) is the vLLM-shaped benchmark, with vLLM's flags and
result keys; this script stays for the workloads it lacks (``abort-storm``, ``fixed``, ``ttft``,
per-turn cache ratios, ``--side-by-side`` / ``--grid`` tables) and for the comparison scripts
that call it (compare_vllm.sh, compare_llamacpp.sh, compare_quantized_serving.sh,
bench_cluster.py). Its prompt text and SSE parsing are chatserve.bench's (text.py, client.py);
it imports them from the checkout it lives in, without torch.

Every request is streamed (SSE) and each chunk is timed as it arrives. Workloads:

- ``shared-prefix``: one long system prompt (about ``--prefix-tokens``, default 1,000 tokens) shared
  by every request, each with a distinct short question (about ``--question-tokens``).
- ``multi-turn``: conversations of ``--turns`` turns (``--num-requests`` counts turns); each turn
  sends the whole history as a stateless client does, or, with ``--sessions``, only the new message
  through chatserve's session API (``POST /v1/sessions``, ``POST /v1/sessions/{id}/messages``).
  Conversations run concurrently (``--concurrency`` conversations at a time); turns of one
  conversation run one after another.
- ``random``: no shared content, prompt lengths uniform in ``--random-input-min..max`` tokens and
  output lengths uniform in ``max(1, T/8)..T`` (T = ``--max-tokens``).
- ``abort-storm``: random-like prompts; a fraction (``--abort-fraction``) of the clients leave at a
  random point of their stream (before the first token up to the last), through the cancel endpoint
  (``POST /v1/requests/{id}/cancel``) or by closing the connection (``--abort-mode``). When the
  server exposes chatserve's Prometheus metrics, reports how many aborts the server counted, how
  soon after each abort, and how long until nothing ran any more.
- ``fixed``: unrelated prompts of about ``--prompt-tokens`` tokens, each generating exactly
  ``--max-tokens`` tokens (with ignore_eos), at ``--concurrency``: ``--concurrency 1`` measures one
  stream's decode speed, ``--num-requests 8 --concurrency 8`` a batch arriving at once.
- ``ttft``: ``fixed`` run one request at a time (concurrency forced to 1), for the time to first token
  of a ``--prompt-tokens`` prompt (use ``--max-tokens 1`` or ``2``); reports the median and the minimum.

In ``fixed`` and ``ttft`` every request starts with its own system message, its number and the run's
random id, so two prompts share at most the template's first few tokens (less than one KV block),
not even across runs against the same server: the prefix cache can never help. (Without a system
message, chat templates such as SmolLM2's insert the same default one, a shared first block.)

Prompts are built from the word lists of ``chatserve/bench/text.py`` with a ``random.Random(seed)``: nothing is
downloaded, the same seed gives the same prompts, and no tokenizer is needed (lengths are
approximate; the real prompt token counts come back in ``usage`` and are reported).

Measures (per request, then p50/p90/p99/mean):

- TTFT: request sent -> first chunk with generated text;
- ITL: gaps between consecutive chunks with text (one chunk is one token on chatserve, llama.cpp
  and vLLM unless text is held back, e.g. half a UTF-8 character);
- TPOT: (e2e - TTFT) / (completion tokens - 1), completion tokens from ``usage`` when reported;
- e2e: request sent -> end of stream;
- all first tokens: first request sent -> the moment the last request got its first token (how
  long the slowest of a burst of users waits);
- decode tok/s per stream: 1000 / TPOT p50.

``output_tokens_per_s`` and ``requests_per_s`` divide by the wall time from the first request sent
to the last stream ended (warm-up requests excluded). ``cached_token_ratio`` is
sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens), ``null`` when the server
reports no cached tokens at all.

Degrades gracefully on servers without chatserve's extras: no ``/metrics`` -> no server-side
numbers; no cancel endpoint -> cancels become disconnects; no session API -> stateless multi-turn
(the JSON's ``settings.notes`` says which happened).

Examples::

    python benchmarks/serving/bench_serving.py --base-url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-requests 32 --concurrency 4 --max-tokens 32 --json bench_results/sp.json --plot sp.png
    python benchmarks/serving/bench_serving.py --workload abort-storm --num-requests 48 --concurrency 16
    python benchmarks/serving/bench_serving.py --side-by-side a.json b.json     # table of saved runs
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout's chatserve
# chatserve.bench's client modules import neither torch nor the engine (chatserve/__init__.py is lazy).
from chatserve.bench.client import StreamError, chunk_text, finish_reason, first_model, parse_prometheus, sse_events  # noqa: E402
from chatserve.bench.text import FOLLOW_UPS as _FOLLOW_UPS  # noqa: E402
from chatserve.bench.text import QUESTIONS as _QUESTIONS  # noqa: E402
from chatserve.bench.text import cap as _cap  # noqa: E402
from chatserve.bench.text import fill as _fill  # noqa: E402
from chatserve.bench.text import question, sentence, text_of_tokens  # noqa: E402,F401

WORKLOADS = ("shared-prefix", "multi-turn", "random", "abort-storm", "fixed", "ttft")

# ---------------------------------------------------------------------------------------------------
# Workload plans: what each request sends. Built up front from the seed, so runs are reproducible.
# ---------------------------------------------------------------------------------------------------
@dataclass
class RequestSpec:
    index: int
    messages: list[dict[str, str]]  # for multi-turn: the system message (if any) + this turn's user text
    max_tokens: int
    conversation: int | None = None
    turn: int | None = None
    abort_mode: str | None = None  # "cancel" | "disconnect"
    abort_after_chunks: int | None = None


@dataclass
class Plan:
    units: list[list[RequestSpec]]  # requests of one unit run one after another (a conversation)
    description: str


def build_plan(args: argparse.Namespace, run_id: str = "") -> Plan:
    """Every request of the workload; run_id starts each fixed/ttft prompt (see the module docstring)."""
    rng = random.Random(args.seed)
    n, t = args.num_requests, args.max_tokens
    if args.workload in ("fixed", "ttft"):
        units = [[RequestSpec(i, [{"role": "system", "content": f"[{i + 1}-{run_id}] You are a helpful assistant."},
                                  {"role": "user", "content": text_of_tokens(rng, args.prompt_tokens)}], t)]
                 for i in range(n)]
        how = "one at a time" if args.workload == "ttft" else f"concurrency {args.concurrency}"
        return Plan(units, f"{n} unrelated ~{args.prompt_tokens}-token prompts, exactly {t} tokens each, {how}")
    if args.workload == "shared-prefix":
        system = ("You are the assistant of the archive of a small coastal village. Answer questions using the "
                  "records below; be brief and precise.\n\nRecords:\n" + text_of_tokens(rng, args.prefix_tokens))
        units = [[RequestSpec(i, [{"role": "system", "content": system},
                                  {"role": "user", "content": question(rng, i, args.question_tokens)}], t)]
                 for i in range(n)]
        return Plan(units, f"{n} requests sharing a ~{args.prefix_tokens}-token system prompt, "
                           f"~{args.question_tokens}-token distinct questions")
    if args.workload == "multi-turn":
        turns = max(1, args.turns)
        convs = math.ceil(n / turns)
        units, i = [], 0
        for c in range(convs):
            unit = []
            for k in range(turns):
                if i >= n:
                    break
                if k == 0:
                    notes = text_of_tokens(rng, args.first_turn_tokens)
                    ask = _cap(_fill(rng.choice(_QUESTIONS), rng))
                    content = f"Conversation {c + 1}. Here are my notes: {notes}\n{ask}"
                else:
                    content = _fill(rng.choice(_FOLLOW_UPS), rng) + " " + text_of_tokens(rng, args.turn_tokens)
                unit.append(RequestSpec(i, [{"role": "user", "content": content}], t, conversation=c, turn=k))
                i += 1
            units.append(unit)
        return Plan(units, f"{convs} conversations x {turns} turns (~{args.first_turn_tokens}-token first message, "
                           f"~{args.turn_tokens}-token follow-ups), whole history sent each turn"
                           + (" (session API)" if args.sessions else ""))
    lo, hi = sorted((args.random_input_min, args.random_input_max))
    units = []
    for i in range(n):
        plen = rng.randint(lo, hi)
        content = f"Request {i + 1}. {text_of_tokens(rng, plen)}"
        if args.workload == "random":
            spec = RequestSpec(i, [{"role": "user", "content": content}], rng.randint(max(1, t // 8), t))
        else:
            spec = RequestSpec(i, [{"role": "user", "content": content}], t)
            if rng.random() < args.abort_fraction:
                mode = args.abort_mode
                if mode == "mixed":
                    mode = rng.choice(("cancel", "disconnect"))
                spec.abort_mode = mode
                spec.abort_after_chunks = rng.randrange(0, max(1, t))
        units.append([spec])
    if args.workload == "random":
        return Plan(units, f"{n} unrelated requests, prompts ~{lo}-{hi} tokens, outputs {max(1, t // 8)}-{t} tokens")
    return Plan(units, f"{n} requests (~{lo}-{hi}-token prompts, {t} tokens), {args.abort_fraction:.0%} of clients "
                       f"leave at a random point ({args.abort_mode})")


# ---------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str | None = None
    request_id: str | None = None
    conversation: int | None = None
    turn: int | None = None
    start: float = 0.0  # perf_counter, seconds
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    num_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    # abort-storm
    abort_mode: str | None = None
    aborted: bool = False
    abort_time: float | None = None  # perf_counter when the client left / asked to cancel
    abort_after_chunks: int | None = None
    cancel_rtt_ms: float | None = None
    cancel_state: dict[str, Any] | None = None
    cancel_to_end_ms: float | None = None

    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    def tpot_ms(self) -> float | None:
        n = self.tokens()
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or n < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)


def dist(xs: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean (linear interpolation between order statistics); None for an empty list."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def pct(q: float) -> float:
        k = (len(s) - 1) * q
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)

    return {"p50": round(pct(0.5), 3), "p90": round(pct(0.9), 3), "p99": round(pct(0.99), 3),
            "mean": round(statistics.fmean(s), 3)}


# ---------------------------------------------------------------------------------------------------
# Server probing and Prometheus metrics (chatserve's names; anything else -> None)
# ---------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.base = args.base_url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = httpx.Timeout(args.timeout, connect=30.0)
        pool = 2 * args.concurrency + 8  # streams + cancel calls + metrics scrapes
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers)
        self.is_chatserve_metrics = False
        self.cancel_supported: bool | None = None  # unknown until tried
        self.sessions_supported: bool | None = None

    async def close(self) -> None:
        await self.client.aclose()

    async def model_name(self) -> str | None:
        return await first_model(self.client, self.base)

    async def metrics(self) -> dict[str, Any] | None:
        """chatserve's metrics, or None if the server exposes none (or other ones)."""
        try:
            r = await self.client.get(f"{self.base}/metrics", timeout=5)
        except httpx.HTTPError:
            return None
        if r.status_code != 200 or "chatserve:num_requests_running" not in r.text:
            return None
        return parse_prometheus(r.text)


_SERVER_COUNTERS = {
    "prefix_cache_queries": "chatserve:prefix_cache_queries_total",
    "prefix_cache_hits": "chatserve:prefix_cache_hits_total",
    "prefill_tokens_computed": "chatserve:prefill_tokens_computed_total",
    "preemptions": "chatserve:num_preemptions_total",
    "generation_tokens": "chatserve:generation_tokens_total",
}


def server_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    d = {k: after.get(v, 0.0) - before.get(v, 0.0) for k, v in _SERVER_COUNTERS.items()}
    q = d["prefix_cache_queries"]
    d["prefix_cache_hit_ratio"] = round(d["prefix_cache_hits"] / q, 4) if q else None
    return d


# ---------------------------------------------------------------------------------------------------
# One streamed request
# ---------------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, args: argparse.Namespace, server: Server, model: str | None, run_id: str) -> None:
        self.args = args
        self.server = server
        self.model = model
        self.run_id = run_id
        self.results: list[RequestResult] = []
        self.done = 0
        self.errors = 0
        self.notes: list[str] = []

    # -- request bodies -----------------------------------------------------------------------------
    def _sampling(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": self.args.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        if self.args.extra_body:
            body.update(self.args.extra_body)
        return body

    def chat_body(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.args.endpoint == "completions":
            prompt = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
            return "/v1/completions", {**self._sampling(max_tokens), "prompt": prompt}
        return "/v1/chat/completions", {**self._sampling(max_tokens), "messages": messages}

    # -- streaming ----------------------------------------------------------------------------------
    async def stream(self, path: str, body: dict[str, Any], res: RequestResult, spec: RequestSpec,
                     session_id: str | None = None) -> None:
        """POST, read SSE, time every chunk with text. Fills res; never raises for HTTP-level failures.
        A session turn carries X-Session-Id, which routers key session affinity on."""
        # NOTE: a UUID: some servers (llama-cpp-python's, via starlette-context) refuse any other
        # X-Request-Id with a bare 400; chatserve takes any printable ASCII id.
        rid = str(uuid.uuid4())
        res.request_id = rid
        headers = {"X-Request-Id": rid, **({"X-Session-Id": session_id} if session_id else {})}
        res.start = time.perf_counter()
        last: float | None = None
        abort_at = spec.abort_after_chunks
        cancelled = False  # the cancel endpoint accepted: keep reading until the server ends the stream
        try:
            async with self.server.client.stream("POST", self.server.base + path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    raw = (await r.aread()).decode(errors="replace")
                    raise StreamError(f"HTTP {r.status_code}: {raw[:300]}")
                if abort_at == 0:
                    if spec.abort_mode == "disconnect" or not await self._start_cancel(rid, res):
                        self._mark_abort(res, "disconnect")
                        return
                    cancelled = True
                async for obj in sse_events(r):
                    now = time.perf_counter()
                    text = chunk_text(obj)
                    if text:
                        if res.ttft_ms is None:
                            res.ttft_ms = (now - res.start) * 1e3
                        elif last is not None:
                            res.itl_ms.append(round((now - last) * 1e3, 3))
                        last = now
                        res.num_chunks += 1
                        res.text += text
                    fr = finish_reason(obj)
                    if fr:
                        res.finish_reason = fr
                    usage = obj.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        if isinstance(details, dict) and details.get("cached_tokens") is not None:
                            res.cached_tokens = details["cached_tokens"]
                    if (not cancelled and abort_at is not None and abort_at > 0
                            and res.num_chunks >= abort_at and text):
                        if spec.abort_mode == "disconnect" or not await self._start_cancel(rid, res):
                            self._mark_abort(res, "disconnect")
                            return  # leaving the `async with` closes the connection mid-stream
                        cancelled = True
            end = time.perf_counter()
            res.e2e_ms = (end - res.start) * 1e3
            if res.aborted:
                res.cancel_to_end_ms = (end - res.abort_time) * 1e3 if res.abort_time else None
                res.ok = False
            elif res.ttft_ms is None:
                raise StreamError(f"stream ended without any text (finish_reason={res.finish_reason})")
            else:
                res.ok = True
        except StreamError as exc:
            res.error = str(exc)
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"[:300]

    def _mark_abort(self, res: RequestResult, mode: str) -> None:
        res.aborted = True
        res.abort_mode = mode
        res.abort_time = res.abort_time or time.perf_counter()
        res.e2e_ms = (res.abort_time - res.start) * 1e3

    async def _start_cancel(self, rid: str, res: RequestResult) -> bool:
        """Ask the server to cancel rid. False when it has no such endpoint (the caller disconnects)."""
        if self.server.cancel_supported is False:
            return False
        res.abort_time = time.perf_counter()
        try:
            r = await self.server.client.post(f"{self.server.base}/v1/requests/{rid}/cancel", timeout=30)
        except httpx.HTTPError as exc:
            self.notes.append(f"cancel endpoint failed ({type(exc).__name__}); disconnecting instead")
            return False
        rtt_ms = (time.perf_counter() - res.abort_time) * 1e3
        if r.status_code != 200:
            if self.server.cancel_supported is None:
                self.server.cancel_supported = False
                self.notes.append(f"no cancel endpoint (HTTP {r.status_code}); cancels became disconnects")
            return False
        self.server.cancel_supported = True
        res.cancel_rtt_ms = rtt_ms
        try:
            res.cancel_state = r.json()
        except ValueError:
            res.cancel_state = None
        res.aborted = True
        res.abort_mode = "cancel"
        return True

    # -- workloads ----------------------------------------------------------------------------------
    async def run_spec(self, spec: RequestSpec, messages: list[dict[str, str]],
                       session_id: str | None) -> RequestResult:
        res = RequestResult(spec.index, conversation=spec.conversation, turn=spec.turn,
                            abort_after_chunks=spec.abort_after_chunks)
        if session_id is not None:
            body = self._sampling(spec.max_tokens)
            body.pop("model", None)
            body["content"] = messages[-1]["content"]
            await self.stream(f"/v1/sessions/{session_id}/messages", body, res, spec, session_id)
        else:
            path, body = self.chat_body(messages, spec.max_tokens)
            await self.stream(path, body, res, spec)
        self.results.append(res)
        self.done += 1
        if res.error:
            self.errors += 1
        return res

    async def create_session(self) -> str | None:
        if self.server.sessions_supported is False:
            return None
        try:
            r = await self.server.client.post(f"{self.server.base}/v1/sessions", json={}, timeout=30)
        except httpx.HTTPError:
            r = None
        if r is None or r.status_code not in (200, 201):
            if self.server.sessions_supported is None:
                self.server.sessions_supported = False
                self.notes.append("no session API (POST /v1/sessions failed); multi-turn ran stateless")
            return None
        self.server.sessions_supported = True
        return r.json().get("id")

    async def run_unit(self, unit: list[RequestSpec]) -> None:
        session_id = await self.create_session() if self.args.sessions else None
        history: list[dict[str, str]] = []
        for spec in unit:
            if spec.turn is None:
                await self.run_spec(spec, spec.messages, None)
                continue
            history = history + spec.messages
            res = await self.run_spec(spec, history, session_id)
            if res.error:
                # The conversation cannot go on consistently; count its remaining turns as failed.
                for rest in unit[unit.index(spec) + 1:]:
                    self.results.append(RequestResult(rest.index, error="skipped: an earlier turn failed",
                                                      conversation=rest.conversation, turn=rest.turn))
                    self.done += 1
                    self.errors += 1
                break
            history = history + [{"role": "assistant", "content": res.text}]
        if session_id is not None:
            try:
                await self.server.client.delete(f"{self.server.base}/v1/sessions/{session_id}", timeout=10)
            except httpx.HTTPError:
                pass

    async def run_all(self, plan: Plan) -> tuple[float, float]:
        sem = asyncio.Semaphore(self.args.concurrency)
        rng = random.Random(self.args.seed + 1)
        rate = self.args.request_rate

        async def guarded(unit: list[RequestSpec]) -> None:
            async with sem:
                await self.run_unit(unit)

        t0 = time.perf_counter()
        tasks = []
        next_at = t0
        for unit in plan.units:
            if rate and math.isfinite(rate) and rate > 0:
                now = time.perf_counter()
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                next_at += rng.expovariate(rate)
            tasks.append(asyncio.create_task(guarded(unit)))
        await asyncio.gather(*tasks)
        return t0, time.perf_counter()


# ---------------------------------------------------------------------------------------------------
# Progress bar (stderr, only on a terminal)
# ---------------------------------------------------------------------------------------------------

async def _cancel(task: asyncio.Task) -> None:
    """Cancel a background task and wait until it has stopped."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass

class Progress:
    def __init__(self, total: int, runner: Runner, enabled: bool) -> None:
        self.total = total
        self.runner = runner
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._task: asyncio.Task | None = None

    def render(self, final: bool = False) -> None:
        r = self.runner
        width = 30
        frac = min(1.0, r.done / self.total) if self.total else 1.0
        filled = int(frac * width)
        elapsed = time.perf_counter() - self.t0
        rate = r.done / elapsed if elapsed > 0 else 0.0
        line = (f"\r[{'#' * filled}{'.' * (width - filled)}] {r.done}/{self.total} requests  "
                f"errors {r.errors}  {rate:.2f} req/s  {elapsed:.0f} s ")
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    async def _loop(self) -> None:
        while True:
            self.render()
            await asyncio.sleep(0.2)

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            await _cancel(self._task)
            self.render(final=True)


# ---------------------------------------------------------------------------------------------------
# Abort-storm: watch the server's metrics while the storm runs
# ---------------------------------------------------------------------------------------------------
class MetricsWatcher:
    def __init__(self, server: Server, interval: float) -> None:
        self.server = server
        self.interval = interval
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            m = await self.server.metrics()
            if m is not None:
                self.samples.append((time.perf_counter(), m))
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            await _cancel(self._task)

    async def wait_idle(self, expected_aborts: float, base_aborts: float, timeout: float) -> float | None:
        """Poll until nothing runs or waits and the abort counters reached expected; the time it happened."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            m = await self.server.metrics()
            if m is None:
                return None
            now = time.perf_counter()
            self.samples.append((now, m))
            aborts = _client_aborts(m) - base_aborts
            if (m.get("chatserve:num_requests_running", 0) == 0 and m.get("chatserve:num_requests_waiting", 0) == 0
                    and aborts >= expected_aborts):
                return now
            await asyncio.sleep(self.interval)
        return None


def _client_aborts(m: dict[str, Any]) -> float:
    by = m.get("aborts_by_reason") or {}
    return by.get("client_disconnect", 0.0) + by.get("cancel_endpoint", 0.0)


def abort_report(runner: Runner, watcher: MetricsWatcher | None, before: dict[str, Any] | None,
                 idle_at: float | None, client_end: float) -> dict[str, Any]:
    aborted = [r for r in runner.results if r.aborted]
    by_mode = {"cancel": sum(r.abort_mode == "cancel" for r in aborted),
               "disconnect": sum(r.abort_mode == "disconnect" for r in aborted)}
    out: dict[str, Any] = {
        "planned": sum(1 for r in runner.results if r.abort_after_chunks is not None),
        "issued": len(aborted),
        "issued_by_mode": by_mode,
        "abort_point_chunks": dist([float(r.abort_after_chunks or 0) for r in aborted]),
        "cancel_endpoint": {True: "used", False: "unsupported (cancels became disconnects)",
                            None: "not used"}[runner.server.cancel_supported],
        "cancel_rtt_ms": dist([r.cancel_rtt_ms for r in aborted if r.cancel_rtt_ms is not None]),
        "cancel_to_stream_end_ms": dist([r.cancel_to_end_ms for r in aborted if r.cancel_to_end_ms is not None]),
        "server_metrics": None,
    }
    states = [r.cancel_state for r in aborted if r.cancel_state]
    if states:
        out["cancel_states"] = {s: sum(1 for x in states if x.get("state_when_cancelled") == s)
                                for s in sorted({str(x.get("state_when_cancelled")) for x in states})}
        out["cancel_blocks_freed"] = sum(int(x.get("blocks_freed") or 0) for x in states)
    if watcher is None or before is None or not watcher.samples:
        return out
    base = _client_aborts(before)
    samples = sorted(watcher.samples, key=lambda s: s[0])
    last = samples[-1][1]
    counted = {k: last["aborts_by_reason"].get(k, 0.0) - before["aborts_by_reason"].get(k, 0.0)
               for k in set(last["aborts_by_reason"]) | set(before["aborts_by_reason"])}
    # The k-th abort the client issued is matched with the first scrape that counted k aborts (FIFO):
    # an upper bound on how long the server took to account it (scrape interval resolution).
    times = sorted(r.abort_time for r in aborted if r.abort_time is not None)
    ack: list[float] = []
    j = 0
    for k, t_issue in enumerate(times, start=1):
        while j < len(samples) and (_client_aborts(samples[j][1]) - base < k or samples[j][0] < t_issue):
            j += 1
        if j >= len(samples):
            break
        ack.append((samples[j][0] - t_issue) * 1e3)
    kv = [s[1].get("chatserve:kv_cache_usage_perc", 0.0) for s in samples]
    out["server_metrics"] = {
        "aborts_counted_by_reason": {k: v for k, v in sorted(counted.items())},
        "freed": int(sum(counted.get(k, 0.0) for k in ("client_disconnect", "cancel_endpoint"))),
        "abort_to_counted_ms": dist(ack),
        "abort_to_counted_ms_max": round(max(ack), 3) if ack else None,
        "idle_after_last_client_ms": round((idle_at - client_end) * 1e3, 3) if idle_at is not None else None,
        "running_after": last.get("chatserve:num_requests_running"),
        "waiting_after": last.get("chatserve:num_requests_waiting"),
        "kv_cache_usage_peak": round(max(kv), 4) if kv else None,
        "kv_cache_usage_after": round(kv[-1], 4) if kv else None,
        "scrape_interval_ms": round(watcher.interval * 1e3, 1),
    }
    return out


# ---------------------------------------------------------------------------------------------------
# Summary, table, JSON, plot
# ---------------------------------------------------------------------------------------------------
def summarize(args: argparse.Namespace, plan: Plan, runner: Runner, t0: float, t1: float, model: str | None,
              server_kind: str, before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    res = sorted(runner.results, key=lambda r: r.index)
    ok = [r for r in res if r.ok]
    duration = max(t1 - t0, 1e-9)
    out_tokens = sum(r.tokens() for r in res if r.ok or r.aborted)
    with_cache = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    prompt_sum = sum(r.prompt_tokens or 0 for r in with_cache)
    cached_ratio = (round(sum(r.cached_tokens or 0 for r in with_cache) / prompt_sum, 4)
                    if with_cache and prompt_sum else None)
    errors = [r.error for r in res if r.error]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    first_tokens_at = [r.start + r.ttft_ms / 1e3 for r in ok if r.ttft_ms is not None]
    tpot = dist([x for r in ok if (x := r.tpot_ms()) is not None])
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "compare", "side_by_side")}
    settings.update({
        "model": model, "server_kind": server_kind, "workload_description": plan.description,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "client_host": socket.gethostname(), "client_cpus": os.cpu_count(), "python": platform.python_version(),
        "notes": sorted(set(runner.notes)), "run_id": runner.run_id,
    })
    summary: dict[str, Any] = {
        "label": args.label or f"{args.workload} @ {args.base_url}",
        "settings": settings,
        "num_requests": len(res),
        "num_completed": len(ok),
        "num_errors": len(errors),
        "num_aborted": sum(r.aborted for r in res),
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(ok) / duration, 4),
        "output_tokens_per_s": round(out_tokens / duration, 3),
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "mean_prompt_tokens": round(statistics.fmean([r.prompt_tokens for r in ok if r.prompt_tokens]), 1)
        if any(r.prompt_tokens for r in ok) else None,
        "cached_token_ratio": cached_ratio,
        "ttft_ms": dist(ttfts),
        "ttft_ms_min": round(min(ttfts), 3) if ttfts else None,
        # None unless every request got its first token: "all of them" is then unknown.
        "all_first_tokens_ms": round((max(first_tokens_at) - t0) * 1e3, 3)
        if first_tokens_at and len(first_tokens_at) == len(res) else None,
        "itl_ms": dist([x for r in ok for x in r.itl_ms]),
        "tpot_ms": tpot,
        "decode_tokens_per_s": round(1e3 / tpot["p50"], 2) if tpot["p50"] else None,
        "e2e_ms": dist([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "errors": sorted(set(errors))[:10],
        "server": server_delta(before, after),
    }
    if args.workload == "multi-turn":
        by_turn = []
        for k in sorted({r.turn for r in ok if r.turn is not None}):
            rs = [r for r in ok if r.turn == k]
            wc = [r for r in rs if r.cached_tokens is not None and r.prompt_tokens]
            by_turn.append({
                "turn": k + 1, "num": len(rs),
                "ttft_ms_p50": dist([r.ttft_ms for r in rs if r.ttft_ms is not None])["p50"],
                "mean_prompt_tokens": round(statistics.fmean([r.prompt_tokens or 0 for r in rs]), 1),
                "cached_token_ratio": round(sum(r.cached_tokens or 0 for r in wc) / sum(r.prompt_tokens for r in wc), 4)
                if wc else None,
            })
        summary["by_turn"] = by_turn
    summary["requests"] = [
        {k: v for k, v in dataclasses.asdict(r).items() if k not in ("text", "start", "abort_time")}
        | {"ttft_ms": None if r.ttft_ms is None else round(r.ttft_ms, 3),
           "e2e_ms": None if r.e2e_ms is None else round(r.e2e_ms, 3)}
        for r in res
    ]
    return summary


def _f(v: Any, spec: str = "{:.1f}") -> str:
    """A table cell; one decimal unless said otherwise."""
    return bc.fmt(v, spec)


TABLE_ROWS: list[tuple[str, Any]] = [
    ("completed / requests", lambda s: f"{s['num_completed']}/{s['num_requests']}"),
    ("errors", lambda s: str(s["num_errors"])),
    ("aborted by client", lambda s: str(s.get("num_aborted", 0))),
    ("mean prompt tokens", lambda s: _f(s.get("mean_prompt_tokens"))),
    ("duration (s)", lambda s: _f(s["duration_s"], "{:.2f}")),
    ("requests/s", lambda s: _f(s["requests_per_s"], "{:.3f}")),
    ("output tokens/s", lambda s: _f(s["output_tokens_per_s"])),
    ("TTFT p50 / p90 / p99 (ms)", lambda s: " / ".join(_f(s["ttft_ms"][k], "{:.0f}") for k in ("p50", "p90", "p99"))),
    ("TTFT mean (ms)", lambda s: _f(s["ttft_ms"]["mean"], "{:.0f}")),
    ("TTFT min (ms)", lambda s: _f(s.get("ttft_ms_min"), "{:.0f}")),
    ("all first tokens by (ms)", lambda s: _f(s.get("all_first_tokens_ms"), "{:.0f}")),
    ("ITL p50 / p90 / p99 (ms)", lambda s: " / ".join(_f(s["itl_ms"][k]) for k in ("p50", "p90", "p99"))),
    ("ITL mean (ms)", lambda s: _f(s["itl_ms"]["mean"])),
    ("TPOT p50 (ms)", lambda s: _f(s.get("tpot_ms", {}).get("p50"))),
    ("decode tok/s per stream", lambda s: _f(s.get("decode_tokens_per_s"))),
    ("e2e p50 / p90 (ms)", lambda s: " / ".join(_f(s["e2e_ms"][k], "{:.0f}") for k in ("p50", "p90"))),
    ("cached token ratio", lambda s: _f(s["cached_token_ratio"], "{:.3f}")),
]


def _abort_cell(summary: dict[str, Any], fn: Any) -> str:
    a = summary.get("abort")
    try:
        return fn(a) if a else "-"
    except (KeyError, TypeError):  # no server metrics (not chatserve)
        return "-"


ABORT_ROWS: list[tuple[str, Any]] = [
    ("aborts issued (cancel/disconnect)",
     lambda a: f"{a['issued']} ({a['issued_by_mode']['cancel']}/{a['issued_by_mode']['disconnect']})"),
    ("aborts counted by server", lambda a: str(a["server_metrics"]["freed"])),
    ("cancel round trip p50/p90 (ms)", lambda a: f"{_f(a['cancel_rtt_ms']['p50'])} / {_f(a['cancel_rtt_ms']['p90'])}"),
    ("abort -> counted p50/max (ms)",
     lambda a: f"{_f(a['server_metrics']['abort_to_counted_ms']['p50'], '{:.0f}')} / "
               f"{_f(a['server_metrics']['abort_to_counted_ms_max'], '{:.0f}')}"),
    ("idle after last stream (ms)", lambda a: _f(a["server_metrics"]["idle_after_last_client_ms"], "{:.0f}")),
    ("KV usage peak / after",
     lambda a: f"{a['server_metrics']['kv_cache_usage_peak']:.3f} / {a['server_metrics']['kv_cache_usage_after']:.3f}"),
]


def format_table(summaries: list[dict[str, Any]], labels: list[str] | None = None) -> str:
    labels = labels or [s.get("label", "?") for s in summaries]
    rows = [["metric", *labels]]
    for name, fn in TABLE_ROWS:
        rows.append([name, *(fn(s) for s in summaries)])
    if any(s.get("abort") for s in summaries):
        for name, fn in ABORT_ROWS:
            rows.append([name, *(_abort_cell(s, fn) for s in summaries)])
    return bc.markdown_table(rows)


# (label, value of a summary, higher is better): the rows of --grid, one block per concurrency.
GRID_ROWS: list[tuple[str, Any, bool, str]] = [
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"], False, "{:.0f}"),
    ("TTFT p90 (ms)", lambda s: s["ttft_ms"]["p90"], False, "{:.0f}"),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"], False, "{:.1f}"),
    ("ITL p90 (ms)", lambda s: s["itl_ms"]["p90"], False, "{:.1f}"),
    ("output tokens/s", lambda s: s.get("output_tokens_per_s"), True, "{:.1f}"),
    ("completed / requests", lambda s: f"{s['num_completed']}/{s['num_requests']}", None, "{}"),
]


def grid_table(runs: list[dict[str, Any]]) -> str:
    """Saved runs of several servers (labels) at several concurrencies as one table: a block of rows
    per concurrency, a column per label (in order of first appearance), then for each label after the
    first the ratio first vs it (>1 = the first label better: lower latency or higher throughput)."""
    labels: list[str] = []
    by: dict[tuple[int, str], dict[str, Any]] = {}
    for run in runs:
        label = str(run.get("label", "?"))
        if label not in labels:
            labels.append(label)
        by[(int(run.get("settings", {}).get("concurrency") or 0), label)] = run
    header = ["concurrency: metric", *labels, *(f"ratio {labels[0]} vs {other}" for other in labels[1:])]
    rows = [header]
    for conc in sorted({c for c, _ in by}):
        for name, fn, higher_better, spec in GRID_ROWS:
            vals = []
            for label in labels:
                run = by.get((conc, label))
                try:
                    vals.append(fn(run) if run else None)
                except (KeyError, TypeError):
                    vals.append(None)
            ratios = []
            for v in vals[1:]:
                if higher_better is None:
                    ratios.append("")
                else:
                    ratios.append(_f(bc.ratio(vals[0], v) if higher_better else bc.ratio(v, vals[0]), "{:.2f}x"))
            rows.append([f"{conc}: {name}", *(_f(v, spec) for v in vals), *ratios])
    return bc.markdown_table(rows)


def write_plot(path: str, runs: list[dict[str, Any]]) -> None:
    """ECDFs of TTFT and ITL (log x), one line per run, medians dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, run in enumerate(runs):
        reqs = [r for r in run.get("requests", []) if r.get("ok")]
        series = {
            "TTFT (ms)": [r["ttft_ms"] for r in reqs if r.get("ttft_ms") is not None],
            "inter-token latency (ms)": [x for r in reqs for x in r.get("itl_ms") or []],
        }
        for ax, (name, xs) in zip(axes, series.items(), strict=True):
            if not xs:
                continue
            xs = sorted(max(x, 1e-3) for x in xs)
            med = statistics.median(xs)
            label = f"{run.get('label', f'run {i + 1}')} (p50 {med:.0f} ms, n={len(xs)})"
            ys = [0.0, *((k + 1) / len(xs) for k in range(len(xs)))]
            c = colors[i % len(colors)]
            ax.step([xs[0], *xs], ys, where="post", color=c, label=label)
            ax.axvline(med, color=c, linestyle="--", linewidth=0.8)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of samples <= x")
            ax.set_title(f"{name.split(' (')[0]}: cumulative distribution")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    s = runs[0].get("settings", {})
    fig.suptitle(f"{s.get('workload')}: {s.get('num_requests')} requests, concurrency {s.get('concurrency')}, "
                 f"max_tokens {s.get('max_tokens')}, model {s.get('model')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------
async def warmup(runner: Runner, n: int) -> None:
    for k in range(n):
        spec = RequestSpec(-1 - k, [{"role": "user", "content": f"Warm-up {k}: say hello."}], 4)
        res = RequestResult(spec.index)
        path, body = runner.chat_body(spec.messages, 4)
        await runner.stream(path, body, res, spec)
        if res.error:
            raise SystemExit(f"warm-up request failed: {res.error}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server(args)
    try:
        model = args.model or await server.model_name()
        before = await server.metrics()
        server.is_chatserve_metrics = before is not None
        server_kind = "chatserve-metrics" if before is not None else "openai-compatible"
        run_id = uuid.uuid4().hex[:8]
        runner = Runner(args, server, model, run_id)
        if args.sessions and args.workload != "multi-turn":
            runner.notes.append("--sessions only applies to multi-turn; ignored")
        if args.workload == "ttft" and args.concurrency != 1:
            runner.notes.append(f"ttft runs one request at a time; --concurrency {args.concurrency} ignored")
            args.concurrency = 1
        await warmup(runner, args.warmup)
        before = await server.metrics()
        plan = build_plan(args, run_id)
        total = sum(len(u) for u in plan.units)
        watcher = None
        if args.workload == "abort-storm" and before is not None:
            watcher = MetricsWatcher(server, args.metrics_interval)
            watcher.start()
        progress = Progress(total, runner, enabled=not args.no_progress and sys.stderr.isatty())
        progress.start()
        try:
            t0, t1 = await runner.run_all(plan)
        finally:
            await progress.stop()
        idle_at = None
        if watcher is not None:
            await watcher.stop()
            issued = sum(1 for r in runner.results if r.aborted)
            idle_at = await watcher.wait_idle(issued, _client_aborts(before), timeout=args.drain_timeout)
        after = await server.metrics()
        summary = summarize(args, plan, runner, t0, t1, model, server_kind, before, after)
        if args.workload == "abort-storm":
            summary["abort"] = abort_report(runner, watcher, before, idle_at, t1)
        return summary
    finally:
        await server.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions, or /v1/completions with a plain-text transcript")
    p.add_argument("--workload", default="shared-prefix", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=32, help="requests (multi-turn: turns in all)")
    p.add_argument("--concurrency", type=int, default=4, help="requests (multi-turn: conversations) in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (multi-turn: conversation starts); inf = all at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vLLM/chatserve extension) so outputs have their planned length")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help='fields merged into every request body, e.g. \'{"logit_bias": {"2": -100}}\' for a server '
                        'without ignore_eos')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="short unmeasured requests first")
    p.add_argument("--timeout", type=float, default=600.0, help="read timeout per request (s)")
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    g = p.add_argument_group("workload shape")
    g.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix: system prompt length")
    g.add_argument("--question-tokens", type=int, default=30, help="shared-prefix: question length")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--first-turn-tokens", type=int, default=200, help="multi-turn: first message length")
    g.add_argument("--turn-tokens", type=int, default=40, help="multi-turn: follow-up message length")
    g.add_argument("--sessions", action="store_true", help="multi-turn through chatserve's session API")
    g.add_argument("--prompt-tokens", type=int, default=1000, help="fixed, ttft: prompt length")
    g.add_argument("--random-input-min", type=int, default=32)
    g.add_argument("--random-input-max", type=int, default=512)
    g.add_argument("--abort-fraction", type=float, default=0.5, help="abort-storm: fraction of clients that leave")
    g.add_argument("--abort-mode", default="mixed", choices=["mixed", "cancel", "disconnect"])
    g.add_argument("--metrics-interval", type=float, default=0.05, help="abort-storm: /metrics scrape interval (s)")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="abort-storm: wait for the server to go idle (s)")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the summary (and per-request samples) here")
    g.add_argument("--plot", default=None, help="write a PNG of TTFT and ITL distributions here")
    g.add_argument("--compare", default=None, help="another run's JSON to overlay in the plot and the table")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--side-by-side", nargs="+", metavar="JSON", default=None,
                   help="only print a table of saved runs (and --plot them together); no requests")
    g.add_argument("--grid", nargs="+", metavar="JSON", default=None,
                   help="only print saved runs as one table by concurrency (rows) and label (columns), "
                        "TTFT/ITL p50/p90 with ratios; no requests")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.prompt_tokens < 1:
        p.error("--num-requests, --concurrency, --max-tokens and --prompt-tokens must be at least 1")
    if not 0.0 <= args.abort_fraction <= 1.0:
        p.error("--abort-fraction must be in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.grid:
        runs = []
        for path in args.grid:
            with open(path) as fh:
                runs.append(json.load(fh))
        print(grid_table(runs))
        return 0
    if args.side_by_side:
        runs = [json.load(open(path)) for path in args.side_by_side]
        print(format_table(runs))
        if args.plot:
            write_plot(args.plot, runs)
        return 0
    summary = asyncio.run(run(args))
    runs = [summary]
    if args.compare:
        with open(args.compare) as fh:
            runs.append(json.load(fh))
    s = summary["settings"]
    print(f"\n{s['workload']}: {s['workload_description']}\nserver {args.base_url} ({s['server_kind']}), "
          f"model {s['model']}, concurrency {args.concurrency}, max_tokens {args.max_tokens}, seed {args.seed}")
    for note in s["notes"]:
        print(f"note: {note}")
    print(format_table(runs))
    if summary.get("by_turn"):
        print("per turn: " + "; ".join(
            f"turn {b['turn']}: TTFT p50 {_f(b['ttft_ms_p50'], '{:.0f}')} ms, "
            f"prompt {b['mean_prompt_tokens']:.0f} tok, cached {_f(b['cached_token_ratio'], '{:.2f}')}"
            for b in summary["by_turn"]))
    if summary["errors"]:
        print("errors (first distinct ones):\n  " + "\n  ".join(summary["errors"]))
    if args.json:
        bc.write_json(args.json, summary, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, runs)
        print(f"wrote {args.plot}")
    return 0 if summary["num_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
