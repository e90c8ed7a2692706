"""The C++ CPU kernels (bf16 matmuls, AMX tile matmul, RMSNorm; attention: test_cpu_attention.py) against
torch, the bounded matmul shapes, and the KV pool's zero-on-first-use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatserve import LLM, SamplingParams
from chatserve.kernels.cpu_gemv import MAX_GEMV_ROWS
from chatserve.layers.linear import kernel_linear, onednn_linear, onednn_pack, packed_linear_available, power_of_two_pieces


@pytest.fixture(scope="module")
def amx(kernels):
    if kernels.amx is None:
        pytest.skip("this CPU (or its OS) offers no AMX tiles: the AVX512-BF16 kernel is used instead")
    return kernels.amx


# model shapes, the tied lm_head's, and ragged N and K (zero-padded tiles)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (4000, 576), (100, 70), (24, 40)])
def test_amx_linear_matches_float_matmul(amx, shape):
    """Every row count the tiles treat differently: 1-16 (tiles configured for M rows, x read in
    place), 17-32 (a pair of chunks, the second zero-padded), odd chunk counts, several row blocks."""
    torch.manual_seed(shape[0])
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    packed = amx.pack(w)
    assert packed.shape == ((n + 15) // 16, (k + 31) // 32, 16, 32)
    for m in [*range(1, 18), 31, 32, 33, 48, 63, 64, 65, 100, 129, 300]:
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float(), b.float())
        tol = dict(atol=1e-2 * float(ref.abs().max()), rtol=8e-3)  # one bf16 rounding of the result
        torch.testing.assert_close(amx.linear(x, packed, b, n).float(), ref, **tol)
        torch.testing.assert_close(amx.linear(x, packed, None, n).float(), F.linear(x.float(), w.float()), **tol)


def test_amx_linear_reads_strided_rows_and_refuses_mismatches(amx):
    torch.manual_seed(3)
    w = torch.randn(64, 96).to(torch.bfloat16)
    packed = amx.pack(w)
    wide = torch.randn(40, 200).to(torch.bfloat16)
    x = wide[:, 7:103]  # a strided view, as a fused projection's slice would be
    torch.testing.assert_close(amx.linear(x, packed, None, 64).float(), F.linear(x.float(), w.float()), atol=0.1, rtol=8e-3)
    assert amx.linear(x[:0], packed, None, 64).shape == (0, 64)
    with pytest.raises(RuntimeError, match="columns"):
        amx.linear(torch.randn(3, 128).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="N does not match"):
        amx.linear(x, packed, None, 80)
    with pytest.raises(RuntimeError, match="bias"):
        amx.linear(x, packed, torch.randn(63).to(torch.bfloat16), 64)


@pytest.mark.parametrize("shape", [(49, 576), (16, 32), (5, 70)])
def test_amx_packed_rows_give_back_the_exact_weight_rows(amx, shape):
    """A tied embedding looks tokens up in the lm_head's packed copy: bit for bit the original rows."""
    torch.manual_seed(4)
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = amx.pack(w)
    ids = torch.tensor([0, n - 1, n // 2, 0, n - 1])
    assert torch.equal(amx.rows(packed, ids, n, k), w[ids])
    assert torch.equal(amx.rows(packed, torch.arange(n), n, k), w)
    for bad in (-1, n):  # n: inside the zero padding of the last column block, still not a row
        with pytest.raises(RuntimeError, match="out of range"):
            amx.rows(packed, torch.tensor([bad]), n, k)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 70)])  # model shapes and a ragged K tail
def test_gemv_matches_float_matmul(kernels, shape):
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    for m in [*range(1, 18), 24, 31, 32, 33, 47, MAX_GEMV_ROWS]:
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float(), b.float())
        out = kernels.gemv(x, w, b).float()
        # one bf16 rounding of the result: relative error below 2^-8
        torch.testing.assert_close(out, ref, atol=1e-2 * float(ref.abs().max()), rtol=8e-3)
        torch.testing.assert_close(kernels.gemv(x, w, None).float(), F.linear(x.float(), w.float()),
                                   atol=1e-2 * float(ref.abs().max()), rtol=8e-3)


