"""Owns the model weights and the KV pool; turns scheduled sequences into one forward pass."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from chatserve.config import CacheConfig
from chatserve.core.scheduler import ScheduledSeq
from chatserve.forward_batch import build_forward_batch
from chatserve.kernels.kv_quant import kv_row_width
from chatserve.layers.ops import LayerOps
from chatserve.layers.rotary import RotaryEmbedding
from chatserve.models.config import ModelConfig
from chatserve.models.loader import ModelSource, iter_weights
from chatserve.models.registry import model_class_for
from chatserve.models.weight_cache import WeightCacheConfig, load_weights_cached
from chatserve.worker.interface import WorkerInfo
from chatserve.worker.kv_pool import plan_kv_pool
from chatserve.worker.kv_transfer import read_blocks, write_blocks
from chatserve.worker.sampler import Sampler, prompt_logprobs, row_is_greedy
from chatserve.worker.spec_verify import SampledSeq, SamplerRows, split_rows

logger = logging.getLogger(__name__)

class StepInterrupted(Exception):
    """Raised between layers to stop a forward pass whose work nobody will read (every request in
    it is being aborted). The step then counts for nothing: see EngineCore.step."""


_M = TypeVar("_M", bound=torch.nn.Module)


def _materialise(model: _M, device: torch.device) -> _M:
    """`model.to_empty(device=device)` without its `torch.empty_like`: each meta parameter and
    buffer becomes an uninitialised `torch.empty` of its shape and dtype (pages untouched until
    load_weights writes them).

    Why not to_empty: `empty_like` of a meta tensor goes through torch's Python reference
    (`torch._refs`), which imports sympy (~30 MiB resident) just to compute the strides of a
    contiguous tensor.
    """
    fresh: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fresh:
            fresh[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return fresh[id(t)]

    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = empty(buf)
    return model


class ModelRunner:
    """The worker: owns the model's weights, the KV pool (`kv_cache`, `pool`) and the sampler, on the
    device, dtype and layer ops it was built with (`worker/setup.py` chooses them); `execute` turns
    one step's scheduled sequences into one forward pass and its sampled tokens. Implements
    `worker.interface.Worker`, the whole of what the engine asks of it."""

    def __init__(
        self,
        source: ModelSource,
        hf_config,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        ops: LayerOps,
        weight_cache: WeightCacheConfig | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = model_config
        self.ops = ops
        self.attention_backend = ops.attention
        self.dtype = dtype
        # the KV cache's element type: the model's dtype, or int8 (rows of head_dim + 4: kernels/kv_quant.py)
        self.kv_cache_dtype = kv_cache_dtype if kv_cache_dtype is not None else dtype
        self.device = device
        self.block_size = cache_config.block_size
        t0 = time.perf_counter()
        model_cls = model_class_for(model_config.architecture)
        # NOTE: built on the meta device and materialised uninitialised: no time or
        # memory is spent on a random init that load_weights overwrites (it checks
        # that every parameter is filled).
        with torch.device("meta"):
            model = model_cls(model_config, max_model_len, ops)
        # what the built layers run outside the kernel tier, said once at start (LayerOps.batch_invariant)
        ops.audit(model)
        ops.log_fallbacks()
        model = _materialise(model.to(dtype), device)
        model.rotary = RotaryEmbedding(model_config.hf_config, model_config.head_dim, max_model_len).to(device)

        def fill() -> None:
            model.load_weights(iter_weights(source, hf_config, dtype, keep_qtypes=ops.gguf_qtypes))
            model.process_weights()

        # mapped from the repacked-weight cache where a valid entry exists, else filled (and written there)
        self.weight_cache = load_weights_cached(model, fill, config=weight_cache, source=source, dtype=dtype,
                                                device=device, ops=ops)
        self.model = model.eval()
        self.linear_impl = ops.linear.description
        self.load_seconds = time.perf_counter() - t0

        self.pool = plan_kv_pool(model_config, cache_config, self.kv_cache_dtype)
        # NOTE: torch.empty, not zeros: pages are touched only as blocks are used, so
        # the resident memory grows with use and never past the budget. Each block is
        # zeroed on its first use (`_zero_fresh_blocks`), so no read ever sees garbage.
        self.kv_cache = torch.empty(
            (model_config.num_layers, 2, self.pool.num_blocks, self.block_size, model_config.num_kv_heads,
             kv_row_width(model_config.head_dim, self.kv_cache_dtype)),
            dtype=self.kv_cache_dtype,
            device=device,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            self.pool.num_blocks, self.block_size, self.pool.num_tokens,
            self.pool.num_blocks * self.pool.bytes_per_block / 2**20, self.kv_cache_dtype,
        )
        self._block_ready = bytearray(self.pool.num_blocks)  # 1 once a block has been zeroed or copied into
        self.sampler = Sampler()
        self.eos_token_ids: tuple[int, ...] = ()  # set by the engine; min_tokens holds these back
        self._info: WorkerInfo | None = None

    def info(self) -> WorkerInfo:
        """What was chosen and built (fixed after load; computed once)."""
        if self._info is None:
            ops = self.ops
            self._info = WorkerInfo(
                device=self.device.type, dtype=str(self.dtype).removeprefix("torch."),
                kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
                attention_backend=ops.attention.name, kernels=ops.describe(),
                kernel_tier=ops.cpu.tier if ops.cpu is not None else None, linear_impl=str(self.linear_impl),
                batch_invariant=ops.batch_invariant, load_seconds=self.load_seconds,
                weight_cache_status=str(self.weight_cache.status),
                plain_parameters=sum(p.numel() for p in self.model.parameters()),
                sliding_windows=tuple(getattr(self.model, "windows", ())),
                rope_identity=self.model.rope_identity(),
                non_invariant_fallbacks=tuple(f.describe() for f in ops.fallbacks if not f.invariant),
            )
        return self._info

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write of partially shared blocks: ``(src, dst, k)`` copies the KV of
        src's first k slots into dst (in every layer, K and V), in one indexed op.

        # NOTE: whole blocks are copied; dst's slots from k on are overwritten by
        # its own sequence's prefill before anything reads them (attention reads
        # only positions below each sequence's context length).
        """
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        for c in copies:
            self._block_ready[c[1]] = 1

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Copies of these blocks' KV (for the disk / Redis tiers; worker/kv_transfer.py)."""
        return read_blocks(self.kv_cache, block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Load blocks read back from a tier into the pool (they are then ready: no zeroing needed)."""
        write_blocks(self.kv_cache, block_ids, payloads)
        for b in block_ids:
            self._block_ready[b] = 1

    def _zero_fresh_blocks(self, scheduled: list[ScheduledSeq]) -> None:
        """Zero each block the first time it is written to.

        # NOTE: the pool is allocated uninitialised so that its pages are touched only
        # as they are used. Decode attention copies whole blocks and masks the tail, so
        # a tail must never hold NaN bit patterns (0 x NaN = NaN survives masking).
        """
        fresh = []
        bs = self.block_size
        for s in scheduled:
            table = s.seq.block_table
            for b in table[s.seq.num_computed_tokens // bs :]:
                if not self._block_ready[b]:
                    self._block_ready[b] = 1
                    fresh.append(b)
        if fresh:
            self.kv_cache[:, :, torch.tensor(fresh, dtype=torch.long, device=self.device)] = 0

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], copies: Sequence[tuple[int, int, int]] = (),
        between_layers: Callable[[], None] | None = None,
    ) -> list[SampledSeq]:
        """Run one forward pass; sample for every sequence whose chunk reaches its end.

        ``copies`` (from ``BlockManager.take_pending_copies``) are applied first.
        ``between_layers`` runs after every decoder layer; it may raise StepInterrupted to stop the
        pass (nothing is sampled; the KV written so far is partial and must not be trusted).
        Returns, in order, each sequence that got tokens: one, or for a speculative verification
        the drafts that plain decoding would have produced plus the token after them.
        """
        self.copy_blocks(copies)
        self._zero_fresh_blocks(scheduled)
        decodes = [s for s in scheduled if s.is_decode]
        extends = [s for s in scheduled if not s.is_decode]

        def new_tokens(s: ScheduledSeq) -> list[int]:
            start = s.seq.num_computed_tokens
            if s.draft_token_ids:  # the last real token, then the drafts
                return [s.seq.token_ids[start], *s.draft_token_ids]
            return s.seq.token_ids[start : start + s.num_new_tokens]

        batch = build_forward_batch(
            decode_tokens=[s.seq.token_ids[s.seq.num_computed_tokens] for s in decodes],
            decode_positions=[s.seq.num_computed_tokens for s in decodes],
            decode_block_tables=[s.seq.block_table for s in decodes],
            extend_tokens=[new_tokens(s) for s in extends],
            extend_start_positions=[s.seq.num_computed_tokens for s in extends],
            extend_block_tables=[s.seq.block_table for s in extends],
            extend_need_logits=[s.completes_prompt for s in extends],
            extend_num_logits=[s.num_logits for s in extends],
            block_size=self.block_size,
            device=self.device,
            backend=self.attention_backend,
        )
        sampled = [s for s in decodes + extends if s.completes_prompt]
        if batch.logits_indices.numel() == 0:
            self.model(batch, self.kv_cache, between_layers)  # prefill chunk only: fills the KV cache
            return []
        logits = self.model(batch, self.kv_cache, between_layers)
        if any(s.num_prompt_logprob_rows for s in extends):
            logits = self._take_prompt_logprobs(logits, decodes, extends)
        if not sampled:
            return []
        rows = SamplerRows.build(sampled, needs_draws=lambda p: not row_is_greedy(p))
        try:
            result = self.sampler(
                logits,
                rows.params,
                rows.prompts,
                rows.outputs,
                rows.generators,
                eos_token_ids=self.eos_token_ids,
                grammars=rows.grammars,
                logits_writable=True,  # fresh from the model each step and read by nobody else
            )
        finally:
            rows.rewind_grammars()
        return split_rows(sampled, result.token_ids, result.logprobs, rows)

    def _take_prompt_logprobs(self, logits: torch.Tensor, decodes: list[ScheduledSeq],
                              extends: list[ScheduledSeq]) -> torch.Tensor:
        """Fill each prompt-logprob chunk's ``prompt_logprobs`` from its leading rows of ``logits`` and
        return the rows the sampler reads (each sampled sequence's last 1 + drafts rows, in order).

        # NOTE: the rows come from the same forward pass and lm_head as every other row, and only
        # ``[rows, k]`` selections of them are kept (sampler.prompt_logprobs), never a
        # ``[prompt_len, vocab]`` tensor; other sequences' rows are copied, not recomputed.
        """
        keep: list[int] = list(range(len(decodes)))
        row = len(decodes)
        for s in extends:
            n_prompt = s.num_prompt_logprob_rows
            if n_prompt:
                start = s.seq.num_computed_tokens
                targets = s.seq.token_ids[start + 1 : start + 1 + n_prompt]
                k = s.seq.params.prompt_logprobs or 0
                s.prompt_logprobs = prompt_logprobs(logits[row : row + n_prompt], targets, k)
            n_sample = s.num_logits - n_prompt
            keep.extend(range(row + n_prompt, row + n_prompt + n_sample))
            row += s.num_logits
        index = torch.tensor(keep, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index)
