"""Builds an engine's parts from `EngineArgs`: the model's files, the worker, the KV tiers and events,
the block manager, the scheduler (with its drafter) and the grammar service.

`LLMEngine` hands these to `EngineCore`. `build_engine_parts` loads the model and builds its worker,
then `assemble_engine_parts` builds everything around a worker; a test calls the second alone with a
worker of its own (tests/helpers/fake_runner.py: a scripted one, no model) and hands the parts to
`LLMEngine(args, parts=...)`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatserve.cache import KVEventLog
from chatserve.config import EngineArgs, SchedulerConfig
from chatserve.core.block_manager import BlockManager
from chatserve.core.scheduler import Scheduler
from chatserve.engine.kv_event_publisher import KVEventPublisher, KVEventsConfig
from chatserve.engine.kv_tiering import KVTiering
from chatserve.kv_offload import KVFingerprint, hash_model_files
from chatserve.models.config import ModelConfig, warn_past_context
from chatserve.models.loader import ModelSource, eos_token_ids, load_hf_config, load_tokenizer, resolve_model
from chatserve.models.prefetch import prefetch_tokenizer
from chatserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from chatserve.spec_decode.proposer import SpecProposer, make_proposer
from chatserve.structured import GrammarCompilerService, StructuredOutputsConfig, parse_structured_outputs_config
from chatserve.worker.interface import Worker, WorkerInfo
from chatserve.worker.setup import WorkerConfig, build_model_runner

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything `build_engine_parts` made, named as the engine exposes it."""

    source: ModelSource
    hf_config: Any
    model_config: ModelConfig
    tokenizer: Any
    eos_token_ids: frozenset[int]
    served_model_name: str
    runner: Worker  # a ModelRunner, or a test's fake
    max_model_len: int
    max_model_len_note: str  # why max_model_len is below the model's ("" if it is not)
    kv_free_window: int
    kv_events_config: KVEventsConfig | None
    kv_event_log: KVEventLog | None
    kv_event_publisher: KVEventPublisher | None
    kv_tiering: KVTiering | None
    max_prefix_leased_blocks: int
    block_manager: BlockManager
    speculative_config: SpeculativeConfig | None
    spec: SpecProposer | None
    scheduler: Scheduler
    structured_outputs_config: StructuredOutputsConfig
    structured: GrammarCompilerService
    load_seconds: float


def build_engine_parts(args: EngineArgs, *, clock: Callable[[], float] = time.monotonic) -> EngineParts:
    t0 = time.perf_counter()
    source = resolve_model(args.model, args.cache_dir)
    prefetch_tokenizer(source)  # a GGUF served before: its tokenizer read beside the weights and kernels
    hf_config = load_hf_config(source, args.hf_overrides_dict)
    cfg = ModelConfig.from_hf(hf_config)

    max_len = args.max_model_len or cfg.context_len
    warn_past_context(cfg, max_len)
    # (with max_model_len set and no KV budget, a pool that holds it)
    runner = build_model_runner(WorkerConfig.from_engine_args(args), source, hf_config, cfg, args.cache_config(), max_len)
    logger.info("weight cache: %s", runner.weight_cache.describe())
    tokenizer = load_tokenizer(source)
    eos = frozenset(eos_token_ids(source, cfg, tokenizer))
    return assemble_engine_parts(args, source=source, hf_config=hf_config, model_config=cfg, tokenizer=tokenizer,
                                 eos_token_ids=eos, runner=runner, max_model_len=max_len, clock=clock, started=t0)


