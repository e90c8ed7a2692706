"""`FakeEngine`: the real `AsyncLLMEngine` over the real engine core over a scripted worker.

No model and no copy of the engine: the streams, aborts, metrics, stats, grammar checks and the
death of the engine are the real ones; only the tokens come from a script (tests/helpers/fake_runner.py).
The server's routes, error shapes, SSE framing, cancellation and sessions are tested over it.

What it adds is for tests to look at and steer:

* ``requests``: every request `generate()` accepted, in order (also after it ends): its processed
  prompt, params, metrics and how many tokens it has got (`SubmittedRequest`);
  ``cache_options_seen`` / ``sessions_seen``: the cache options and session each call was given.
* ``reply_ids`` (settable), ``hold`` / ``release()`` and ``kill()``: the scripted worker's controls.
* Grammar checks run the real compiler; ``checked_structured`` / ``structured_timeouts`` record what
  was asked, ``structured_gate`` (an `asyncio.Event`) holds each check until it is set, as a long
  compile would (``structured_cancelled`` counts the waits a leaving client cancelled), and
  ``structured_error`` refuses the next checks with that message, as a grammar that does not compile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import Any

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.engine.input_processor import ProcessedPrompt
from chatserve.engine.kv_event_publisher import KVEventsConfig
from chatserve.engine.request_record import RequestMetrics, RequestRecord
from chatserve.outputs import RequestOutput
from chatserve.sampling_params import SamplingParams
from chatserve.structured import GrammarCompilerService

from .fake_runner import ScriptedWorker, scripted_engine


@dataclass(eq=False)
class SubmittedRequest:
    """A request as the engine took it (the real `RequestRecord`), kept after it ends."""

    record: RequestRecord

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def prompt(self) -> ProcessedPrompt:
        return self.record.prompt

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def metrics(self) -> RequestMetrics:
        return self.record.metrics

    @property
    def finished(self) -> bool:
        return self.record.ended

    @property
    def done(self) -> asyncio.Event:
        """Set once its final output (or error) is in its stream."""
        return self.record.done

    @property
    def num_sent(self) -> int:
        """Tokens each choice has got so far (the engine's count, updated as each step ends)."""
        return self.record.metrics.stats.num_generated_tokens // max(self.record.params.n, 1)


class FakeEngine(AsyncLLMEngine):
    """`AsyncLLMEngine` over `scripted_engine(tokenizer, ...)`. See the module docstring."""

    def __init__(self, tokenizer: Any, *, reply: str = "Hello there, friend.", model_name: str = "fake-model",
                 max_model_len: int = 256, max_num_seqs: int = 4, num_kv_blocks: int | None = None,
                 block_size: int = 16, hold: bool = False, **engine_options: Any) -> None:
        super().__init__(scripted_engine(tokenizer, reply=reply, model_name=model_name, max_model_len=max_model_len,
                                         max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
                                         block_size=block_size, hold=hold, **engine_options))
        self.requests: list[SubmittedRequest] = []
        self.cache_options_seen: list[tuple[Any, list[Any]]] = []  # (cache_salt, cache_leases) of each generate()
        self.sessions_seen: list[Any] = []
        self.checked_structured: list[Any] = []  # the StructuredOutputsParams of each grammar check
        self.structured_timeouts: list[float | None] = []
        self.structured_gate: asyncio.Event | None = None
        self.structured_cancelled = 0
        self.structured_error: str | None = None
        self._num_generated_ids = 0

    # ---- the scripted worker's controls ----------------------------------------------------
    @property
    def worker(self) -> ScriptedWorker:
        return self.engine.worker  # type: ignore[return-value]

    @property
    def reply_ids(self) -> list[int]:
        return self.worker.reply_ids

    @reply_ids.setter
    def reply_ids(self, ids: Iterable[int]) -> None:
        self.worker.reply_ids = list(ids)

    @property
    def hold(self) -> bool:
        return self.worker.hold

    @hold.setter
    def hold(self, value: bool) -> None:
        self.worker.hold = value

    def release(self) -> None:
        self.worker.release()

    def kill(self) -> None:
        """The engine dies as from a failed step: the step in flight raises; with none in flight the loop's
        own death path runs now (a step would only come with the next request)."""
        self.worker.kill()
        if not self.loop_state()["step_in_flight"] and self.is_healthy():
            self._loop.fail(RuntimeError("the scripted worker was killed by the test"))

    @property
    def structured(self) -> GrammarCompilerService:
        """The engine's grammar service (the real one)."""
        return self.engine.structured

    @property
    def kv_events_config(self) -> KVEventsConfig | None:
        return self.engine.kv_events_config

    @kv_events_config.setter
    def kv_events_config(self, config: KVEventsConfig | None) -> None:
        """What /kv_event_sources reports, set without opening the publisher's sockets."""
        self.engine.kv_events_config = config

    # ---- what the server asked for ---------------------------------------------------------
    def generate(self, prompt: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None, *,
                 session: Any = None, cache_salt: str | None = None,
                 cache_leases: Any = None) -> AsyncGenerator[RequestOutput, None]:
        if request_id is None:
            request_id = f"fake-{self._num_generated_ids}"
            self._num_generated_ids += 1
        stream = super().generate(prompt, sampling_params, request_id, session=session, cache_salt=cache_salt,
                                  cache_leases=cache_leases)
        self.requests.append(SubmittedRequest(self._requests.live[request_id]))
        self.sessions_seen.append(session)
        self.cache_options_seen.append((cache_salt, list(cache_leases or [])))
        return stream

    async def check_structured_outputs(self, params: SamplingParams, timeout_s: float | None = None) -> None:
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
        await super().check_structured_outputs(params, timeout_s)
