"""The engine core: one step is schedule, execute, update.

Everything it runs on is handed in (engine/builder.py builds the real parts from `EngineArgs`): the
scheduler and its block manager, the worker (a `ModelRunner`, or a test's fake: worker/interface.py),
the grammar service, the KV tiers and the KV event publisher. Nothing lives in module globals, so
several engines share one process.
"""

from __future__ import annotations

from collections.abc import Callable

from chatserve.cache import KVEventLog
from chatserve.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from chatserve.core.sequence import Sequence
from chatserve.engine.admission import Admission
from chatserve.engine.kv_event_publisher import KVEventPublisher
from chatserve.engine.kv_tiering import KVTiering
from chatserve.engine.output_processor import OutputProcessor, end_sequence
from chatserve.engine.request import Request
from chatserve.outputs import RequestOutput
from chatserve.structured import GrammarCompilerService
from chatserve.worker.interface import Worker
from chatserve.worker.model_runner import StepInterrupted
from chatserve.worker.spec_verify import SampledSeq


class EngineCore:
    """Owns the step and the requests' lifecycle around it: admission (`admission`: grammar and KV
    tier waits), the `scheduler` (and its `block_manager`), one forward pass per step on the
    `worker`, the `output_processor` (tokens to outputs), aborts (also mid-prefill, between
    layers) and the flush of each step's KV events. It builds none of them."""

    def __init__(
        self, *, scheduler: Scheduler, worker: Worker, output_processor: OutputProcessor,
        structured: GrammarCompilerService, kv_tiering: KVTiering | None = None,
        kv_event_log: KVEventLog | None = None, kv_event_publisher: KVEventPublisher | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.blocks
        self.worker = worker
        self.output_processor = output_processor
        self.structured = structured
        self.kv_tiering = kv_tiering
        self.kv_event_log = kv_event_log
        self.kv_event_publisher = kv_event_publisher
        self.admission = Admission(scheduler, scheduler.blocks, structured, kv_tiering, on_failed=self._fail_request)
        self.num_steps = 0
        self.num_interrupted_steps = 0
        # Ids an abort is coming for (added from any thread, e.g. the async engine's event loop, while a
        # step runs): a prefill step whose every sequence is in here stops between layers.
        self.abort_requested: set[str] = set()

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            self.admission.admit_ready()  # grammars compiled, KV loaded from the tiers
            batch = self._schedule()
            if batch.is_empty:
                return self.output_processor.drain()
            sampled = self._execute(batch)  # None: interrupted (every request in it is being aborted)
            if sampled is None:
                return self.output_processor.drain()
            updated = self.scheduler.update_from_output(batch, sampled, self.output_processor.append_tokens)
            return self.output_processor.process(updated)
        finally:
            self.flush_kv_events()

    def _schedule(self) -> SchedulerOutput:
        """This step's batch; when nothing can run but a grammar or a tier lookup is pending, wait for
        it briefly (the offline loop would spin otherwise) and schedule again."""
        batch = self.scheduler.schedule()
        if batch.is_empty and self.admission.wait_for_grammar():
            batch = self.scheduler.schedule()
        if batch.is_empty and self.admission.wait_for_kv():
            batch = self.scheduler.schedule()
        return batch

    def _execute(self, batch: SchedulerOutput) -> list[SampledSeq] | None:
        """One forward pass (block copies first); None when it was interrupted between layers."""
        self.num_steps += 1
        scheduled = batch.scheduled
        copies = self.block_manager.take_pending_copies()
        try:
            return self.worker.execute(scheduled, copies=copies, between_layers=self._interrupt_check(scheduled))
        except StepInterrupted:
            # Nothing of this step counts: no token computed, no block published (the partly
            # written KV is in blocks the coming abort frees), no sample drawn.
            self.num_interrupted_steps += 1
            return None
        finally:
            self.block_manager.finish_copies(copies)

    def _interrupt_check(self, scheduled: list[ScheduledSeq]) -> Callable[[], None] | None:
        """For a step with prefill work: a check, run between layers, that raises StepInterrupted once
        every request in the step has an abort coming. Why between layers: a long prompt's chunk is
        one step, and a client that disconnects during it would otherwise wait for all of it
        (seconds on a CPU); one layer is a small fraction of a step. Decode-only steps are short."""
        if all(s.is_decode or s.is_verify for s in scheduled):
            return None
        ids = {s.seq.request_id for s in scheduled}
        pending = self.abort_requested

        def check() -> None:
            if ids <= pending:
                raise StepInterrupted(f"every request of the step is being aborted: {sorted(ids)}")

        return check

    # ---- requests ----------------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """The live requests by id (the output processor's records)."""
        return self.output_processor.requests

    def submit(self, req: Request) -> None:
        """Take a request whose sequences are built (LLMEngine.add_request builds them)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        self.admission.submit(req)
        self.requests[req.request_id] = req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def request_abort_soon(self, request_id: str) -> None:
        """Say (from any thread) that an abort of request_id will follow: a prefill step running only
        such requests stops at its next layer instead of computing the whole chunk for nobody."""
        self.abort_requested.add(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with finish_reason 'abort'; idempotent. Returns its final output."""
        self.abort_requested.discard(request_id)
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.admission.abort(req)
        for seq in req.seqs:
            if not seq.is_finished:
                self._end(seq, "abort")
        self.flush_kv_events()
        return self.output_processor.finish_request(req)

    def _fail_request(self, req: Request, message: str) -> None:
        """Its grammar failed to compile: every sequence ends with finish_reason "error"; the final
        output goes out with the next step's."""
        for seq in req.seqs:
            self._end(seq, "error", message)
        self.output_processor.add_ready(self.output_processor.finish_request(req))

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        end_sequence(seq, reason, error)
        self.scheduler.finish(seq)  # (out of its queue, its blocks released, out of the drafter's state)

    # ---- KV events and shutdown ----------------------------------------------
    def flush_kv_events(self) -> None:
        """Hand what the prefix cache recorded since the last flush to the publisher, as one batch
        (vLLM publishes once per step too). Called after each step, abort and reset."""
        log = self.kv_event_log
        if log is None:
            return
        if self.kv_tiering is not None:
            log.events.extend(self.kv_tiering.stored_events())
        if log.events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(log.drain())

    def close(self) -> None:
        """Write the tree back to the KV tiers (write-back policy) and stop their threads; stop the KV event
        publisher (its sockets and thread)."""
        if self.kv_tiering is not None:
            self.kv_tiering.close()
        if self.kv_event_publisher is not None:
            self.flush_kv_events()
            self.kv_event_publisher.close()