def test_rms_norm_matches_torch(kernels):
    torch.manual_seed(1)
    for m, d in ((37, 576), (3, 100), (70, 64)):  # 100: the scalar tail after 16-wide steps; 70 rows: parallel
        x = (torch.randn(m, d) * 3).to(torch.bfloat16)
        w = (torch.rand(d) + 0.5).to(torch.bfloat16)
        ref = F.rms_norm(x.float(), (d,), w.float(), 1e-5)
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


def test_power_of_two_pieces_cover_rows_with_few_shapes():
    sizes = set()
    for m in range(0, 5000):
        pieces = list(power_of_two_pieces(m, 64))
        assert sum(n for _, n in pieces) == m
        assert [s for s, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        *big, last = pieces or [(0, 0)]
        assert all(n >= 64 and n & (n - 1) == 0 for _, n in big)
        assert last[1] < 64 or last[1] & (last[1] - 1) == 0
        sizes.update(n for _, n in pieces if n >= 64)
    assert sizes == {64, 128, 256, 512, 1024, 2048, 4096}  # oneDNN sees 7 shapes per weight, not 5,000


@pytest.mark.parametrize("m", [9, 40, 64, 65, 100, 129, 300])
def test_kernel_linear_matches_float_matmul_at_every_size(kernels, m):
    torch.manual_seed(m)
    w = (torch.randn(200, 96) * 0.1).to(torch.bfloat16)
    b = torch.randn(200).to(torch.bfloat16)
    x = torch.randn(m, 96).to(torch.bfloat16)
    for bias in (b, None):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = kernel_linear(x, w, bias, kernels.gemv)
        assert out.shape == (m, 200) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=1e-2 * float(ref.abs().max()), rtol=8e-3)


def test_packed_linear_in_pieces_matches_float_matmul():
    if not packed_linear_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 packing on this CPU (it needs AVX512 or AVX-NE-CONVERT; the engine probes the same)")
    torch.manual_seed(3)
    w = (torch.randn(64, 48) * 0.1).to(torch.bfloat16)
    b = torch.randn(64).to(torch.bfloat16)
    packed = onednn_pack(w)
    for m in (1, 7, 8, 37, 100):
        x = torch.randn(m, 48).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(onednn_linear(x, packed, b).float(), ref, atol=1e-2 * float(ref.abs().max()), rtol=8e-3)


def test_silu_mul_matches_torch(kernels):
    torch.manual_seed(5)
    for m in (1, 7, 100):
        x = (torch.randn(m, 2 * 1536) * 4).to(torch.bfloat16)
        x[0, :4] = torch.tensor([0.0, -30.0, 30.0, -0.001])  # saturated and tiny gates
        ref = F.silu(x[:, :1536].float()) * x[:, 1536:].float()
        torch.testing.assert_close(kernels.silu_mul(x).float(), ref, atol=1e-2, rtol=1e-2)


