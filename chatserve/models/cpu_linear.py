"""Faster bf16 linear layers on the CPU.

Measured on the 2-core AVX-512 dev box, per decode token of SmolLM2-135M
(30 layers, cold caches): `F.linear` bf16 24 ms, oneDNN prepacked 16.7 ms, our
AVX512-BF16 gemv kernel (chatserve.kernels.cpu_gemv) 10.2 ms at batch 1. For
batches above 8 rows (prefill, big decode batches) `F.linear` runs oneDNN.
If the kernel cannot be built, oneDNN-prepacked weights are used instead
(faster than `F.linear` at every batch size, but their plain copy is dropped,
so the gemv kernel could not use them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu_gemv import MAX_GEMV_ROWS

logger = logging.getLogger(__name__)

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(2, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-2))
    except Exception as exc:  # an unusual build: fall back to F.linear
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


class PackedLinear(nn.Module):
    """Drop-in for `nn.Linear` on 2-D inputs, holding a oneDNN-packed weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


class GemvLinear(nn.Module):
    """Drop-in for `nn.Linear` on 2-D inputs: the gemv kernel for up to 8 rows, `F.linear` above."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Gemv) -> None:
        super().__init__()
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_GEMV_ROWS:
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every `nn.Linear` below `module` by `make(linear)`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += replace_linears(child, make)
    return count


def pack_linears(module: nn.Module) -> int:
    return replace_linears(module, lambda lin: PackedLinear(lin.weight, lin.bias))
