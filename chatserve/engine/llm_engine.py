"""The synchronous engine: requests in, one batched model step at a time, outputs out.

`LLM` (offline) and `AsyncLLMEngine` (serving) both drive this class. It owns
the scheduler, the block manager and the model runner; nothing lives in module
globals, so several engines can share one process.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatserve.cache import KVEventLog
from chatserve.config import EngineArgs, SchedulerConfig, resolve_dtype
from chatserve.core.block_manager import BlockManager
from chatserve.core.cache_lease import CacheLease, check_cache_leases, check_cache_salt
from chatserve.core.scheduler import ScheduledSeq, Scheduler
from chatserve.core.sequence import Sequence, SequenceStatus
from chatserve.core.session_kv import SessionKV
from chatserve.engine.detokenizer import IncrementalDetokenizer
from chatserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptError
from chatserve.engine.kv_event_publisher import KVEventPublisher, KVEventsConfig
from chatserve.engine.kv_tiering import KVLookup, KVTiering
from chatserve.kernels.cpu import load_cpu_kernels
from chatserve.kv_offload import KVFingerprint, hash_model_files
from chatserve.layers.ops import select_layer_ops
from chatserve.models.config import ModelConfig, warn_past_context
from chatserve.models.loader import eos_token_ids, load_hf_config, load_tokenizer, resolve_model
from chatserve.models.weight_cache import WeightCacheConfig
from chatserve.outputs import CompletionOutput, EngineInfo, Logprob, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams
from chatserve.spec_decode.config import parse_speculative_config
from chatserve.spec_decode.proposer import SpecProposer, make_proposer
from chatserve.structured import GrammarCompilerService, SequenceMatcher, parse_structured_outputs_config
from chatserve.worker.model_runner import ModelRunner, StepInterrupted
from chatserve.worker.sampler import make_generator

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | ProcessedPrompt


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stats: RequestStats
    seqs: list[Sequence] = field(default_factory=list)
    cache_salt: str | None = None  # it shares KV blocks only with requests of the same salt
    # Set while the request waits for its grammar (structured outputs); its sequences join the
    # scheduler when it is done. Callers may add_done_callback to learn when to step again.
    grammar_future: concurrent.futures.Future | None = None
    # Set while the request waits for a lookup in the KV tiers below the tree (disk, Redis); its
    # sequences join the scheduler once it lands (engine/kv_tiering.py). Same callback contract.
    kv_load_future: concurrent.futures.Future | None = None
    # Another waiting request's lookup covers this prompt's next block (a burst after a restart): this one
    # shares that future instead of reading the same blocks again, and looks again once it lands.
    kv_follows: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cpu_kernels_load(args: EngineArgs, device: torch.device) -> bool:
    """Whether the C++ kernels of the requested tier load here (built and checked once per process),
    which is what makes bfloat16 the fast dtype on a CPU; a forced tier the CPU lacks raises."""
    if device.type != "cpu" or not args.cpu_kernels or args.dtype not in ("auto", "bfloat16"):
        return False
    return load_cpu_kernels(amx=args.amx, tier=args.cpu_kernel_tier) is not None


class LLMEngine:
    def __init__(self, args: EngineArgs, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the seconds KV leases expire on (sessions' and prompt prefixes'); tests pass a fake one."""
        self.args = args
        self.clock = clock
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = _resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device, cpu_kernels=_cpu_kernels_load(args, self.device))
        if args.cpu_kernel_tier != "auto" and (self.device.type != "cpu" or self.dtype != torch.bfloat16):
            raise ValueError(f"cpu_kernel_tier={args.cpu_kernel_tier!r} picks bfloat16 CPU kernels, but this engine runs "
                             f"{str(self.dtype).removeprefix('torch.')} on {self.device.type}; use dtype auto or bfloat16 on the CPU")
        t0 = time.perf_counter()
        self.source = resolve_model(args.model)
        self.hf_config = load_hf_config(self.source, args.hf_overrides_dict)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = frozenset(eos_token_ids(self.source, self.model_config, self.tokenizer))
        self.served_model_name = args.served_model_name or self.source.name

        cache_cfg = args.cache_config()  # (with max_model_len set and no KV budget, a pool that holds it)
        max_len = args.max_model_len or self.model_config.context_len
        warn_past_context(self.model_config, max_len)
        cfg = self.model_config
        # auto: Triton on CUDA, the torch path (with the C++ kernels where they apply) on the CPU
        ops = select_layer_ops(
            dtype=self.dtype, device=self.device, attention_backend=args.attention_backend,
            cpu_kernels=args.cpu_kernels, amx=args.amx, quantization=args.quantization, is_gguf=self.source.is_gguf,
            head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            cpu_kernel_tier=args.cpu_kernel_tier,
        )
        self.attention_backend = ops.attention.name  # "torch", "cpu" or "triton"
        self.runner = ModelRunner(
            self.source, self.hf_config, cfg, cache_cfg, self.dtype, self.device, max_model_len=max_len, ops=ops,
            weight_cache=WeightCacheConfig(args.weight_cache, args.weight_cache_dir,
                                           int(args.weight_cache_max_gb * 2**30)),
        )
        logger.info("weight cache: %s", self.runner.weight_cache.describe())
        self.runner.eos_token_ids = tuple(self.eos_token_ids)
        # every layer windowed (Phi-3, Mistral): blocks the windows have passed go back to the pool
        # each step (without the prefix cache: with it they are the cached prefix; see docs/architecture.md)
        windows = tuple(getattr(self.runner.model, "windows", ()))
        self.kv_free_window = max(windows) if windows and all(windows) and not args.enable_prefix_caching else 0
        pool = self.runner.pool
        self.max_model_len_note = ""
        if args.max_model_len is None and pool.num_tokens < max_len:
            max_len = pool.num_tokens
            self.max_model_len_note = f" (limited by the KV pool: {pool.num_blocks} blocks of {pool.block_size} tokens)"
        elif max_len > pool.num_tokens:
            raise ValueError(
                f"max_model_len={max_len} needs more KV cache than the pool holds ({pool.num_blocks} blocks = "
                f"{pool.num_tokens} tokens); raise num_kv_blocks / kv_cache_memory_gb or lower max_model_len"
            )
        self.max_model_len = max_len
        # KV events (--kv-events-endpoint): the tree records into the log, each step's batch is published.
        self.kv_events_config: KVEventsConfig | None = None
        self.kv_event_log: KVEventLog | None = None
        self.kv_event_publisher: KVEventPublisher | None = None
        if args.kv_events_endpoint:
            self.kv_events_config = KVEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                                                   args.kv_events_topic)
            self.kv_event_log = KVEventLog(args.block_size)
            self.kv_event_publisher = KVEventPublisher(self.kv_events_config)
        # The KV tiers below the tree (--kv-offload-dir, --kv-offload-redis-url): the tree tells them what it
        # takes and evicts; requests whose prompt goes past the tree wait for a lookup outside the scheduler.
        self.kv_tiering: KVTiering | None = None
        self.waiting_for_kv: dict[str, Request] = {}
        self.kv_lookup_started: Callable[[concurrent.futures.Future], None] | None = None  # the async engine's wake-up
        if args.kv_offload_enabled:
            self.kv_tiering = KVTiering(args, self._kv_fingerprint(ops), pool.bytes_per_block, self.runner)
        # prompt-prefix leases (cache_control, prompt_cache_key) protect at most this many blocks together
        self.max_prefix_leased_blocks = (args.max_prefix_leased_blocks if args.max_prefix_leased_blocks is not None
                                         else pool.num_blocks // 2)
        self.block_manager = BlockManager(pool.num_blocks, args.block_size, args.enable_prefix_caching, clock=clock,
                                          kv_events=self.kv_event_log, tier_observer=self.kv_tiering,
                                          max_prefix_leased_blocks=self.max_prefix_leased_blocks)
        if self.kv_tiering is not None:
            self.kv_tiering.block_manager = self.block_manager
            self.kv_tiering.record_events = self.kv_event_log is not None  # (BlockStored with medium DISK / REDIS)
        # Speculative decoding (--speculative-config): drafts proposed per step, verified in the forward.
        self.speculative_config = parse_speculative_config(args.speculative_config)
        self.spec: SpecProposer | None = None
        if self.speculative_config is not None:
            self.spec = make_proposer(self.speculative_config, max_len)
            if not ops.batch_invariant:  # (LayerOps: every op of the forward pass, fallbacks included)
                logger.warning("speculative decoding on %s: this path is not batch-invariant (%s), so verified tokens "
                               "equal plain decoding's only up to float rounding (exact where the whole forward pass "
                               "runs on a CPU kernel tier)", ops.describe(),
                               "; ".join(f.describe() for f in ops.fallbacks if not f.invariant))
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len, args.max_prefill_tokens_while_decoding),
            self.block_manager,
            proposer=self.spec.propose if self.spec is not None else None,
        )
        self.requests: dict[str, Request] = {}
        # Structured outputs: compiled off the step (a worker thread); requests wait here meanwhile.
        self.structured_outputs_config = parse_structured_outputs_config(args.structured_outputs_config)
        self.structured = GrammarCompilerService(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids),
                                                 config=self.structured_outputs_config)
        self.waiting_for_grammar: dict[str, Request] = {}
        # How long step() may block for a grammar when nothing else can run (the offline loop would
        # spin otherwise). The async engine sets 0: it is woken by the future's callback instead.
        self.grammar_wait_s = 0.05
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        # Ids an abort is coming for (added from any thread, e.g. the async engine's event loop, while a
        # step runs): a prefill step whose every sequence is in here stops between layers.
        self.abort_requested: set[str] = set()
        self.num_interrupted_steps = 0
        self.num_prefill_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_prefill_chunks_continued = 0
        self.num_mixed_steps = 0
        self.load_seconds = time.perf_counter() - t0
        logger.info(
            "chatserve engine: %s (%s, %s) loaded in %.1fs; max_model_len=%d; KV pool %d blocks x %d = %d tokens",
            self.served_model_name, self.model_config.architecture, self.dtype, self.load_seconds,
            max_len, pool.num_blocks, pool.block_size, pool.num_tokens,
        )

    @property
    def batch_invariant(self) -> bool:
        """Whether this engine's whole forward pass is batch- and thread-invariant (LayerOps.batch_invariant):
        greedy and seeded outputs then do not depend on the batch, the prefix cache or the thread count, and
        speculative decoding is exact."""
        return self.runner.ops.batch_invariant

    def _kv_fingerprint(self, ops: Any) -> KVFingerprint:
        """Everything that changes a KV block's bytes here (kv_offload/fingerprint.py)."""
        folder = Path(self.source.folder)
        if self.source.gguf_file is not None:
            files = [folder / self.source.gguf_file]
        else:
            files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + [folder / "config.json"]
        cfg = self.model_config
        memo = None
        if self.args.kv_offload_dir:
            os.makedirs(self.args.kv_offload_dir, exist_ok=True)
            memo = os.path.join(self.args.kv_offload_dir, "model-hashes.json")
        return KVFingerprint(
            model_hash=hash_model_files((f for f in files if f.is_file()), memo_path=memo),
            dtype=str(self.dtype).removeprefix("torch."), num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, block_size=self.args.block_size, kv_layout=ops.attention.name,
            kernels=f"{ops.describe()}; quantization={self.args.quantization}", device_type=self.device.type,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

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
        processed = self.input_processor.process(prompt)
        ids = processed.prompt_token_ids
        stats = stats if stats is not None else RequestStats()
        if session is not None:
            stats.session_history_tokens = session.history_tokens
        stats.num_prompt_tokens = len(ids)
        req = Request(request_id, processed.prompt, ids, params, stats, cache_salt=cache_salt)
        for i in range(params.n):
            seq = Sequence(
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
                stats=stats,
                session=session,
                cache_salt=cache_salt,
                cache_leases=leases,
            )
            req.seqs.append(seq)
        spec = params.structured_outputs
        if spec is None:
            self._to_scheduler(req)
        else:
            # NOTE: the waiting-for-grammar state: the sequences join the scheduler only once the
            # grammar is compiled (`_admit_compiled_grammars`), so nobody's step waits for a compile.
            req.grammar_future = self.structured.submit(spec)
            self.waiting_for_grammar[request_id] = req
        self.requests[request_id] = req
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

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self.waiting_for_grammar)

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Move requests whose grammar is ready into the scheduler (one matcher per sequence); a failed
        compile finishes its request with finish_reason "error". Returns those final outputs."""
        outputs: list[RequestOutput] = []
        for request_id, req in list(self.waiting_for_grammar.items()):
            future = req.grammar_future
            assert future is not None
            if not future.done():
                continue
            del self.waiting_for_grammar[request_id]
            error = future.exception()
            if error is not None:
                for seq in req.seqs:
                    self._finish_with_error(seq, str(error))
                out = self._make_output(req)
                self.requests.pop(request_id, None)
                if out is not None:
                    outputs.append(out)
                continue
            compiled = future.result()
            for seq in req.seqs:
                seq.grammar = SequenceMatcher(compiled)
            self._to_scheduler(req)
        return outputs

    def _to_scheduler(self, req: Request) -> None:
        """Hand a request's sequences to the scheduler, or first to a lookup in the KV tiers when its
        prompt has full blocks past what the tree holds (it then waits in ``waiting_for_kv``)."""
        tiers = self.kv_tiering
        if tiers is not None:
            prompt = req.prompt_token_ids
            held = self.block_manager.cache.peek_prefix(prompt[:-1], salt=req.cache_salt)
            if tiers.wants_lookup(prompt, held):
                leader = self._kv_lookup_covering(prompt, held, req.cache_salt)
                if leader is not None:
                    req.kv_load_future, req.kv_follows = leader.kv_load_future, leader.request_id
                else:
                    salted = {} if req.cache_salt is None else {"salt": req.cache_salt}  # (unsalted: the plain call)
                    req.kv_load_future = tiers.submit_lookup(prompt, held, **salted)
                    if self.kv_lookup_started is not None:
                        self.kv_lookup_started(req.kv_load_future)
                self.waiting_for_kv[req.request_id] = req
                return
        for seq in req.seqs:
            self.scheduler.add(seq)

    def _kv_lookup_covering(self, prompt: list[int], held: int, salt: str | None = None) -> Request | None:
        """A request whose lookup in flight reads this prompt's first block past the tree (same salt, same
        tokens so far)."""
        end = (held // self.block_manager.block_size + 1) * self.block_manager.block_size
        head = prompt[:end]
        for other in self.waiting_for_kv.values():
            if (other.kv_follows is None and other.cache_salt == salt and len(other.prompt_token_ids) > end
                    and other.prompt_token_ids[:end] == head):
                return other
        return None

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    def _admit_loaded_kv(self) -> None:
        """Requests whose tier lookup landed: their blocks into the tree, their sequences to the scheduler."""
        assert self.kv_tiering is not None
        landed = [r for r in self.waiting_for_kv.values() if r.kv_load_future is not None and r.kv_load_future.done()]
        # NOTE: leaders first: a follower looks at the tree again once its leader's blocks are in it
        for req in sorted(landed, key=lambda r: r.kv_follows is not None):
            future = req.kv_load_future
            assert future is not None
            del self.waiting_for_kv[req.request_id]
            req.kv_load_future = None
            if req.kv_follows is not None:
                req.kv_follows = None
                self._to_scheduler(req)  # (may look up what its own prompt has past the leader's)
                continue
            lookup: KVLookup = future.result()  # (_lookup catches its own errors)
            self.kv_tiering.adopt(req.seqs, req.prompt_token_ids, lookup)
            for seq in req.seqs:
                self.scheduler.add(seq)

    def _finish_with_error(self, seq: Sequence, message: str) -> None:
        seq.finish_reason, seq.error = "error", message
        if not seq.detokenizer.finished:
            seq.detokenizer.flush()
        self._finish_seq(seq)

    def request_abort_soon(self, request_id: str) -> None:
        """Say (from any thread) that an abort of request_id will follow: a prefill step running only
        such requests stops at its next layer instead of computing the whole chunk for nobody."""
        self.abort_requested.add(request_id)

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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with finish_reason 'abort'; idempotent. Returns its final output."""
        self.abort_requested.discard(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.waiting_for_grammar.pop(request_id, None)  # its compile finishes and is cached; nothing waits on it
        if self.waiting_for_kv.pop(request_id, None) is not None and req.kv_load_future is not None:
            # NOTE: a lookup holds no block; what it read is dropped with it. Followers sharing the future
            # look again when it ends (cancelled or not).
            followers = [r for r in self.waiting_for_kv.values() if r.kv_follows == request_id]
            if req.kv_follows is None and not followers:
                req.kv_load_future.cancel()
            elif followers:  # the first follower takes the lookup over (it adopts what it reads)
                followers[0].kv_follows = None
                for r in followers[1:]:
                    r.kv_follows = followers[0].request_id
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                if not seq.detokenizer.finished:
                    seq.detokenizer.flush()  # text held back for a possible stop string is final now
                self._finish_seq(seq)
        self.flush_kv_events()
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- KV events ---------------------------------------------------------
    def flush_kv_events(self) -> None:
        """Hand what the prefix cache recorded since the last flush to the publisher, as one batch
        (vLLM publishes once per step too). Called after each step, abort and reset."""
        if self.kv_event_log is not None and self.kv_tiering is not None:
            self.kv_event_log.events.extend(self.kv_tiering.stored_events())
        if self.kv_event_log is not None and self.kv_event_log.events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_event_log.drain())

    def close(self) -> None:
        """Write the tree back to the KV tiers (write-back policy) and stop their threads; stop the KV event
        publisher (its sockets and thread)."""
        if self.kv_tiering is not None:
            self.kv_tiering.close()
        if self.kv_event_publisher is not None:
            self.flush_kv_events()
            self.kv_event_publisher.close()

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            self.flush_kv_events()

    def _step(self) -> list[RequestOutput]:
        outputs = self._admit_compiled_grammars() if self.waiting_for_grammar else []
        if self.waiting_for_kv:
            self._admit_loaded_kv()
        sched = self.scheduler.schedule()
        if sched.is_empty and self.waiting_for_grammar and self.grammar_wait_s > 0:
            # Nothing else can run: wait (briefly) for a grammar rather than spin.
            pending = [r.grammar_future for r in self.waiting_for_grammar.values() if r.grammar_future is not None]
            concurrent.futures.wait(pending, timeout=self.grammar_wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
            outputs += self._admit_compiled_grammars()
            sched = self.scheduler.schedule()
        if sched.is_empty and self.waiting_for_kv and self.grammar_wait_s > 0:
            # Nothing else can run: wait (briefly) for a tier lookup rather than spin (same as a grammar).
            pending = [r.kv_load_future for r in self.waiting_for_kv.values() if r.kv_load_future is not None]
            concurrent.futures.wait(pending, timeout=self.grammar_wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
            self._admit_loaded_kv()
            sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        self._count_layout(sched.scheduled)
        copies = self.block_manager.take_pending_copies()
        try:
            sampled = self.runner.execute(sched.scheduled, copies=copies,
                                                  between_layers=self._interrupt_check(sched.scheduled))
        except StepInterrupted:
            # Nothing of this step counts: no token computed, no block published (the partly
            # written KV is in blocks the coming abort frees), no sample drawn.
            self.num_interrupted_steps += 1
            return outputs
        finally:
            self.block_manager.finish_copies(copies)
        for s in sched.scheduled:
            if s.is_verify:
                continue  # what it computed counts once the verification says which drafts stand
            if not s.is_decode:
                self.num_prefill_tokens_computed += s.num_new_tokens
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.publish(s.seq)  # returns at once unless a new full block was computed
            if self.kv_free_window:  # down to a 16-key tile: the C++ kernel reads a window's first tile whole
                first = max(0, s.seq.num_computed_tokens - self.kv_free_window + 1) // 16 * 16
                self.block_manager.free_out_of_window(s.seq, first)
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for out in sampled:
            seq = out.seq
            computed_before = seq.num_computed_tokens
            kept = 0
            for token, lp in zip(out.token_ids, out.logprobs):
                kept += 1
                self._append_token(seq, token, lp, now)
                if seq.finish_reason is not None:
                    break
            if out.scheduled.is_verify:
                # The step wrote KV for the last token and every draft; only the last token and the
                # kept drafts stand (a kept token is a draft unless it is the one sampled after them).
                seq.num_computed_tokens = computed_before + 1 + min(out.num_accepted_drafts, kept)
                if self.spec is not None:
                    self.spec.record(seq, len(out.scheduled.draft_token_ids), out.num_accepted_drafts)
                if seq.finish_reason is None:
                    self.block_manager.trim(seq)  # blocks that held only rejected drafts go free
                    self.block_manager.publish(seq)
            if seq.finish_reason is not None:
                self._finish_seq(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        for req in touched.values():
            out = self._make_output(req)
            if out is not None:
                outputs.append(out)
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _count_layout(self, scheduled: list[ScheduledSeq]) -> None:
        """What each step mixed (stats): prefill chunks that continue a prompt (a cache hit or an earlier
        chunk before them) and steps that run decodes beside prefill chunks (chunked prefill at work)."""
        prefills = [s for s in scheduled if not s.is_decode and not s.is_verify]
        self.num_prefill_chunks_continued += sum(1 for s in prefills if s.seq.num_computed_tokens > 0)
        if prefills and len(prefills) < len(scheduled):
            self.num_mixed_steps += 1

    def _append_token(self, seq: Sequence, token: int, lp: Any, now: float) -> None:
        """One sampled (or verified) token into seq: logprobs, grammar, stop checks; sets
        finish_reason when it ends the sequence (the caller then finishes it)."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.stats.first_token_time is None:
            seq.stats.first_token_time = now
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self._logprob_entry(lp))
            seq.cumulative_logprob += lp.logprob
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The mask allows only tokens the grammar takes, so this is a dead end (a bug or a
            # grammar xgrammar cannot continue): end this request, never the step.
            spec = seq.params.structured_outputs
            kind = spec.kind if spec is not None else "grammar"
            seq.finish_reason, seq.error = "error", f"structured_outputs.{kind}: the grammar rejected token {token}; generation stopped"
            if not seq.detokenizer.finished:
                seq.detokenizer.flush()
            return
        self._check_stop(seq, token)
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar has ended (e.g. ignore_eos let its stop token through)
            seq.detokenizer.flush()

    def _finish_seq(self, seq: Sequence) -> None:
        """Out of the scheduler (its blocks released) and out of the drafter's state."""
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.finish(seq)

    def _logprob_entry(self, lp: Any) -> dict[int, Logprob]:
        entry = {tid: Logprob(val, rank=r + 1) for r, (tid, val) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, rank=lp.rank)
        for tid, item in entry.items():
            item.decoded_token = self.tokenizer.decode([tid])
        return entry

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        n_out = seq.num_output_tokens
        can_stop = n_out >= params.min_tokens
        # NOTE: a stop token ends generation before its text is added (as in vLLM), unless
        # include_stop_str_in_output asks for it.
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif can_stop and params.is_stop_token(token):
            seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is not None:
            if params.include_stop_str_in_output:
                seq.detokenizer.add_tokens([token])
            seq.detokenizer.flush()
            return
        update = seq.detokenizer.add_tokens([token])
        if can_stop and update.stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", update.stop_str
            return  # the detokenizer already cut the text before the stop string
        elif params.max_tokens is not None and n_out >= params.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.detokenizer.flush()

    def _make_output(self, req: Request) -> RequestOutput | None:
        kind = req.params.output_kind
        finished = req.finished
        stats = req.stats
        stats.num_generated_tokens = sum(seq.num_output_tokens for seq in req.seqs)
        if finished and stats.finish_time is None:
            stats.finish_time = time.monotonic()
        if kind == "final_only" and not finished:
            return None
        outs = []
        for seq in req.seqs:
            text = seq.detokenizer.text
            tokens = seq.output_token_ids
            logprobs = seq.logprobs
            if kind == "delta":
                text_d, tokens_d = text[seq.sent_text_len :], tokens[seq.sent_token_len :]
                logprobs_d = None if logprobs is None else logprobs[seq.sent_token_len :]
                if not text_d and not tokens_d and (not seq.is_finished or seq.sent_finish):
                    continue
                seq.sent_text_len, seq.sent_token_len = len(text), len(tokens)
                seq.sent_finish = seq.is_finished
                text, tokens, logprobs = text_d, tokens_d, logprobs_d
            else:
                tokens = list(tokens)
                logprobs = None if logprobs is None else list(logprobs)
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=logprobs,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    error=seq.error,
                )
            )
        if not outs:
            return None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            stats=stats,
        )

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
        report = {
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
        runner, ops, pool = self.runner, self.runner.ops, self.runner.pool
        return EngineInfo(
            model=self.served_model_name, architecture=self.model_config.architecture,
            num_layers=self.model_config.num_layers, device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."), attention_backend=self.attention_backend,
            kernels=ops.describe(), kernel_tier=ops.cpu.tier if ops.cpu is not None else None,
            linear_impl=str(runner.linear_impl), batch_invariant=self.batch_invariant,
            block_size=pool.block_size, num_kv_blocks=pool.num_blocks, kv_pool_tokens=pool.num_tokens,
            kv_bytes_per_block=pool.bytes_per_block, max_model_len=self.max_model_len,
            load_seconds=self.load_seconds, weights_load_seconds=runner.load_seconds,
            weight_cache_status=str(runner.weight_cache.status),
            plain_parameters=sum(p.numel() for p in runner.model.parameters()),
        )

    def stats(self) -> dict[str, Any]:
        cache = self.block_manager.cache.stats()
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_grammar": len(self.waiting_for_grammar),
            "num_total_blocks": cache.total,
            "num_free_blocks": cache.free,
            "num_cached_blocks": cache.evictable,
            "num_locked_blocks": cache.locked,
            "prefix_cache_queries_tokens": self.block_manager.prefix_query_tokens,
            "prefix_cache_hits_tokens": self.block_manager.prefix_hit_tokens,
            "prefix_cache_evicted_blocks": self.block_manager.cache.num_evicted_blocks,
            "num_leased_blocks": cache.leased,
            "prefix_cache_lease_hits": bm.lease_hits,
            "prefix_cache_lease_hit_tokens": bm.lease_hit_tokens,
            "prefix_cache_leased_evicted_blocks": bm.cache.num_leased_evicted_blocks,
            "num_prefix_leased_blocks": cache.prefix_leased,
            "num_prefix_leases": cache.prefix_leases,
            "max_prefix_leased_blocks": self.max_prefix_leased_blocks,
            "prefix_cache_prefix_leases_set": bm.num_prefix_leases_set,
            "prefix_cache_prefix_lease_renewals": bm.cache.num_prefix_lease_renewals,
            "prefix_cache_prefix_leases_dropped": bm.cache.num_prefix_leases_dropped,
            "prefix_cache_prefix_leased_dropped_blocks": bm.cache.num_prefix_leased_dropped_blocks,
            "prefix_cache_miss_reasons": dict(bm.miss_reasons),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefill_tokens_computed": self.num_prefill_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "num_prefill_chunks_continued": self.num_prefill_chunks_continued,
            "num_mixed_steps": self.num_mixed_steps,
            "num_interrupted_steps": self.num_interrupted_steps,  # prefill steps an abort stopped between layers
            "spec_decode": None if self.spec is None else {**self.spec.stats.as_dict(), "exact": self.batch_invariant},
            # every op of the forward pass batch- and thread-invariant (LayerOps.batch_invariant): the one flag
            # behind the determinism promise and speculative decoding's exactness
            "batch_invariant": self.batch_invariant,
            "num_waiting_for_kv": len(self.waiting_for_kv),
            "kv_offload": None if self.kv_tiering is None else self.kv_tiering.stats(),
        }
