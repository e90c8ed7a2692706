"""What a model's layers run, chosen once per engine before the model is built.

The model runner picks these from `EngineArgs`, the device, the dtype and what the CPU offers
(`select_layer_ops`), and every layer takes what it needs at construction. Nothing is swapped
after load and no forward re-checks which kernel to use beyond the data (dtype, row count).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from chatserve.attention import select_attention_backend
from chatserve.attention.base import AttentionBackend
from chatserve.kernels.cpu import CpuKernels, load_cpu_kernels
from chatserve.layers.linear import LinearMethod, select_linear_method
from chatserve.layers.quantized_linear import select_quantization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerOps:
    linear: LinearMethod  # every matmul's weight layout and kernel
    attention: AttentionBackend  # store K/V and attend over the paged cache
    cpu: CpuKernels | None = None  # the C++ bf16 norm, rotary and silu*up kernels; None = torch ops
    gguf_qtypes: frozenset[int] = frozenset()  # GGUF tensor types the loader hands `linear` undecoded

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
    cpu_kernel_tier: str = "auto",
) -> LayerOps:
    """The C++ kernels where asked for and where they apply (a bf16 model on a CPU with a kernel
    tier: AVX2 or better), the matmul method that goes with them, and the attention backend."""
    kernels = None
    if cpu_kernels and device.type == "cpu" and dtype == torch.bfloat16:
        kernels = load_cpu_kernels(amx=amx, tier=cpu_kernel_tier)
    attention = select_attention_backend(
        attention_backend, device, kernels=kernels if attention_backend != "triton" else None,
        head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
    )
    quant = select_quantization(quantization, is_gguf=is_gguf, dtype=dtype, device=device, kernels=kernels)
    linear = quant.method or select_linear_method(dtype, device, kernels)
    ops = LayerOps(linear=linear, attention=attention, cpu=kernels, gguf_qtypes=quant.keep_qtypes)
    logger.info("%s", ops.describe())
    return ops
