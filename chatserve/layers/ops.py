"""What a model's layers run, chosen once per engine before the model is built.

The model runner picks these from `EngineArgs`, the device, the dtype and what the CPU offers
(`select_layer_ops`), and every layer takes what it needs at construction. The kernel tier's cap
and the kernels' build folder arrive as arguments (`EngineArgs.max_cpu_tier`, `kernel_build_dir`):
nothing here reads the environment. Nothing is swapped
after load and no forward re-checks which kernel to use beyond the data (dtype, row count).

`LayerOps` also knows whether the whole forward path is batch- and thread-invariant: the fallbacks
known when the ops are chosen (no kernel tier, a matmul that failed its self-check and runs on oneDNN,
a head size the paged attention kernel does not take) and those each layer reports once the model is
built (`audit`: `kernel_fallbacks()` of every module). `batch_invariant` is the one flag every
exactness claim reads; `log_fallbacks` says at start what falls back and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from chatserve.attention import select_attention_backend
from chatserve.attention.base import AttentionBackend
from chatserve.attention.cpu_backend import CpuPagedAttentionBackend
from chatserve.kernels.cpu import CpuKernels, kernel_problem, load_cpu_kernels
from chatserve.layers.fallbacks import Fallback
from chatserve.layers.linear import LinearMethod, select_linear_method
from chatserve.layers.quantized_linear import QuantizedLinearMethod, select_quantization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerOps:
    linear: LinearMethod  # every matmul's weight layout and kernel
    attention: AttentionBackend  # store K/V and attend over the paged cache
    cpu: CpuKernels | None = None  # the C++ bf16 norm, rotary and silu*up kernels; None = torch ops
    gguf_qtypes: frozenset[int] = frozenset()  # GGUF tensor types the loader hands `linear` undecoded
    # what runs outside the kernel tier, and why (select_layer_ops, then `audit` of the built model)
    fallbacks: list[Fallback] = field(default_factory=list, compare=False)

    @property
    def batch_invariant(self) -> bool:
        """Whether every op of the forward pass gives a row the same bits whatever else is in the step
        and however the work is split over threads (a kernel tier, and no fallback that breaks it)."""
        return self.cpu is not None and all(f.invariant for f in self.fallbacks)

    def note(self, fallback: Fallback) -> None:
        if fallback not in self.fallbacks:
            self.fallbacks.append(fallback)

    def audit(self, model: torch.nn.Module) -> None:
        """Collect what the built model's layers run outside the kernels (`kernel_fallbacks()` of each
        module that has one), once, before its first step."""
        for module in model.modules():
            report = getattr(module, "kernel_fallbacks", None)
            if callable(report):
                for fallback in report():
                    self.note(fallback)

    def invariance(self) -> dict[str, Any]:
        """{"batch_invariant": the flag, "fallbacks": each fallback's line}: for stats and the log."""
        return {"batch_invariant": self.batch_invariant, "fallbacks": [f.describe() for f in self.fallbacks]}

    def log_fallbacks(self) -> None:
        """One line per fallback (a warning where it breaks invariance while a kernel tier is loaded),
        then the verdict."""
        for f in self.fallbacks:
            level = logging.WARNING if self.cpu is not None and not f.invariant else logging.INFO
            logger.log(level, "fallback: %s", f.describe())
        if self.batch_invariant:
            logger.info("forward pass batch- and thread-invariant: every op on the %s kernel tier", self.cpu.tier if self.cpu else "?")
        else:
            logger.info("forward pass NOT batch-invariant: outputs may change with the batch, the prefix cache "
                        "and the thread count (%s)", "; ".join(f.reason for f in self.fallbacks if not f.invariant))

    def release_memory(self) -> None:
        """Freed heap pages back to the OS (glibc malloc_trim), where the C++ kernels are loaded."""
        if self.cpu is not None:
            self.cpu.release_free_memory()

    def describe(self) -> str:
        fused = f"; C++ RMSNorm, rotary, silu*up ({self.cpu.tier})" if self.cpu is not None else ""
        attention = getattr(self.attention, "description", self.attention.name)
        return f"matmuls: {self.linear.description}{fused}; attention: {attention}"


def select_layer_ops(
    *, dtype: torch.dtype, device: torch.device, attention_backend: str, cpu_kernels: bool, amx: bool,
    head_dim: int, num_heads: int, num_kv_heads: int, quantization: str = "none", is_gguf: bool = False,
    cpu_kernel_tier: str = "auto", max_cpu_tier: str | None = None, kernel_build_dir: str | None = None,
) -> LayerOps:
    """The C++ kernels where asked for and where they apply (a bf16 model on a CPU with a kernel
    tier: AVX2 or better, up to `max_cpu_tier`; built under `kernel_build_dir`), the matmul method that
    goes with them (layers/linear.py), and the attention backend."""
    kernels = None
    if cpu_kernels and device.type == "cpu" and dtype == torch.bfloat16:
        kernels = load_cpu_kernels(amx=amx, tier=cpu_kernel_tier, cap=max_cpu_tier, build_dir=kernel_build_dir)
    attention = select_attention_backend(
        attention_backend, device, kernels=kernels if attention_backend != "triton" else None,
        head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
    )
    quant = select_quantization(quantization, is_gguf=is_gguf, dtype=dtype, device=device, kernels=kernels)
    method = quant.method or select_linear_method(dtype, device, kernels)
    ops = LayerOps(linear=method, attention=attention, cpu=kernels, gguf_qtypes=quant.keep_qtypes)
    for fallback in _selection_fallbacks(ops, dtype=dtype, device=device, cpu_kernels=cpu_kernels,
                                         attention_backend=attention_backend, head_dim=head_dim, tier=cpu_kernel_tier,
                                         max_cpu_tier=max_cpu_tier, kernel_build_dir=kernel_build_dir):
        ops.note(fallback)
    logger.info("%s", ops.describe())
    return ops


def _selection_fallbacks(ops: LayerOps, *, dtype: torch.dtype, device: torch.device, cpu_kernels: bool,
                         attention_backend: str, head_dim: int, tier: str, max_cpu_tier: str | None,
                         kernel_build_dir: str | None) -> list[Fallback]:
    """What runs outside the kernel tier by the choice of ops alone (before any layer is built)."""
    if ops.cpu is None:
        if device.type != "cpu":
            reason = f"the {device.type} path runs torch / Triton ops"
        elif dtype != torch.bfloat16:
            reason = f"dtype {str(dtype).removeprefix('torch.')}: torch / oneDNN ops (the kernel tiers are bfloat16)"
        elif not cpu_kernels:
            reason = "cpu_kernels=False: torch / oneDNN ops"
        else:
            reason = f"{kernel_problem(tier, cap=max_cpu_tier, build_dir=kernel_build_dir)}: torch / oneDNN ops"
        return [Fallback("every layer", reason)]
    out = []
    method = ops.linear
    if not getattr(method, "batch_invariant", False):
        if isinstance(method, QuantizedLinearMethod) and getattr(method.quant, "tier", None) is None:
            cause = "the quantized kernels are unavailable"
        elif ops.cpu.gemm is None:
            cause = "the batch-invariant matmul failed its self-check"
        else:
            cause = "no batch-invariant matmul"
        out.append(Fallback("matmul", f"{cause}: {method.description}"))
    if not isinstance(ops.attention, CpuPagedAttentionBackend):
        if attention_backend != "auto":
            cause = f"attention_backend={attention_backend!r}"
        else:
            cause = f"head_dim {head_dim} is not a multiple of 32 or is above 256 (the paged kernel's sizes)"
        out.append(Fallback("attention", f"{cause}: {getattr(ops.attention, 'description', ops.attention.name)}"))
    return out
