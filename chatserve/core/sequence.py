"""A request's state as the scheduler and the model runner see it."""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.outputs import FinishReason, RequestStats, SampleLogprobs
from chatserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from chatserve.reasoning.tracker import ReasoningTracker


class GrammarMatcher(Protocol):
    """A structured-outputs grammar walked token by token (structured.SequenceMatcher): the output
    processor accepts each sampled token, the sampler masks the next one and rolls drafts back."""

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    @property
    def is_terminated(self) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


class DetokenizerUpdate(Protocol):
    @property
    def stop_str(self) -> str | None: ...


class Detokenizer(Protocol):
    """A sequence's text, built token by token and cut at a stop string (engine.detokenizer)."""

    def add_tokens(self, token_ids: Seq[int]) -> DetokenizerUpdate: ...

    def flush(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def finished(self) -> bool: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated continuation of a prompt (a request with n > 1 has n of them).

    It owns its tokens (`token_ids`: prompt + output), its place in the KV pool (`block_table`,
    the prefix-cache locks `cache_node` / `prefetch_node`) and its per-sequence generation state
    (seeded `generator`, `grammar` matcher, `detokenizer`, logprobs); the request's `stats`
    record it shares with its siblings. `num_computed_tokens` of the tokens have their K/V in the
    blocks of `block_table`. After a preemption by recompute, `num_computed_tokens` drops to what
    the prefix cache still holds and the output is kept, so the request resumes where it was.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_published_blocks: int = 0  # full blocks already offered to the prefix cache
    cache_node: object | None = None  # lock handle in the prefix cache (MatchResult.node)
    # NOTE: blocks loaded from the disk / Redis tiers for this sequence wait in the tree under this
    # lock until its first admission locks its own match (then this one is dropped), or it ends.
    prefetch_node: object | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    generator: torch.Generator | None = None  # for seeded sampling (a type only: core stays torch-free)
    # NOTE: a structured.SequenceMatcher once the request's grammar is compiled (None: unconstrained).
    # A constrained sequence reaches the scheduler only after that, so every scheduled one has it.
    grammar: GrammarMatcher | None = None
    detokenizer: Detokenizer | None = None
    # NOTE: a reasoning request's split, counts and budget (SamplingParams.reasoning); it decides what
    # `grammar` is before each token: nothing while reasoning, the forced end marker, the answer's grammar.
    reasoning: ReasoningTracker | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    # NOTE: vLLM's prompt_logprobs, on the sequence that computes them (the request's first; its siblings
    # read the prefix cache as usual): one entry per prompt position computed so far, the first None (no
    # token before it predicts it), then the worker's TokenLogprobs of each prompt token (its logprob,
    # rank and the top-k). While it is short of the prompt, the sequence does not read the prefix cache.
    prompt_logprobs: list[Any] | None = None
    sent_prompt_logprobs: bool = False  # a delta output carries them once
    # NOTE: one record per request, shared by its n sequences (the scheduler writes admission,
    # prefix hit and preemptions into it; the engine the tokens and finish).
    stats: RequestStats = field(default_factory=RequestStats)
    session: SessionKV | None = None  # a session turn: its branch is leased when it finishes
    # NOTE: the request's cache_salt: it matches and inserts only blocks of this salt (cache/radix_tree.py)
    cache_salt: str | None = None
    cache_leases: tuple[CacheLease, ...] = ()  # prompt prefixes leased when it finishes (core/cache_lease.py)
    # what has been reported to the user already (for delta outputs)
    sent_text_len: int = 0
    sent_token_len: int = 0
    sent_finish: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.index == 0 and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: every prefill row then gets logits, and
        the prefix cache is not read (its cached positions would have none)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def record_prompt_logprobs(self, first_position: int, entries: Seq[Any]) -> None:
        """Keep the entries of prompt positions ``first_position ..`` not recorded yet: a chunk computed
        again after a preemption by recompute adds nothing twice."""
        assert self.prompt_logprobs is not None
        have = len(self.prompt_logprobs)
        if first_position > have:
            raise AssertionError(f"prompt logprobs from position {first_position} but only {have} recorded")
        self.prompt_logprobs.extend(entries[have - first_position :])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
