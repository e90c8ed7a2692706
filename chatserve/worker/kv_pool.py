"""How many KV blocks the pool holds, from an explicit count or a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatserve.config import CacheConfig
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


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def plan_kv_pool(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> KVPoolSpec:
    per_block = kv_bytes_per_block(cfg, cache.block_size, dtype)
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
