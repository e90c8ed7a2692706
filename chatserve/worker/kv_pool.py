"""How many KV blocks the pool holds, from an explicit count or a memory budget.

A block's bytes are every layer's K and V rows of its slots: ``2 * head_dim`` bytes per token and
KV head in bfloat16, ``head_dim + 4`` in int8 (the quants and the row's fp32 scale:
kernels/kv_quant.py), so the same budget holds 128/68 = 1.88x the tokens in int8 at head_dim 64."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatserve.config import CacheConfig
from chatserve.kernels.kv_quant import kv_row_bytes
from chatserve.models.config import ModelConfig

_DEFAULT_KV_BUDGET_GB = 0.5


@dataclass(frozen=True)
class KVPoolSpec:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of the pool (every layer, K and V), scales included for int8."""
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * kv_row_bytes(cfg.head_dim, kv_dtype)


def plan_kv_pool(cfg: ModelConfig, cache: CacheConfig, kv_dtype: torch.dtype) -> KVPoolSpec:
    """The pool for a cache of element type ``kv_dtype`` (the model's dtype, or int8)."""
    per_block = kv_bytes_per_block(cfg, cache.block_size, kv_dtype)
    if cache.num_kv_blocks is not None:
        if cache.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {cache.num_kv_blocks}")
        n = cache.num_kv_blocks
    else:
        gb = cache.kv_cache_memory_gb if cache.kv_cache_memory_gb is not None else _DEFAULT_KV_BUDGET_GB
        if gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {gb}")
        n = int(gb * (1 << 30)) // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory_gb={gb} is smaller than one KV block ({per_block} bytes)")
        if cache.kv_cache_memory_gb is None:  # the default budget grows to what max_model_len needs
            n = max(n, -(-cache.min_pool_tokens // cache.block_size))
    return KVPoolSpec(n, cache.block_size, per_block)
