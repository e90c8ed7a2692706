"""One request as the async side sees it, from `generate()` accepting it to its last output.

`RequestRecord` holds a request's stream (the queue its iterator reads) and where it stands;
`RequestLedger` holds every live record and applies the engine's events to them. A request ends
in exactly one method, `RequestLedger._end`, whatever ended it: it finished, it was aborted at
any stage (before the loop added it, waiting for a grammar or a KV tier lookup, queued,
prefilling, decoding), the `LLMEngine` refused it, the engine died, or the engine shut down.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.engine.engine_messages import EngineDeadError, EngineDied, EngineEvent, OutputsReady, RequestAborted, RequestFailed
from chatserve.engine.input_processor import ProcessedPrompt
from chatserve.outputs import CompletionOutput, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams

# Finished requests whose metrics are kept for inspection (`RequestLedger.recent_metrics`).
METRICS_HISTORY = 1024


@dataclass
class RequestMetrics:
    """One request's life as the async side saw it: its `RequestStats` (timings and counters,
    filled by the engine) plus what only the async side knows: how it ended and, for an abort,
    when and where it landed. The timing names read through to `stats`, so there is one copy.
    """

    request_id: str
    stats: RequestStats  # arrival_time is when generate() accepted it
    finish_reason: str | None = None
    # LLMEngine.num_steps when an abort was asked for and when the final output was handed over:
    # finish_step - abort_step <= 1 (an abort waits at most for the step in flight).
    abort_step: int | None = None
    finish_step: int | None = None
    # Set when an abort lands: where the request stood ("waiting", "prefilling", "decoding") and how
    # many KV blocks it gave back (see LLMEngine.describe_request). None if it finished on its own.
    aborted_in_state: str | None = None
    blocks_freed: int = 0

    @property
    def arrival_time(self) -> float:
        return self.stats.arrival_time

    @property
    def first_scheduled_time(self) -> float | None:
        return self.stats.first_scheduled_time

    @property
    def first_token_time(self) -> float | None:
        return self.stats.first_token_time

    @property
    def finish_time(self) -> float | None:
        return self.stats.finish_time

    @property
    def num_prompt_tokens(self) -> int:
        return self.stats.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.stats.num_cached_tokens

    @property
    def num_generated_tokens(self) -> int:
        return self.stats.num_generated_tokens

    @property
    def queue_time(self) -> float | None:
        return self.stats.queue_time

    @property
    def time_to_first_token(self) -> float | None:
        return self.stats.time_to_first_token

    @property
    def latency(self) -> float | None:
        return self.stats.latency


class RequestStage(enum.Enum):
    """Where a request stands, as the async side knows it."""

    ACCEPTED = "accepted"  # generate() took it; its AddRequest is queued for the next step boundary
    IN_ENGINE = "in_engine"  # the LLMEngine holds it (waiting for a grammar or KV, queued, running)
    ENDED = "ended"  # its final output (or its error) is in the queue: nothing more comes


@dataclass(eq=False)
class RequestRecord:
    """Owns one request's stream: the prompt processed once by `generate()`, its sampling and cache
    options, its metrics, the queue its iterator reads (`RequestOutput`s, or one exception last),
    the event set when it ends, and its stage. Only `RequestLedger` ends it."""

    request_id: str
    prompt: ProcessedPrompt  # processed once, eagerly, by generate()
    params: SamplingParams
    metrics: RequestMetrics
    session: SessionKV | None = None  # a session turn (its cache branch is leased when it ends)
    cache_salt: str | None = None  # shares KV blocks only with requests of the same salt
    cache_leases: tuple[CacheLease, ...] = ()  # prompt prefixes leased when it ends
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once the final item is queued
    stage: RequestStage = RequestStage.ACCEPTED
    abort_queued: bool = False  # an AbortRequest for it is on its way to the loop

    @property
    def ended(self) -> bool:
        return self.stage is RequestStage.ENDED

    def abort_output(self) -> RequestOutput:
        """The final output of a request that never reached the `LLMEngine` (or had left it already)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt.prompt,
            prompt_token_ids=self.prompt.prompt_token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(self.params.n)],
            finished=True,
            stats=self.metrics.stats,
        )


class RequestLedger:
    """Owns the live requests' records (by id, from `admit` to their end), the metrics of the last
    `METRICS_HISTORY` finished ones and the count of ended requests. Engine events come in through
    `apply`; a request's end (its final metrics, the live count, the history, the stream's last
    item and its `done` event) is recorded in `_end` alone, once per request.

    Event-loop thread only, like everything that touches the records.
    """

    def __init__(self, history: int = METRICS_HISTORY) -> None:
        self.live: dict[str, RequestRecord] = {}  # accepted and not yet ended
        self.recent_metrics: collections.deque[RequestMetrics] = collections.deque(maxlen=history)
        self.num_ended = 0  # requests ended since start, however they ended (each counted once)

    def admit(self, record: RequestRecord) -> None:
        """Start tracking an accepted request (the caller has refused a duplicate live id already)."""
        assert record.request_id not in self.live, record.request_id
        self.live[record.request_id] = record

    def metrics(self, request_id: str) -> RequestMetrics | None:
        """A live request's metrics, or a recently finished one's."""
        record = self.live.get(request_id)
        if record is not None:
            return record.metrics
        return next((m for m in reversed(self.recent_metrics) if m.request_id == request_id), None)

    def apply(self, event: EngineEvent) -> None:
        match event:
            case OutputsReady(outputs=outputs, step=step):
                live = self.live
                for out in outputs:  # NOTE: the hot path: one dict lookup and one queue put per output
                    record = live.get(out.request_id)
                    if record is None or record.stage is RequestStage.ENDED:
                        continue
                    if out.finished:
                        self._end(record, out, step)
                    else:
                        record.queue.put_nowait(out)
            case RequestAborted(record=record, final=final, state=state, blocks_freed=blocks_freed, step=step):
                if not record.ended:
                    record.metrics.aborted_in_state = state
                    record.metrics.blocks_freed = blocks_freed
                self._end(record, final, step)
            case RequestFailed(record=record, error=error):
                self._end(record, error)
            case EngineDied(cause=cause):
                for record in list(self.live.values()):
                    # NOTE: one exception object per stream: raising one object in many tasks tangles tracebacks.
                    self._end(record, EngineDeadError(cause))

    def _end(self, record: RequestRecord, final: RequestOutput | BaseException, step: int | None = None) -> None:
        """The one place a request ends: its final metrics, out of the live set, into the history and
        the ended count, its last item queued and its `done` event set. A second end is a no-op."""
        if record.stage is RequestStage.ENDED:
            return
        record.stage = RequestStage.ENDED
        m = record.metrics
        if isinstance(final, RequestOutput):
            # NOTE: final.stats is m.stats (the engine fills the record generate() made; abort_output passes it too).
            if m.stats.finish_time is None:
                m.stats.finish_time = time.monotonic()
            m.finish_step = step
            m.finish_reason = next((o.finish_reason for o in final.outputs if o.finish_reason), None)
        if self.live.get(record.request_id) is record:
            del self.live[record.request_id]
        self.recent_metrics.append(m)
        self.num_ended += 1
        record.queue.put_nowait(final)
        record.done.set()
