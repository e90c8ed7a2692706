"""RMSNorm, and the residual add fused with it, with the C++ bf16 kernels fixed at construction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu import CpuKernels
from chatserve.layers.fallbacks import Fallback


class RMSNorm(nn.Module):
    """Computed in float32 and cast back before the weight, as transformers does (bit-exact in fp32).

    `kernels` (the C++ bf16 kernels, or None) decides at construction what bf16 rows run on: the
    C++ pass at every row count and width (one row's arithmetic whatever the batch: a row must not
    round differently at 65 rows than at 64, issue 20; it threads over rows above 64), torch's ops
    otherwise. Inputs of more than two dims (Qwen3's per-head q/k norms over [T, heads, head_dim])
    run as rows of their last dim.
    """

    def __init__(self, dim: int, eps: float, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._kernel = kernels.rms_norm if kernels is not None else None
        self._kernel_add = kernels.add_rms_norm if kernels is not None else None

    def kernel_fallbacks(self) -> list[Fallback]:
        return []  # every width and rank runs the kernel; without kernels the whole path is torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            if self._kernel is not None:
                if x.dim() == 2:
                    return self._kernel(x, self.weight, self.eps)
                return self._kernel(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            # one fused op; differs from the formula below by at most one bf16 ulp
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add fused with the next norm.

        Same arithmetic either way (the sum is rounded to the stream's dtype before the norm); the
        C++ pass updates `residual` in place for bf16 rows, saving one op and one pass.
        """
        if (self._kernel_add is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and residual.is_contiguous()):
            return self._kernel_add(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual
