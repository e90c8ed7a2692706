"""The C++ CPU kernels (bf16 gemv, RMSNorm) against torch, and the KV pool's zero-on-first-use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatserve import LLM, SamplingParams
from chatserve.kernels.cpu_gemv import MAX_GEMV_ROWS, load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no AVX512-BF16 CPU or no compiler: the engine uses torch ops instead")
    return k


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 70)])  # model shapes and a ragged K tail
def test_gemv_matches_float_matmul(kernels, shape):
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    for m in range(1, MAX_GEMV_ROWS + 1):
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float(), b.float())
        out = kernels.gemv(x, w, b).float()
        # one bf16 rounding of the result: relative error below 2^-8
        torch.testing.assert_close(out, ref, atol=1e-2 * float(ref.abs().max()), rtol=8e-3)
        torch.testing.assert_close(kernels.gemv(x, w, None).float(), F.linear(x.float(), w.float()), atol=1e-2 * float(ref.abs().max()), rtol=8e-3)


def test_rms_norm_matches_torch(kernels):
    torch.manual_seed(1)
    x = (torch.randn(37, 576) * 3).to(torch.bfloat16)
    w = (torch.rand(576) + 0.5).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5).float(), ref, atol=2e-2, rtol=8e-3)


def test_unwritten_pool_memory_never_leaks_into_attention(tiny_checkpoint):
    """Decode copies whole blocks and masks their tails, so a tail must never hold NaN bit patterns
    (0 x NaN survives masking). The pool is allocated uninitialised; blocks are zeroed on first use."""
    folder = str(tiny_checkpoint("llama"))
    prompts = [{"prompt_token_ids": list(range(300, 300 + n))} for n in (3, 17, 30, 9)]  # ragged batch
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    llm.engine.runner.kv_cache.fill_(float("nan"))  # what uninitialised memory may hold
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # one at a time, attention reads exactly the written positions: the reference
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