def assemble_engine_parts(
    args: EngineArgs, *, source: ModelSource, hf_config: Any, model_config: ModelConfig, tokenizer: Any,
    eos_token_ids: frozenset[int], runner: Worker, max_model_len: int,
    clock: Callable[[], float] = time.monotonic, started: float | None = None,
) -> EngineParts:
    """The parts around a worker that is built already (its KV pool sized): the limits it allows, the
    KV events and tiers, the block manager, the scheduler and the grammar service, all from ``args``.
    ``started``: when loading began (perf_counter), for ``load_seconds``; None: now."""
    t0 = time.perf_counter() if started is None else started
    cfg, eos, max_len = model_config, eos_token_ids, max_model_len
    info = runner.info()
    runner.eos_token_ids = tuple(eos)
    # every layer windowed (Phi-3, Mistral): blocks the windows have passed go back to the pool
    # each step (without the prefix cache: with it they are the cached prefix; see docs/architecture.md)
    windows = info.sliding_windows
    kv_free_window = max(windows) if windows and all(windows) and not args.enable_prefix_caching else 0
    pool = runner.pool
    note = ""
    if args.max_model_len is None and pool.num_tokens < max_len:
        max_len = pool.num_tokens
        note = f" (limited by the KV pool: {pool.num_blocks} blocks of {pool.block_size} tokens)"
    elif max_len > pool.num_tokens:
        raise ValueError(
            f"max_model_len={max_len} needs more KV cache than the pool holds ({pool.num_blocks} blocks = "
            f"{pool.num_tokens} tokens); raise num_kv_blocks / kv_cache_memory_gb or lower max_model_len"
        )
    # KV events (--kv-events-endpoint): the tree records into the log, each step's batch is published.
    events_config = log = publisher = None
    if args.kv_events_endpoint:
        events_config = KVEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic)
        log = KVEventLog(args.block_size)
        publisher = KVEventPublisher(events_config)
    # The KV tiers below the tree (--kv-offload-dir, --kv-offload-redis-url): the tree tells them what it
    # takes and evicts; requests whose prompt goes past the tree wait for a lookup outside the scheduler.
    tiering = None
    if args.kv_offload_enabled:
        tiering = KVTiering(args, kv_fingerprint(args, source, cfg, info), pool.bytes_per_block, runner)
    # prompt-prefix leases (cache_control, prompt_cache_key) protect at most this many blocks together
    max_leased = args.max_prefix_leased_blocks if args.max_prefix_leased_blocks is not None else pool.num_blocks // 2
    block_manager = BlockManager(pool.num_blocks, args.block_size, args.enable_prefix_caching, clock=clock,
                                 kv_events=log, tier_observer=tiering, max_prefix_leased_blocks=max_leased)
    if tiering is not None:
        tiering.block_manager = block_manager
        tiering.record_events = log is not None  # (BlockStored with medium DISK / REDIS)
    # Speculative decoding (--speculative-config): drafts proposed per step, verified in the forward.
    spec_config = parse_speculative_config(args.speculative_config)
    spec = None
    if spec_config is not None:
        spec = make_proposer(spec_config, max_len)
        if not info.batch_invariant:  # (LayerOps: every op of the forward pass, fallbacks included)
            logger.warning("speculative decoding on %s: this path is not batch-invariant (%s), so verified tokens "
                           "equal plain decoding's only up to float rounding (exact where the whole forward pass "
                           "runs on a CPU kernel tier)", info.kernels, "; ".join(info.non_invariant_fallbacks))
    scheduler = Scheduler(
        SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len, args.max_prefill_tokens_while_decoding,
                        policy=args.scheduling_policy),
        block_manager, drafter=spec, kv_free_window=kv_free_window,
    )
    # Structured outputs: compiled off the step (a worker thread); requests wait meanwhile.
    structured_config = parse_structured_outputs_config(args.structured_outputs_config)
    structured = GrammarCompilerService(tokenizer, cfg.vocab_size, sorted(eos), config=structured_config)
    return EngineParts(
        source=source, hf_config=hf_config, model_config=cfg, tokenizer=tokenizer, eos_token_ids=eos,
        served_model_name=args.served_model_name or source.name, runner=runner, max_model_len=max_len,
        max_model_len_note=note, kv_free_window=kv_free_window, kv_events_config=events_config, kv_event_log=log,
        kv_event_publisher=publisher, kv_tiering=tiering, max_prefix_leased_blocks=max_leased,
        block_manager=block_manager, speculative_config=spec_config, spec=spec, scheduler=scheduler,
        structured_outputs_config=structured_config, structured=structured,
        load_seconds=time.perf_counter() - t0,
    )


def kv_dtype_field(info: WorkerInfo) -> str:
    """The fingerprint's ``kv_dtype``: the KV cache's element type where it is not the model's (an 8-bit
    cache: its blocks are never read by a bf16 engine, nor a bf16 engine's by it), else ""."""
    kv = info.kv_cache_dtype
    return kv if kv and kv != info.dtype else ""


def kv_fingerprint(args: EngineArgs, source: ModelSource, cfg: ModelConfig, info: WorkerInfo) -> KVFingerprint:
    """Everything that changes a KV block's bytes here (kv_offload/fingerprint.py), the model's rotary
    tables as resolved among them (theta, scaling, and max_model_len where they depend on it, as
    Phi-3's long-rope factors do: a block's keys are rotated by them)."""
    folder = Path(source.folder)
    if source.gguf_file is not None:
        files = [folder / source.gguf_file]
    else:
        files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + [folder / "config.json"]
    memo = None
    if args.kv_offload_dir:
        os.makedirs(args.kv_offload_dir, exist_ok=True)
        memo = os.path.join(args.kv_offload_dir, "model-hashes.json")
    return KVFingerprint(
        model_hash=hash_model_files((f for f in files if f.is_file()), memo_path=memo),
        dtype=info.dtype, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, block_size=args.block_size, kv_layout=info.attention_backend,
        kernels=f"{info.kernels}; quantization={args.quantization}", device_type=info.device,
        kv_dtype=kv_dtype_field(info),
    ).with_rope(info.rope_identity)
