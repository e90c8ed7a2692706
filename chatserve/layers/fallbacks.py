"""A part of the forward pass that runs a torch op where the C++ kernel tier is loaded.

Every layer that can fall back says so (`kernel_fallbacks()`), and `LayerOps.audit` collects them
once the model is built: the engine then knows whether its whole forward path is batch- and
thread-invariant (`LayerOps.batch_invariant`), logs each fallback at start with its reason, and every
exactness claim (speculative decoding's warning, `LLMEngine.stats()["batch_invariant"]`) reads that one flag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fallback:
    op: str  # what runs outside the kernels: "matmul", "attention", "gelu*up", ...
    reason: str  # why, in the words the start-up log uses
    # True where the torch op used instead still gives a row the same bits whatever the batch and
    # the thread split (exact elementwise ops, shown by tests/worker/test_row_invariance.py); False breaks
    # the engine's determinism promise
    invariant: bool = False

    def describe(self) -> str:
        kind = "batch- and thread-invariant" if self.invariant else "NOT batch-invariant"
        return f"{self.op}: {self.reason} ({kind})"
