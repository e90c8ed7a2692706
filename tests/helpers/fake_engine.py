"""A stand-in for `AsyncLLMEngine` that needs no model: scripted replies, real tokenizer and limits.

The server's routes, error shapes, SSE framing, cancellation and sessions do not depend on what a
model computes, only on the engine's surface: `generate` (an async iterator of delta
`RequestOutput`s), `abort`, `request_metrics`, `stats`, `is_healthy`, and the properties the
server reads (`model_name`, `tokenizer`, `max_model_len`, `max_num_seqs`, `eos_token_ids`,
`input_processor`). This class implements exactly that, with the real `InputProcessor` over the
real tokenizer, so prompt validation and its messages are the engine's own.

Each request replies with `reply` (the same text for every choice), one token per output, and
finishes with "stop", or "length" at max_tokens. Like the real engine it runs each request on its
own (a task feeding a queue), so an abort lands even when nobody iterates the stream. With
`hold=True` every request stops after its first token until `release()` or an abort, which lets a
test cancel a request that is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from chatserve.engine.async_engine import EngineDeadError, RequestMetrics
from chatserve.engine.input_processor import InputProcessor, ProcessedPrompt
from chatserve.outputs import CompletionOutput, Logprob, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams


@dataclass(eq=False)
class FakeRequest:
    """One accepted request, kept (also after it ends) so a test can see what the server asked for."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    metrics: RequestMetrics
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    num_sent: int = 0  # tokens handed out so far, per choice

    @property
    def finished(self) -> bool:
        return self.done.is_set()


