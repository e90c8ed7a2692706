"""The torch backend with the compiled C++ kernels where they apply (AVX512-BF16 CPUs).

The K/V store runs in C++ always; plain decodes (those not in a cascade group) run the C++ paged
decode kernel, which reads the cache in place through the block tables, so no padding mask is
built for them. Everything else is the torch reference (`TorchAttentionBackend`).
"""

from __future__ import annotations

import torch

from chatserve.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from chatserve.kernels.cpu_gemv import CpuKernels


def decode_kernel_fits(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """The C++ decode kernel's limits: head_dim a multiple of 16 up to 256, <= 16 query heads per KV head."""
    return head_dim % 16 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 16


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: CpuKernels, *, paged_decode: bool) -> None:
        super().__init__()
        self._store_kv = kernels.store_kv
        self._paged_decode = kernels.paged_decode if paged_decode else None
        self.needs_decode_mask = self._paged_decode is None

    @property
    def description(self) -> str:
        return "torch + C++ K/V store" + (" + C++ paged decode" if self._paged_decode is not None else "")

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)

    def plain_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        if self._paged_decode is None:
            return super().plain_decode(q, k_cache, v_cache, meta, scale)
        return self._paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
