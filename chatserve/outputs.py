"""Results handed to users, shaped like vLLM's so habits carry over."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

# "error": the request could not go on (e.g. its grammar failed to compile or reached a dead end);
# CompletionOutput.error says why. Other requests in the batch are unaffected.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token (vLLM's prompt_logprobs): None for the first (nothing predicts it), then the
# prompt token's logprob and rank plus the top-N.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    error: str | None = None  # set with finish_reason "error": what went wrong, for the user
    # LLM.chat(..., tools=[...]): the calls parsed from `text` (chatserve.tools.ToolCall); None without tools
    tool_calls: list[Any] | None = None
    # A reasoning model's thinking (SamplingParams.reasoning set): the text between its markers, with
    # the same cumulative/delta/final_only semantics as `text` (which then holds only the answer);
    # None when the request has no reasoning parser.
    reasoning: str | None = None
    # the tokens spent reasoning, the markers included (usage's reasoning_tokens)
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStats:
    """One request's timing and counters, filled in place as it runs; the only record of them.

    The async engine creates it when `generate()` accepts the request (so queueing before the
    engine sees it counts as queue time) and hands it to `LLMEngine.add_request`; the scheduler
    and the engine fill the rest. Every `RequestOutput` of the request carries this same object,
    so an early output's `stats` shows later progress too. Times are `time.monotonic()` seconds;
    a request with n > 1 choices has one record: the first choice scheduled, the first token
    sampled (of any choice), tokens summed over the choices.
    """

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # first admitted by the scheduler: queue time ends
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Why the prefix cache stopped where it did, at first admission (chatserve.cache.MissReason):
    # "none" (a full hit), "new", "evicted", "diverged" (at token cache_diverged_at) or "skipped" (prompt_logprobs).
    cache_miss_reason: str = "new"
    cache_diverged_at: int | None = None
    cache_lease_hit: bool = False  # the hit ended on a leased branch (a session's, or a leased prompt prefix)
    session_history_tokens: int | None = None  # a session turn: how many prompt tokens are its stored history
    # a session turn after its first: did the cache hold the stored history (every whole block of it that
    # was computed: the last token never is, it was sampled last)? None otherwise
    session_history_matched: bool | None = None
    # speculative decoding: draft tokens verified for this request and how many were kept
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # the KV tiers below the tree (disk, Redis): prompt tokens loaded from each into the tree before the
    # first admission (they count in num_cached_tokens too), the load's wait, and why the tier lookup
    # stopped: None (no lookup: tiers off, or the tree held every full block), "complete", "absent",
    # "invalid:<reason>" (an entry failed its checks: a counted miss), "unavailable" (a tier was down),
    # "no_room" (the pool had no free block for it), "error"
    num_disk_cached_tokens: int = 0
    num_redis_cached_tokens: int = 0
    kv_load_seconds: float = 0.0
    kv_tier_stop: str | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second after the first; None until finished with two or more."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        elapsed = self.finish_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: RequestStats = field(default_factory=RequestStats)  # the request's live record (shared, not a copy)
    # SamplingParams.prompt_logprobs asked for: every output has them, a delta stream only its first (as vLLM)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's name), read from `stats`."""
        return self.stats.num_cached_tokens


@dataclass(frozen=True)
class EngineInfo:
    """What an engine was built with and how long it took: the one public answer benchmarks and
    diagnostics read (``LLM.engine_info()``), so that none walks into the engine's runner or block
    manager. Plain values only: it is printed, compared and written to JSON."""

    model: str
    architecture: str
    num_layers: int
    device: str  # "cpu", "cuda"
    dtype: str  # "bfloat16", "float32", ...
    attention_backend: str  # "torch", "cpu" or "triton"
    kernels: str  # LayerOps.describe(): which kernel does each op
    kernel_tier: str | None  # the CPU kernel tier ("avx2", "avx512_bf16", ...); None without the C++ kernels
    linear_impl: str  # how the matmuls run
    batch_invariant: bool  # every op of the forward pass batch- and thread-invariant
    block_size: int
    num_kv_blocks: int
    kv_pool_tokens: int  # num_kv_blocks * block_size
    kv_bytes_per_block: int  # every layer's K and V of one block (int8: the scales included)
    max_model_len: int
    load_seconds: float  # the whole engine construction
    weights_load_seconds: float  # the weights alone (read, or mapped from the weight cache)
    weight_cache_status: str  # "hit", "miss", "off", ...
    plain_parameters: int  # parameters held as torch tensors (packed quantized matmuls not included)
    kv_cache_dtype: str = ""  # the KV cache's element type ("bfloat16", "int8"); "" = dtype
