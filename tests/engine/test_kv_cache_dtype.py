"""`kv_cache_dtype="int8"` through a whole engine on any host: a float32 engine (the torch path a CPU
without a kernel tier runs) keeps an int8 cache of rows head_dim + 4, sized by the same budget, and
serves from it. (The bf16 kernel path: tests/engine/test_determinism.py and tests/kv_offload.)"""

from __future__ import annotations

import pytest
import torch

from chatserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_a_float32_engine_keeps_an_int8_cache_and_serves_from_it(tiny) -> None:
    kw = dict(dtype="float32", cpu_kernels=False, kv_cache_memory_gb=0.01, block_size=16)
    f32 = LLM(str(tiny), **kw)
    int8 = LLM(str(tiny), kv_cache_dtype="int8", **kw)
    a, b = f32.engine_info(), int8.engine_info()
    assert (a.dtype, a.kv_cache_dtype, b.dtype, b.kv_cache_dtype) == ("float32", "float32", "float32", "int8")
    assert b.kv_bytes_per_block * 64 == a.kv_bytes_per_block * 20  # head_dim 16: 16 + 4 bytes against 16 x 4
    assert b.kv_pool_tokens >= 3 * a.kv_pool_tokens
    cache = int8.engine.runner.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[-1] == 16 + 4
    ids = list(range(300, 340))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = int8.generate({"prompt_token_ids": ids}, params)[0]
    again = int8.generate({"prompt_token_ids": ids}, params)[0]
    assert len(first.outputs[0].token_ids) == 4 and again.num_cached_tokens == 32
    # every row of the blocks in use is a quantized row (a zeroed one, or one whose largest |q| is 127)
    used = [b for b, ready in enumerate(int8.engine.runner._block_ready) if ready]
    rows = cache[:, :, used].reshape(-1, cache.shape[-1])
    scales = rows[:, 16:].contiguous().view(torch.float32).view(-1)
    qmax = rows[:, :16].abs().amax(dim=-1)
    assert torch.all((scales == 0) | (qmax == 127)) and int((scales > 0).sum()) >= 2 * 2 * 2 * 43  # layers, K/V, heads, tokens
