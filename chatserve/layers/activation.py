"""silu(gate) * up and gelu_tanh(gate) * up over the fused gate|up projection, with the C++ bf16
kernels fixed at construction (every width: the kernels take a partial vector at a row's tail)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu import CpuKernels
from chatserve.layers.fallbacks import Fallback


class SiluAndMul(nn.Module):
    def __init__(self, intermediate_size: int, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self._kernel = kernels.silu_mul if kernels is not None else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and gate_up.dtype == torch.bfloat16:
            return self._kernel(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up

    def kernel_fallbacks(self) -> list[Fallback]:
        return []  # the kernel takes every width; without kernels the whole path is torch (LayerOps says so)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's GeGLU, transformers' "gelu_pytorch_tanh"): the C++ bf16 kernel
    where the kernels are loaded (one rounding; torch's gelu takes its vector or its scalar code by
    an element's place in a thread's share, so its bits depend on the batch and the thread split)."""

    def __init__(self, intermediate_size: int, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self._kernel = kernels.gelu_tanh_mul if kernels is not None else None  # (models/layer_stack.py reads it)
        self._missing = kernels is not None and self._kernel is None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and gate_up.dtype == torch.bfloat16:
            return self._kernel(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def kernel_fallbacks(self) -> list[Fallback]:
        if self._missing:
            return [Fallback("gelu*up", "these kernels have no gelu_tanh_mul: torch's gelu")]
        return []
