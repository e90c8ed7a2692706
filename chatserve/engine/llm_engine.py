"""The synchronous engine: requests in, one batched model step at a time, outputs out.

`LLM` (offline) and `AsyncLLMEngine` (serving) both drive `LLMEngine`: an `EngineCore`
(engine/core.py: the step) built from `EngineArgs` (engine/builder.py), with the front a caller
meets: the tokenizer and input processor, the request's sequences, and reports on what it holds.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from chatserve.config import EngineArgs
from chatserve.core.cache_lease import CacheLease, check_cache_leases, check_cache_salt
from chatserve.core.sequence import Sequence, SequenceStatus
from chatserve.core.session_kv import SessionKV
from chatserve.engine.builder import EngineParts, build_engine_parts
from chatserve.engine.core import EngineCore
from chatserve.engine.detokenizer import IncrementalDetokenizer
from chatserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptError
from chatserve.engine.output_processor import OutputProcessor
from chatserve.engine.request import Request
from chatserve.engine.stats import engine_stats
from chatserve.outputs import EngineInfo, RequestStats
from chatserve.reasoning.tracker import ReasoningTracker
from chatserve.sampling_params import SamplingParams
from chatserve.worker.sampler import make_generator

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | ProcessedPrompt

__all__ = ["LLMEngine", "PromptType", "Request"]


class LLMEngine(EngineCore):
    """An `EngineCore` over a model loaded from `EngineArgs`. Besides the core's step, requests and
    aborts, it owns what a caller meets: the model's files and config (`model_config`, `tokenizer`,
    `eos_token_ids`, `max_model_len`), the one input path (`input_processor`), turning a prompt into
    a request's sequences (`add_request`), the cache options' checks, and the reports on what it holds
    (`stats`, `info`, `describe_request`, `session_cache_report`)."""

    def __init__(self, args: EngineArgs, *, clock: Callable[[], float] = time.monotonic,
                 parts: EngineParts | None = None) -> None:
        """``clock``: the seconds KV leases expire on (sessions' and prompt prefixes'); tests pass a fake one.
        ``parts``: built already around a worker (`assemble_engine_parts`; a test's scripted worker, with
        ``clock`` given to it); None: the model in ``args`` is loaded."""
        self.args = args
        self.clock = clock
        parts = parts if parts is not None else build_engine_parts(args, clock=clock)
        self.source, self.hf_config, self.model_config = parts.source, parts.hf_config, parts.model_config
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.served_model_name = parts.served_model_name
        self.max_model_len, self.max_model_len_note = parts.max_model_len, parts.max_model_len_note
        self.kv_events_config = parts.kv_events_config
        self.max_prefix_leased_blocks = parts.max_prefix_leased_blocks
        self.speculative_config, self.spec = parts.speculative_config, parts.spec
        self.structured_outputs_config = parts.structured_outputs_config
        super().__init__(
            scheduler=parts.scheduler, worker=parts.runner,
            output_processor=OutputProcessor(parts.tokenizer, parts.eos_token_ids, parts.max_model_len),
            structured=parts.structured, kv_tiering=parts.kv_tiering, kv_event_log=parts.kv_event_log,
            kv_event_publisher=parts.kv_event_publisher,
        )
        info = parts.runner.info()
        self.attention_backend = info.attention_backend  # "torch", "cpu" or "triton"
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.load_seconds = parts.load_seconds
        pool = parts.runner.pool
        logger.info(
            "chatserve engine: %s (%s, %s) loaded in %.1fs; max_model_len=%d; KV pool %d blocks x %d = %d tokens",
            self.served_model_name, self.model_config.architecture, info.dtype, self.load_seconds,
            self.max_model_len, pool.num_blocks, pool.block_size, pool.num_tokens,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- what the worker chose -------------------------------------------------
    @property
    def runner(self) -> Any:
        """The worker (a `ModelRunner`), under its older name."""
        return self.worker

    @property
    def device(self) -> Any:
        return self.runner.device

    @property
    def dtype(self) -> Any:
        return self.runner.dtype

    @property
    def batch_invariant(self) -> bool:
        """Whether this engine's whole forward pass is batch- and thread-invariant (LayerOps.batch_invariant):
        greedy and seeded outputs then do not depend on the batch, the prefix cache or the thread count, and
        speculative decoding is exact."""
        return self.worker.info().batch_invariant

    @property
    def kv_free_window(self) -> int:
        return self.scheduler.kv_free_window

    # ---- admission's state, under the engine's names -----------------------------
    @property
    def waiting_for_grammar(self) -> dict[str, Request]:
        return self.admission.waiting_for_grammar

    @property
    def waiting_for_kv(self) -> dict[str, Request]:
        return self.admission.waiting_for_kv

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self.admission.waiting_for_grammar)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.admission.waiting_for_kv)

    @property
    def grammar_wait_s(self) -> float:
        """How long step() may block for a grammar or a KV tier lookup when nothing else can run (the
        async engine sets 0: the future's callback wakes it instead)."""
        return self.admission.wait_s

    @grammar_wait_s.setter
    def grammar_wait_s(self, value: float) -> None:
        self.admission.wait_s = value

    @property
    def kv_lookup_started(self) -> Callable[..., None] | None:
        """Called with each new KV tier lookup's future (the async engine's wake-up)."""
        return self.admission.kv_lookup_started

    @kv_lookup_started.setter
    def kv_lookup_started(self, value: Callable[..., None] | None) -> None:
        self.admission.kv_lookup_started = value

    @property
    def num_generated_tokens(self) -> int:
        return self.output_processor.num_generated_tokens

    @property
    def num_prefill_tokens_computed(self) -> int:
        return self.scheduler.num_prefill_tokens_computed

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @functools.cached_property
    def input_processor(self) -> InputProcessor:
        """Template + tokenize + validate against this engine's limits: the one input path.

        Built on first use from what `__init__` settled (max_model_len, the pool), so it sees the
        final limits; `add_request` trusts the ProcessedPrompt it returns.
        """
        return InputProcessor(
            self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_model_len_note=self.max_model_len_note,
            num_kv_blocks=self.block_manager.num_total_blocks,
            block_size=self.block_manager.block_size,
            scheduling_policy=self.scheduler.config.policy,
        )

    # ---- requests ----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        stats: RequestStats | None = None,
        session: SessionKV | None = None,
        cache_salt: str | None = None,
        cache_leases: Iterable[CacheLease | tuple[int, float]] | None = None,
    ) -> Request:
        """Queue a request. A ProcessedPrompt is taken as checked; a str or dict is processed first.

        stats: the request's record when the caller started it earlier (the async engine does, at
        arrival); the engine fills it in place. session: the request is a session turn (its cache
        branch is leased when it ends). cache_salt: a non-empty string; the request shares KV blocks
        (tree, disk and Redis tiers, KV events) only with requests of the same salt (None: with every
        unsalted one). cache_leases: up to 4 ``CacheLease(position, ttl_s)`` (or ``(position, ttl_s)``
        pairs): when the request ends, its prompt's first ``position`` tokens (whole blocks) stay
        leased for ``ttl_s`` seconds, renewed by each later hit (see ``check_cache_options``).
        Raises ValueError (PromptError for the prompt, the salt or the leases).
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        params = params or SamplingParams()
        cache_salt, leases = self.check_cache_options(cache_salt, cache_leases)
        processed = self.input_processor.process(prompt, truncate_prompt_tokens=params.truncate_prompt_tokens)
        self.input_processor.check_params(params)
        ids = processed.prompt_token_ids
        stats = stats if stats is not None else RequestStats()
        if session is not None:
            stats.session_history_tokens = session.history_tokens
        stats.num_prompt_tokens = len(ids)
        req = Request(request_id, processed.prompt, ids, params, stats, cache_salt=cache_salt)
        for i in range(params.n):
            reasoning = None if params.reasoning is None else ReasoningTracker.for_request(params.reasoning, self.tokenizer)
            req.seqs.append(Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                arrival_order=next(self._arrivals),
                generator=make_generator(None if params.seed is None else params.seed + i),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop or (),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                logprobs=[] if params.logprobs is not None else None,
                reasoning=reasoning,
                grammar=None if reasoning is None else reasoning.grammar_now(),  # the forced end marker at budget 0
                stats=stats,
                session=session,
                cache_salt=cache_salt,
                cache_leases=leases,
            ))
        self.submit(req)
        return req

    @staticmethod
    def check_cache_options(
        cache_salt: object = None, cache_leases: Iterable[CacheLease | tuple[int, float]] | None = None
    ) -> tuple[str | None, tuple[CacheLease, ...]]:
        """The request's prefix-cache options, checked: ``cache_salt`` None or a non-empty str;
        ``cache_leases`` at most ``MAX_CACHE_LEASES`` (4) ``CacheLease``s or ``(position, ttl_s)`` pairs,
        positions ints >= 0 (prompt tokens; past the prompt means all of it), TTLs > 0 seconds. Raises
        PromptError with ``param`` "cache_salt" or "cache_leases"."""
        try:
            salt = check_cache_salt(cache_salt)
        except ValueError as exc:
            raise PromptError(str(exc), param="cache_salt") from None
        try:
            leases = check_cache_leases(cache_leases)
        except (TypeError, ValueError) as exc:
            raise PromptError(str(exc), param="cache_leases") from None
        return salt, leases

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile (cached) the request's grammar now; raises StructuredOutputError, a ValueError whose
        message names the field ("structured_outputs.json: invalid JSON schema: ..."). Blocking."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    # ---- introspection -------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.is_finished]

    def describe_request(self, request_id: str) -> dict[str, Any] | None:
        """Where a live request stands, for the cancel endpoint: status and the KV blocks it holds.

        status is "waiting" (not admitted, or preempted back to the queue), "prefilling" (some prompt
        tokens still uncomputed) or "decoding". num_blocks counts distinct blocks in its block tables:
        the references an abort gives back (shared prefix blocks stay in the tree, private ones are freed).
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        live = [s for s in req.seqs if not s.is_finished]
        if not live or all(s.status is SequenceStatus.WAITING for s in live):
            status = "waiting"
        elif any(s.num_computed_tokens < s.num_prompt_tokens for s in live):
            status = "prefilling"
        else:
            status = "decoding"
        blocks = {b for s in live for b in s.block_table}
        return {"status": status, "num_blocks": len(blocks)}

    def check_integrity(self) -> None:
        self.block_manager.check_integrity([s for s in self.live_sequences() if s.block_table])

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (every unlocked cached block back to the free list).

        For benchmarks and tests that need a cold start without reaching into the block
        manager. Like vLLM's, it refuses (returns False, nothing changed) while a sequence is
        running: its blocks are locked in the tree and its next step reads them.
        """
        if self.scheduler.running:
            return False
        try:
            return self.block_manager.reset_prefix_cache()
        finally:
            self.flush_kv_events()

    def release_kv_lease(self, session_id: str) -> bool:
        """End a session's KV lease now (the session was deleted): its branch is plain LRU again."""
        return self.block_manager.cache.release_lease(session_id)

    def session_cache_report(
        self, session_id: str, history_token_ids: list[int], cache_salt: str | None = None
    ) -> dict[str, Any]:
        """What the cache holds of a session's stored history (under the session's ``cache_salt``):
        tokens (whole blocks, not touching LRU order) and its lease (``leased_until`` in unix seconds,
        None if none)."""
        cache = self.block_manager.cache
        info = cache.lease_info(session_id)
        leased_until = None if info is None else time.time() + (info.expires_at - self.clock())
        report: dict[str, Any] = {
            "cached_tokens": cache.peek_prefix(history_token_ids, salt=cache_salt),
            "history_tokens": len(history_token_ids),
            "leased": info is not None,
            "leased_tokens": 0 if info is None else info.num_tokens,
            "leased_until": leased_until,
        }
        if self.kv_tiering is not None:
            # where the history is: leading tokens (whole blocks) held in memory (the tree) and each tier
            report["tiers"] = {"memory": report["cached_tokens"], **self.kv_tiering.locate(history_token_ids, cache_salt)}
        return report

    def info(self) -> EngineInfo:
        """What this engine was built with (outputs.EngineInfo): the public view benchmarks read."""
        worker, pool = self.worker.info(), self.worker.pool
        return EngineInfo(
            model=self.served_model_name, architecture=self.model_config.architecture,
            num_layers=self.model_config.num_layers, device=worker.device,
            dtype=worker.dtype, attention_backend=worker.attention_backend,
            kernels=worker.kernels, kernel_tier=worker.kernel_tier,
            linear_impl=worker.linear_impl, batch_invariant=worker.batch_invariant,
            block_size=pool.block_size, num_kv_blocks=pool.num_blocks, kv_pool_tokens=pool.num_tokens,
            kv_bytes_per_block=pool.bytes_per_block, max_model_len=self.max_model_len,
            load_seconds=self.load_seconds, weights_load_seconds=worker.load_seconds,
            weight_cache_status=worker.weight_cache_status, plain_parameters=worker.plain_parameters,
            kv_cache_dtype=worker.kv_cache_dtype or worker.dtype,
        )

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of the scheduler, the prefix cache, the KV tiers, speculative decoding
        and the step (engine/stats.py names each)."""
        return engine_stats(self)
