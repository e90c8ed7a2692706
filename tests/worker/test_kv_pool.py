"""The KV pool's own accounting with an 8-bit cache: a block costs head_dim + 4 bytes per token and KV
head (quants and scale), so the same memory budget holds >= 1.85x the tokens of a bfloat16 pool."""

from __future__ import annotations

import pytest
import torch

from chatserve.config import CacheConfig
from chatserve.models.config import ModelConfig
from chatserve.models.loader import load_hf_config, resolve_model
from chatserve.worker.kv_pool import kv_bytes_per_block, plan_kv_pool


@pytest.fixture(scope="module")
def default_model() -> ModelConfig:
    return ModelConfig.from_hf(load_hf_config(resolve_model(None)))


def test_int8_blocks_cost_head_dim_plus_4_bytes_per_token_and_head(default_model) -> None:
    cfg = default_model
    assert cfg.head_dim == 64
    per_row = cfg.num_layers * 2 * cfg.num_kv_heads * 16  # rows (K and V, every layer) of a 16-token block
    assert kv_bytes_per_block(cfg, 16, torch.int8) == per_row * (64 + 4)
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == per_row * 64 * 2


@pytest.mark.parametrize("gb", [0.25, 1.0, 3.0])
def test_int8_pool_holds_at_least_1_85x_the_tokens_per_gib(default_model, gb) -> None:
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=gb)
    bf16, int8 = plan_kv_pool(default_model, cache, torch.bfloat16), plan_kv_pool(default_model, cache, torch.int8)
    assert int8.num_tokens >= 1.85 * bf16.num_tokens
    for pool in (bf16, int8):  # within the budget, and no whole block of it left unused
        assert pool.num_blocks * pool.bytes_per_block <= gb * 2**30 < (pool.num_blocks + 1) * pool.bytes_per_block


def test_an_explicit_block_count_is_the_same_tokens_in_either_dtype(default_model) -> None:
    cache = CacheConfig(block_size=32, num_kv_blocks=100)
    bf16, int8 = plan_kv_pool(default_model, cache, torch.bfloat16), plan_kv_pool(default_model, cache, torch.int8)
    assert bf16.num_tokens == int8.num_tokens == 3200
    assert int8.bytes_per_block * 128 == bf16.bytes_per_block * 68