def test_add_rms_norm_updates_residual_and_matches_torch(kernels):
    torch.manual_seed(7)
    for m in (1, 9, 64, 100):
        x = torch.randn(m, 576).to(torch.bfloat16)
        residual = (torch.randn(m, 576) * 3).to(torch.bfloat16)
        w = (torch.rand(576) + 0.5).to(torch.bfloat16)
        summed = residual + x
        out = kernels.add_rms_norm(x, residual, w, 1e-5)
        assert torch.equal(residual, summed)  # updated in place, rounded as torch's add rounds
        ref = F.rms_norm(summed.float(), (576,), w.float(), 1e-5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


def test_rope_inplace_matches_apply_rotary_on_strided_rows(kernels):
    from chatserve.layers.rotary import apply_rotary

    torch.manual_seed(6)
    t, heads, kv_heads, d = 70, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(torch.bfloat16)
    angles = torch.randn(t, 1, d // 2).repeat(1, 1, 2) * 3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    ref = apply_rotary(qk.float(), cos.float(), sin.float())
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    kernels.rope_inplace(qkv, cos, sin, heads + kv_heads, d)
    torch.testing.assert_close(qk.float(), ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


@pytest.mark.parametrize("matmul", ["amx", "avx512"])
def test_default_model_kernel_path_agrees_with_torch_path(kernels, matmul):
    """The bf16 model with every C++ kernel (matmul at all batch sizes, on AMX tiles and on the
    AVX512-BF16 kernel, paged attention, rotary, silu*up, residual add + RMSNorm) against
    the same model on torch/oneDNN ops: while the
    two greedy continuations agree, each step's chosen token is in the other path's top 5, and the
    log-probabilities differ by bf16 noise only. A ragged batch, one prompt over 128 tokens (oneDNN
    pieces + kernel remainder). Measured: mean |diff| 0.044, max 0.31 over 60 steps; with the decode
    kernel's scale off by 1.5x: mean 0.20, max 1.37."""
    prompts = [{"prompt_token_ids": list(range(1000, 1000 + n))} for n in (5, 17, 33, 150, 64)]
    prompts += ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    if matmul == "amx" and kernels.amx is None:
        pytest.skip("no AMX tiles here")
    fast = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=64, enable_prefix_caching=False, amx=matmul == "amx",
               quantization="none")  # the bf16 matmuls (the quantized path: tests/test_quantized_model.py)
    assert fast.engine.attention_backend == "cpu" and "paged attention" in fast.engine.runner.ops.describe()
    assert ("AMX" in fast.engine.runner.linear_impl) == (matmul == "amx")
    fast_out = [o.outputs[0] for o in fast.generate(prompts, params)]
    del fast
    slow = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=64, enable_prefix_caching=False, cpu_kernels=False)
    assert slow.engine.attention_backend == "torch" and slow.engine.runner.ops.cpu is None
    slow_out = [o.outputs[0] for o in slow.generate(prompts, params)]
    diffs = []
    for a, b in zip(fast_out, slow_out):
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[step], b.logprobs[step]
            assert ta in lb and tb in la, (step, ta, tb)
            diffs.append(abs(la[ta].logprob - lb[ta].logprob))
            if ta != tb:
                break
    assert len(diffs) >= len(prompts) * 2  # decode steps were compared, not only the prefill
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.6, (sum(diffs) / len(diffs), max(diffs))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3-rope"])  # QKV bias + tied; q/k norm; untied lm_head
def test_tiny_models_bf16_kernel_path_agrees_with_torch_path(kernels, tiny_checkpoint, arch):
    """Shapes the default model does not have (hidden 64, head_dim 16/32, biases, an untied
    lm_head, a tied one read back as the embedding): the first step's log-probabilities of a
    ragged batch, bf16 with the kernels against bf16 on torch ops."""
    folder = str(tiny_checkpoint(arch))
    prompts = [{"prompt_token_ids": list(range(500, 500 + n))} for n in (1, 7, 16, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    fast = LLM(folder, dtype="bfloat16", num_kv_blocks=32, enable_prefix_caching=False)
    fast_out = [o.outputs[0] for o in fast.generate(prompts, params)]
    slow = LLM(folder, dtype="bfloat16", num_kv_blocks=32, enable_prefix_caching=False, cpu_kernels=False)
    assert slow.engine.runner.linear_impl != fast.engine.runner.linear_impl
    slow_out = [o.outputs[0] for o in slow.generate(prompts, params)]
    for a, b in zip(fast_out, slow_out):
        la, lb = a.logprobs[0], b.logprobs[0]
        shared = set(la) & set(lb)
        assert len(shared) >= 3, (la, lb)
        for tok in shared:
            assert abs(la[tok].logprob - lb[tok].logprob) < 0.1, (arch, tok, la[tok], lb[tok])


def test_store_kv_kernel_matches_reference_and_refuses_bad_slots(kernels):
    """Strided K/V views out of a fused projection, skipped (-1) slots, slots in any block."""
    from chatserve.kernels.reference import store_kv_cache

    torch.manual_seed(5)
    k_cache = torch.randn(5, 16, 3, 64).to(torch.bfloat16)
    v_cache = torch.randn(5, 16, 3, 64).to(torch.bfloat16)
    qkv = torch.randn(7, (9 + 3 + 3) * 64).to(torch.bfloat16)
    k = qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64)
    v = qkv[:, 12 * 64 :].view(7, 3, 64)
    slots = torch.tensor([0, 79, -1, 17, 40, -1, 33])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, ref_k, ref_v, slots)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    for bad in (80, -2):
        with pytest.raises(RuntimeError, match="outside the KV pool"):
            kernels.store_kv(k[:1], v[:1], k_cache, v_cache, torch.tensor([bad]))
