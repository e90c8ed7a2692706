"""What the engine asks of a worker: the narrow interface `EngineCore` and the KV tiers use.

`ModelRunner` is the real one (a model, its KV pool, the sampler); a test hands the engine a fake
that implements these few members instead, with no model behind it. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from chatserve.core.scheduler import ScheduledSeq
    from chatserve.worker.kv_pool import KVPoolSpec
    from chatserve.worker.spec_verify import SampledSeq


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker chose and built, fixed once it is loaded (the engine's `info()` and the KV
    tiers' fingerprint read it; the engine never looks at the kernels or layers themselves)."""

    device: str  # "cpu" or "cuda"
    dtype: str  # "bfloat16", "float32", ...
    attention_backend: str  # "torch", "cpu" or "triton": also the KV layout
    kernels: str  # every op of the forward pass, in words (LayerOps.describe)
    kernel_tier: str | None  # the CPU kernel tier, None without one
    linear_impl: str
    # every op of the forward pass batch- and thread-invariant (LayerOps.batch_invariant)
    batch_invariant: bool
    load_seconds: float  # building the model and loading its weights
    weight_cache_status: str
    plain_parameters: int
    # per layer, its attention window (0: full attention)
    sliding_windows: tuple[int, ...] = ()
    # what each rotary table is built from, resolved: a KV block's bytes depend on it (KV tiers' fingerprint)
    rope_identity: dict[str, Any] = field(default_factory=dict)
    # why parts of the forward pass are not batch-invariant (for the speculative decoding warning)
    non_invariant_fallbacks: tuple[str, ...] = ()
    # the KV cache's element type ("bfloat16", "int8", ...); "" = the same as dtype
    kv_cache_dtype: str = ""


class KVBlockIO(Protocol):
    """Copies of whole KV blocks out of and into the pool (the disk / Redis tiers' side)."""

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None: ...


class Worker(KVBlockIO, Protocol):
    """One forward pass per step over the scheduled sequences, and the KV pool it owns.

    `execute` may raise `StepInterrupted` from `between_layers` (every request of the step is being
    aborted); it returns, in order, each sequence that got tokens this step.
    """

    pool: KVPoolSpec
    eos_token_ids: tuple[int, ...]  # set by the engine; min_tokens holds these back

    def execute(
        self, scheduled: list[ScheduledSeq], copies: Sequence[tuple[int, int, int]] = (),
        between_layers: Callable[[], None] | None = None,
    ) -> list[SampledSeq]: ...

    def info(self) -> WorkerInfo: ...
