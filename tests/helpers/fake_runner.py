"""A model runner with no model: the real engine over scripted replies.

`ScriptedWorker` implements the engine's `Worker` protocol (chatserve/worker/interface.py) without
weights: every sampled sequence gets the next token of a scripted reply (the reply's token ids under
the real tokenizer, then the end token). Everything around it is the real engine's: the scheduler,
the block manager and its prefix cache, leases and KV events, the output processor (stop checks,
detokenizing, logprobs), grammars (the worker picks among the tokens the request's real matcher
allows), aborts, and the async engine's loop and streams. Server and engine tests that do not need
what a model computes run on it in milliseconds.

The pool's "KV" is the token each slot was computed for, so the worker also checks the engine's
block bookkeeping: a step whose context blocks do not hold the sequence's own earlier tokens (a
prefix-cache or copy-on-write mix-up) fails the step, as a model reading the wrong KV would have
produced garbage.

`scripted_engine` builds an `LLMEngine` over one, through the builder's seam for a worker that is
built already (`assemble_engine_parts`).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chatserve.config import EngineArgs
from chatserve.core.scheduler import ScheduledSeq
from chatserve.core.sequence import Sequence as Seq
from chatserve.engine.builder import assemble_engine_parts
from chatserve.engine.llm_engine import LLMEngine
from chatserve.models.config import ModelConfig
from chatserve.models.loader import ModelSource
from chatserve.worker.interface import WorkerInfo
from chatserve.worker.kv_pool import KVPoolSpec
from chatserve.worker.model_runner import StepInterrupted
from chatserve.worker.sampler import TokenLogprobs
from chatserve.worker.spec_verify import SampledSeq

# What the scripted model says its chosen token's log-probability is (it is always its top choice),
# and the step down to each alternative it reports.
CHOSEN_LOGPROB = -0.25
ALTERNATIVE_STEP = 1.25
_EMPTY_SLOT = -1
_SLOT = struct.Struct("<i")


class ScriptedWorkerKilled(RuntimeError):
    """The step a test killed the worker in: the engine treats it as any failed step (it dies)."""


class ScriptedWorker:
    """The `Worker` a test drives: scripted tokens, a KV pool of ``num_blocks`` x ``block_size`` slots
    holding token ids, and three test controls.

    * Replies: ``reply_ids`` for every request (each of its n choices says the same), or
      ``scripts[request_id]`` for one; after the script the end token; with ``min_tokens`` still
      unmet, the script again (the real sampler masks the end token there too). Where a request has
      a grammar (``follow_grammar``), the scripted token when its matcher allows it, else the end
      token when allowed, else the lowest id it allows: forced tool calls and response formats run
      the real matcher. ``follow_grammar=False`` ignores it, as a model hitting a grammar's dead end.
    * ``hold``: a sequence gets its first token, then none until ``release()`` (or ``hold`` is set
      False). A step with a held sequence waits ``hold_poll_s`` for the release and otherwise stops
      with `StepInterrupted`, so it counts for nothing and the engine loop applies queued aborts
      and calls between steps, as it does after any step.
    * ``kill()``: the step in flight (or the next) raises `ScriptedWorkerKilled`.
    """

    def __init__(
        self, *, reply_ids: Sequence[int], eos_token_id: int, vocab_size: int, num_blocks: int,
        block_size: int, num_layers: int = 2, hold: bool = False, follow_grammar: bool = True,
        hold_poll_s: float = 0.005,
    ) -> None:
        self.reply_ids = list(reply_ids)
        self.scripts: dict[str, list[int]] = {}
        self.end_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.follow_grammar = follow_grammar
        self.hold = hold
        self.hold_poll_s = hold_poll_s
        self.pool = KVPoolSpec(num_blocks, block_size, block_size * _SLOT.size)
        self.eos_token_ids: tuple[int, ...] = ()  # set by the engine
        self._kv = [[_EMPTY_SLOT] * block_size for _ in range(num_blocks)]
        self._released = threading.Event()
        self._killed = False
        self.num_executes = 0

    # ---- test controls ---------------------------------------------------------------------
    def release(self) -> None:
        """Let held sequences run to their end (and every later one: a release is for good)."""
        self._released.set()

    def kill(self) -> None:
        self._killed = True

    def _is_held(self, s: ScheduledSeq) -> bool:
        return self.hold and not self._released.is_set() and s.completes_prompt and s.seq.num_output_tokens >= 1

    # ---- the Worker protocol ---------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            device="cpu", dtype="scripted", attention_backend="scripted", kernels="none: scripted replies",
            kernel_tier=None, linear_impl="none", batch_invariant=True, load_seconds=0.0,
            weight_cache_status="none", plain_parameters=0, sliding_windows=(0,) * self.num_layers,
        )

    def execute(
        self, scheduled: list[ScheduledSeq], copies: Sequence[tuple[int, int, int]] = (),
        between_layers: Callable[[], None] | None = None,
    ) -> list[SampledSeq]:
        self.num_executes += 1
        self._check_alive()
        for src, dst, k in copies:
            self._kv[dst][:k] = self._kv[src][:k]
        if any(self._is_held(s) for s in scheduled):
            self._released.wait(self.hold_poll_s)
            self._check_alive()
            if any(self._is_held(s) for s in scheduled):
                raise StepInterrupted("held by the test until release()")
        for _ in range(self.num_layers):
            if between_layers is not None:
                between_layers()
        out = []
        for s in scheduled:
            if s.draft_token_ids:
                raise NotImplementedError("the scripted worker verifies no speculative drafts")
            self._compute(s)
            if s.completes_prompt:
                token = self._next_token(s.seq)
                out.append(SampledSeq(s, [token], [self._logprobs(s.seq, token)]))
        return out

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return [b"".join(_SLOT.pack(t) for t in self._kv[b]) for b in block_ids]

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        for b, payload in zip(block_ids, payloads):
            self._kv[b] = [t for (t,) in _SLOT.iter_unpack(bytes(payload))]

    # ---- one step's work -------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._killed:
            raise ScriptedWorkerKilled("the scripted worker was killed by the test")

    def _compute(self, s: ScheduledSeq) -> None:
        """Check that the context's slots hold the sequence's earlier tokens, then "compute" the new ones."""
        seq, bs = s.seq, self.pool.block_size
        start = seq.num_computed_tokens
        for pos in range(start):
            block = seq.block_table[pos // bs]
            if self._kv[block][pos % bs] != seq.token_ids[pos]:
                raise RuntimeError(
                    f"request {seq.request_id!r}: KV slot {pos} (block {block}) holds token "
                    f"{self._kv[block][pos % bs]}, the sequence has {seq.token_ids[pos]} there")
        for pos in range(start, start + s.num_new_tokens):
            self._kv[seq.block_table[pos // bs]][pos % bs] = seq.token_ids[pos]

    def _next_token(self, seq: Seq) -> int:
        script = self.scripts.get(seq.request_id, self.reply_ids)
        n = seq.num_output_tokens
        if n < len(script):
            token = script[n]
        elif n < seq.params.min_tokens and script:
            token = script[n % len(script)]
        else:
            token = self.end_token_id
        if seq.grammar is not None and self.follow_grammar:
            token = self._allowed_choice(seq.grammar, token)
        return token

    def _allowed_choice(self, grammar: Any, token: int) -> int:
        import xgrammar as xgr

        from chatserve.structured.bitmask import expand_bitmask

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        grammar.fill_bitmask(bitmask, 0)
        allowed = expand_bitmask(bitmask, self.vocab_size)[0]
        for choice in (token, self.end_token_id):
            if allowed[choice]:
                return choice
        return int(allowed.nonzero()[0, 0])

    def _logprobs(self, seq: Seq, token: int) -> TokenLogprobs | None:
        """Well-formed and plain: the chosen token is the top one; ``logprobs`` alternatives follow it."""
        num_top = seq.params.logprobs
        if num_top is None:
            return None
        others = (t for t in range(self.vocab_size) if t != token)
        top = [(token, CHOSEN_LOGPROB)] + [(t, CHOSEN_LOGPROB - ALTERNATIVE_STEP * (i + 1))
                                           for i, t in zip(range(num_top - 1), others)]
        return TokenLogprobs(token_id=token, logprob=CHOSEN_LOGPROB, rank=1, top=top[:num_top])


@dataclass(frozen=True)
class ScriptedModel:
    """What the engine is told about the model behind a `ScriptedWorker`: its name, the tokenizer's
    vocabulary, the end token, and as many layers as the worker pretends to run."""

    tokenizer: Any
    name: str = "fake-model"
    num_layers: int = 2

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def config(self, max_model_len: int) -> ModelConfig:
        return ModelConfig(
            architecture="ScriptedModel", vocab_size=len(self.tokenizer), hidden_size=0, intermediate_size=0,
            num_layers=self.num_layers, num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=0.0,
            max_position_embeddings=max_model_len, tie_word_embeddings=False,
            eos_token_ids=(self.eos_token_id,),
        )


def scripted_engine(
    tokenizer: Any, *, reply: str = "Hello there, friend.", model_name: str = "fake-model", max_model_len: int = 256,
    max_num_seqs: int = 4, num_kv_blocks: int | None = None, block_size: int = 16, hold: bool = False,
    follow_grammar: bool = True, grammar_compile_threads: int | None = None, **engine_args: Any,
) -> LLMEngine:
    """An `LLMEngine` over a `ScriptedWorker` (``engine.worker``) with the real ``tokenizer``.

    ``num_kv_blocks`` None: 64 blocks, or as many as ``max_model_len`` needs. ``engine_args``: more
    `EngineArgs` fields (``enable_prefix_caching``, ``max_num_batched_tokens``, ...).
    ``grammar_compile_threads``: the grammar service's compile threads (None: its default).
    """
    model = ScriptedModel(tokenizer, model_name)
    if num_kv_blocks is None:
        num_kv_blocks = max(64, -(-max_model_len // block_size))
    args = EngineArgs(model=model_name, served_model_name=model_name, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks, block_size=block_size, **engine_args)
    worker = ScriptedWorker(
        reply_ids=tokenizer.encode(reply, add_special_tokens=False), eos_token_id=model.eos_token_id,
        vocab_size=len(tokenizer), num_blocks=num_kv_blocks, block_size=block_size, num_layers=model.num_layers,
        hold=hold, follow_grammar=follow_grammar,
    )
    parts = assemble_engine_parts(
        args, source=ModelSource(folder="", gguf_file=None, name=model_name), hf_config=None,
        model_config=model.config(max_model_len), tokenizer=tokenizer,
        eos_token_ids=frozenset({model.eos_token_id}), runner=worker, max_model_len=max_model_len,
    )
    if grammar_compile_threads is not None:
        from chatserve.structured import GrammarCompilerService

        parts.structured = GrammarCompilerService(tokenizer, len(tokenizer), sorted(parts.eos_token_ids),
                                                  config=parts.structured_outputs_config,
                                                  max_workers=grammar_compile_threads)
    return LLMEngine(args, parts=parts)
