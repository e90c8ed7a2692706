"""silu(gate) * up over the fused gate|up projection, with the C++ bf16 kernel fixed at construction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu import CpuKernels


class SiluAndMul(nn.Module):
    def __init__(self, intermediate_size: int, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self._kernel = kernels.silu_mul if kernels is not None and intermediate_size % 16 == 0 else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and gate_up.dtype == torch.bfloat16:
            return self._kernel(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's GeGLU, transformers' "gelu_pytorch_tanh"), in torch ops: the
    C++ fused kernels compute silu only, and this is a small part of a step."""

    def __init__(self, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self._kernel = None  # no C++ kernel (models/layer_stack.py reads this)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
