"""Attention backends over the paged KV cache, behind one interface (`base.AttentionBackend`).

- ``torch``: the pure-torch reference ops, with cascade attention for shared cached prefixes;
- ``cpu``: the compiled C++ paged attention for prefill, extend and decode, one reduction order
  per query row whatever the batch (AVX512-BF16 CPUs; the torch reference with the C++ K/V store
  for head sizes it does not take);
- ``triton``: the Triton paged kernels (CUDA; on the CPU only interpreted, for tests).

`select_attention_backend` is the one place that chooses, once per engine, from `EngineArgs`.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from chatserve.attention.base import AttentionBackend, BatchLayout
from chatserve.attention.cpu_backend import CpuKernelAttentionBackend, CpuPagedAttentionBackend, paged_kernel_fits
from chatserve.attention.torch_backend import TorchAttentionBackend
from chatserve.kernels.cpu import CpuKernels

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def select_attention_backend(
    requested: str, device: torch.device, *, kernels: CpuKernels | None = None,
    head_dim: int = 64, num_heads: int = 1, num_kv_heads: int = 1,
) -> AttentionBackend:
    """"auto": Triton on CUDA (when installed), else the torch reference, with the C++ kernels
    where `kernels` were loaded (CPU, bf16). "torch" is the same torch path; "triton" forces Triton."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be auto, torch or triton; got {requested!r}")
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        if requested == "auto" and importlib.util.find_spec("triton") is None:
            logger.warning("attention_backend=auto: triton is not installed, using the torch reference on CUDA "
                           "(pip install triton for the paged kernels)")
            return TorchAttentionBackend()
        from chatserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    if kernels is not None:
        if paged_kernel_fits(head_dim):
            return CpuPagedAttentionBackend(kernels)
        return CpuKernelAttentionBackend(kernels)
    return TorchAttentionBackend()


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "BatchLayout", "select_attention_backend"]