class FakeEngine:
    """The `AsyncLLMEngine` surface the server uses, scripted. See the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        reply: str = "Hello there, friend.",
        model_name: str = "fake-model",
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        num_kv_blocks: int = 64,
        block_size: int = 16,
        hold: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._max_num_seqs = max_num_seqs
        self._input_processor = InputProcessor(
            tokenizer, vocab_size=len(tokenizer), max_model_len=max_model_len, max_model_len_note="",
            num_kv_blocks=num_kv_blocks, block_size=block_size,
        )
        self.reply_ids: list[int] = list(tokenizer.encode(reply, add_special_tokens=False))
        self.hold = hold
        self._released = asyncio.Event()
        self.requests: list[FakeRequest] = []  # every accepted request, in order
        self._live: dict[str, FakeRequest] = {}
        self._dead: EngineDeadError | None = None
        self.started = False
        self.shut_down = False
        self.checked_structured: list[Any] = []  # StructuredOutputsParams the server asked to compile
        self.structured_error: str | None = None  # set: check_structured_outputs raises ValueError(this)
        self.structured_gate: asyncio.Event | None = None  # set: check_structured_outputs waits for it
        self.structured_cancelled = 0  # checks cancelled while waiting at the gate
        self.structured_timeouts: list[float | None] = []  # the timeout_s each check was given
        self.sessions_seen: list[Any] = []  # the SessionKV (or None) each generate() was given
        self.cache_options_seen: list[tuple[Any, list[Any]]] = []  # (cache_salt, cache_leases) of each generate()
        self.released_leases: list[str] = []  # session ids the server asked to release
        self.block_size = block_size
        self.kv_events_config: Any = None  # a KVEventsConfig: what /kv_event_sources reports (None: events off)

    # ---- the properties the server reads ------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self._tokenizer.eos_token_id})

    @property
    def input_processor(self) -> InputProcessor:
        return self._input_processor

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    # ---- health and introspection -------------------------------------------------------------
    def is_healthy(self) -> bool:
        return self._dead is None

    def kill(self) -> None:
        """Make the engine dead, as a failed step would: live streams raise, new work is refused."""
        self._dead = EngineDeadError(RuntimeError("fake step failed"))
        for req in list(self._live.values()):
            if req.task is not None:
                req.task.cancel()
            self._end(req, EngineDeadError(RuntimeError("fake step failed")))

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self._live), "num_waiting": 0, "num_total_blocks": 64, "num_free_blocks": 64,
                "num_cached_blocks": 0, "num_live_requests": len(self._live), "is_healthy": self.is_healthy()}

    def loop_state(self) -> dict[str, Any]:
        return {"task_alive": self.started, "step_in_flight": False}

    async def release_kv_lease(self, session_id: str) -> bool:
        self.released_leases.append(session_id)
        return False

    async def session_cache_report(self, session_id: str, history_token_ids: list[int]) -> dict[str, Any]:
        return {"cached_tokens": 0, "history_tokens": len(history_token_ids), "leased": False, "leased_tokens": 0,
                "leased_until": None}

    async def check_integrity(self) -> None:
        return None

    async def check_structured_outputs(self, params: SamplingParams, timeout_s: float | None = None) -> None:
        """The real engine compiles the grammar here; the fake records what was asked and can be told to
        refuse, or (`structured_gate`) to wait until the test opens the gate, as a long compile would;
        `structured_cancelled` counts the waits that were cancelled (their client left)."""
        if params.structured_outputs is not None:
            self.checked_structured.append(params.structured_outputs)
            self.structured_timeouts.append(timeout_s)
            if self.structured_gate is not None:
                try:
                    await self.structured_gate.wait()
                except asyncio.CancelledError:
                    self.structured_cancelled += 1
                    raise
            if self.structured_error is not None:
                raise ValueError(self.structured_error)

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        for req in reversed(self.requests):
            if req.request_id == request_id:
                return req.metrics
        return None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
        for req in list(self._live.values()):
            await self.abort(req.request_id)

    def release(self) -> None:
        """Let held requests run to their end."""
        self._released.set()

    # ---- requests -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | dict[str, Any] | ProcessedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        session: Any = None,
        cache_salt: str | None = None,
        cache_leases: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Refuses at the call, like the real engine; the reply runs in a task of its own."""
        if self._dead is not None:
            raise EngineDeadError(self._dead.cause)
        request_id = request_id or f"fake-{len(self.requests)}"
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id per request")
        processed = self._input_processor.process(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        stats = RequestStats(num_prompt_tokens=processed.num_tokens)
        if session is not None:
            stats.session_history_tokens = session.history_tokens
        self.sessions_seen.append(session)
        self.cache_options_seen.append((cache_salt, list(cache_leases or [])))
        req = FakeRequest(request_id, processed, params, RequestMetrics(request_id, stats))
        self.requests.append(req)
        self._live[request_id] = req
        req.task = asyncio.get_running_loop().create_task(self._produce(req))
        return self._iterate(req)

    async def _produce(self, req: FakeRequest) -> None:
        limit = req.params.max_tokens if req.params.max_tokens is not None else len(self.reply_ids)
        ids = self.reply_ids[:limit]
        for k, tid in enumerate(ids):
            if self.hold and k == 1:
                await self._released.wait()
            await asyncio.sleep(0)
            req.num_sent += 1
            req.metrics.stats.num_generated_tokens += req.params.n
            last = k == len(ids) - 1
            reason = None if not last else ("length" if len(ids) < len(self.reply_ids) else "stop")
            req.queue.put_nowait(self._output(req, [tid], reason))
            if last:
                self._end(req, None, reason)
                return
        self._end(req, self._output(req, [], "stop"), "stop")  # max_tokens=0 or an empty reply

    def _output(self, req: FakeRequest, ids: list[int], reason: str | None) -> RequestOutput:
        text = self._tokenizer.decode(ids) if ids else ""
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [{tid: Logprob(-0.25, rank=1, decoded_token=self._tokenizer.decode([tid]))} for tid in ids]
        outputs = [CompletionOutput(index=i, text=text, token_ids=list(ids), finish_reason=reason,
                                    logprobs=logprobs) for i in range(req.params.n)]
        return RequestOutput(req.request_id, req.prompt.prompt, req.prompt.prompt_token_ids, outputs,
                             finished=reason is not None, stats=req.metrics.stats)

    def _end(self, req: FakeRequest, item: RequestOutput | BaseException | None, reason: str | None = None) -> None:
        if req.finished:
            return
        if item is not None:
            req.queue.put_nowait(item)
        req.metrics.finish_reason = reason
        self._live.pop(req.request_id, None)
        req.done.set()

    async def _iterate(self, req: FakeRequest) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not req.finished:  # leaving early aborts, as in the real engine
                self._abort_now(req)

    def _abort_now(self, req: FakeRequest) -> None:
        if req.finished:
            return
        if req.task is not None:
            req.task.cancel()
        req.metrics.aborted_in_state = "decoding" if req.num_sent else "waiting"
        req.metrics.blocks_freed = 1 if req.num_sent else 0
        self._end(req, self._output(req, [], "abort"), "abort")

    async def abort(self, request_id: str) -> RequestMetrics | None:
        req = self._live.get(request_id)
        if req is None:
            return None
        self._abort_now(req)
        return req.metrics
