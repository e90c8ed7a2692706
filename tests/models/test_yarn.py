"""YaRN through --hf-overrides, on every path that reads the rotary cos/sin tables, against transformers
past original_max_position_embeddings; and dynamic NTK scaled once, for max_model_len.

One tiny random Llama (fixed seed, head_dim 32 so the C++ rope kernel applies, trained for 32
positions, rope_theta 50000 so an override that lost the model's theta would show), served with
`hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32}}`.
transformers' reference is built independently: its own config class with YaRN in `rope_parameters`
and the checkpoint's weights, so a wrong override (lost theta, dropped scaling) fails here too. A
12-token prompt and 48 greedy tokens run to position 60, far past the 32 trained positions.

- float32 (the torch reference path; the Triton backend under TRITON_INTERPRET=1): token for token.
- bfloat16 on each CPU kernel tier (the C++ rope kernel; on the tiered tiers the C++ layer stack
  too): bf16 rounding lets a near-tie go either way, so the check is transformers' float32 logits
  at our tokens: each token is transformers' top one or within NEAR_TIE of it. (The rope kernel is
  also checked alone, bit for bit against float32 math on YaRN's tables.) The layer stack gives the
  Python layers' bits exactly (tests/kernels/test_layer_stack.py), YaRN's tables included.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# NOTE: before chatserve.kernels.triton_attention is first imported (see test_triton_engine.py).
if "chatserve.kernels.triton_attention" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from chatserve import LLM, SamplingParams  # noqa: E402
from chatserve.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq  # noqa: E402
from chatserve.models.loader import save_tokenizer  # noqa: E402
from tests.conftest import KERNEL_TIERS  # noqa: E402

TRAINED = 32  # the tiny model's max_position_embeddings: YaRN's original_max_position_embeddings
FACTOR = 4
THETA = 50_000.0
MAX_MODEL_LEN = TRAINED * FACTOR
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": TRAINED}}
PROMPT_LEN, NEW_TOKENS = 12, 48
NEAR_TIE = 0.25  # logits: how far below transformers' top logit a bf16 run's token may be
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def _config_kwargs(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=TRAINED,
                rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                initializer_range=0.2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_tokenizer) -> Path:
    """The checkpoint, unscaled as trained: the scaling comes only from the override."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama-yarn")
    config = transformers.LlamaConfig(**_config_kwargs(smollm_tokenizer),
                                      rope_parameters={"rope_type": "default", "rope_theta": THETA})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(smollm_tokenizer, folder)
    return folder


def _hf_model(folder: Path, tokenizer, rope_parameters: dict):
    import transformers

    config = transformers.LlamaConfig(**_config_kwargs(tokenizer), rope_parameters=rope_parameters)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_yarn(tiny_llama, smollm_tokenizer):
    return _hf_model(tiny_llama, smollm_tokenizer, {"rope_type": "yarn", "factor": float(FACTOR), "rope_theta": THETA,
                                                    "original_max_position_embeddings": TRAINED})


@pytest.fixture(scope="module")
def hf_plain(tiny_llama, smollm_tokenizer):
    """The checkpoint as trained, unscaled: what the YaRN runs must not agree with."""
    return _hf_model(tiny_llama, smollm_tokenizer, {"rope_type": "default", "rope_theta": THETA})


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(100, 40_000, (PROMPT_LEN,), generator=gen).tolist()


@pytest.fixture(scope="module")
def hf_greedy(hf_yarn, prompt) -> list[int]:
    with torch.no_grad():
        out = hf_yarn.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _generate(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0]
    return list(out.token_ids), [float(next(iter(step.values())).logprob) for step in out.logprobs]


def _gaps(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """How far below transformers' top logit each of our tokens is, given the tokens before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.max(-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_override_scales_the_tables_and_keeps_the_models_theta(tiny_llama):
    """What every path below reads: the runner's tables are YaRN's (attention factor > 1), from the
    checkpoint's theta, and the engine's default context is the scaled one."""
    llm = LLM(str(tiny_llama), dtype="float32", hf_overrides=YARN, num_kv_blocks=16)
    hf = llm.engine.hf_config
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["rope_theta"] == THETA
    assert llm.engine.model_config.context_len == MAX_MODEL_LEN
    assert llm.engine.max_model_len == MAX_MODEL_LEN  # (the default: the scaled context, which the pool holds)
    inv_freq, scaling = rope_inv_freq(hf, 32)
    assert scaling > 1.1
    rotary = llm.engine.runner.model.rotary
    assert torch.equal(rotary.cos_cache[5, :16], torch.cos(5 * inv_freq) * scaling)


def test_torch_reference_path_is_token_exact(tiny_llama, prompt, hf_greedy, hf_plain):
    llm = LLM(str(tiny_llama), dtype="float32", cpu_kernels=False, hf_overrides=YARN, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=16)
    assert llm.engine.runner.ops.cpu is None and llm.engine.attention_backend == "torch"
    tokens, _ = _generate(llm, prompt)
    assert tokens == hf_greedy
    # the same checkpoint without the override answers otherwise: the scaling is what agrees
    assert _gaps(hf_plain, prompt, tokens).max() > 1.0


def test_triton_backend_is_token_exact(tiny_llama, prompt, hf_greedy):
    pytest.importorskip("triton")
    from chatserve.kernels import triton_attention as tk

    if not tk.is_interpreted():
        pytest.skip("Triton kernels were imported compiled (TRITON_INTERPRET unset at first import)")
    llm = LLM(str(tiny_llama), dtype="float32", attention_backend="triton", hf_overrides=YARN,
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=16)
    assert llm.engine.attention_backend == "triton"
    tokens, _ = _generate(llm, prompt)
    assert tokens == hf_greedy


def test_rope_kernel_rotates_by_yarns_tables(kernels, tiny_llama):
    """The C++ rope kernel of each tier over YaRN's tables (attention factor above 1) at positions past
    the trained 32: bit for bit float32 math rounded once to bf16, as the unscaled table is not."""
    from chatserve.models.loader import load_hf_config, resolve_model

    hf = load_hf_config(resolve_model(tiny_llama), YARN)
    positions = torch.arange(3, MAX_MODEL_LEN, 5)
    cos, sin = RotaryEmbedding(hf, 32, MAX_MODEL_LEN).cos_sin(positions, torch.bfloat16)
    assert cos.float().abs().max() > 1.05  # YaRN's attention factor is in the table
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(len(positions), 4 * 32, generator=gen) * 3).to(torch.bfloat16)  # q: 2 heads, k: 1, v: 1
    expected = apply_rotary(qkv[:, :96].float().view(-1, 3, 32), cos.float(), sin.float()).to(torch.bfloat16)
    out = qkv.clone()
    kernels.rope_inplace(out, cos, sin, 3, 32)
    assert torch.equal(out[:, :96].view(-1, 3, 32), expected)
    assert torch.equal(out[:, 96:], qkv[:, 96:])  # v untouched
    plain = load_hf_config(resolve_model(tiny_llama))
    cos0, sin0 = RotaryEmbedding(plain, 32, MAX_MODEL_LEN).cos_sin(positions, torch.bfloat16)
    assert not torch.equal(apply_rotary(qkv[:, :96].float().view(-1, 3, 32), cos0.float(), sin0.float()).to(torch.bfloat16),
                           expected)


@pytest.mark.parametrize("tier", KERNEL_TIERS or ["none"])
def test_cpu_kernel_tiers_and_layer_stack_follow_transformers(tier, tiny_llama, prompt, hf_yarn, hf_plain):
    """bf16 on each kernel tier: the C++ rope kernel in every layer, and (without the AMX matmul) the
    C++ layer stack for the decode steps; our greedy tokens are transformers' up to bf16 near-ties, and
    the stack gives the Python layers' bits."""
    if tier == "none":
        pytest.skip("no kernel tier on this CPU (needs AVX2 + FMA)")
    llm = LLM(str(tiny_llama), dtype="bfloat16", cpu_kernel_tier=tier, hf_overrides=YARN,
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=16)
    model = llm.engine.runner.model
    assert all(layer.self_attn.rotate._kernel is not None for layer in model.layers), "the C++ rope kernel is not used"
    stack = model.layer_stack
    assert (stack is not None) == (llm.engine.runner.ops.cpu.amx is None)
    tokens, logprobs = _generate(llm, prompt)
    gaps = _gaps(hf_yarn, prompt, tokens)
    assert gaps.max() <= NEAR_TIE, (tier, gaps.tolist())
    assert int((gaps == 0).sum()) >= 0.75 * NEW_TOKENS, (tier, gaps.tolist())
    assert _gaps(hf_plain, prompt, tokens).max() > 1.0  # (the unscaled model does not explain them)
    if stack is not None:
        model.layer_stack = None
        try:
            assert llm.engine.reset_prefix_cache()
            assert _generate(llm, prompt) == (tokens, logprobs)
        finally:
            model.layer_stack = stack


# ---- dynamic NTK: one table, for max_model_len ---------------------------------------------------------
DYNAMIC = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
DYNAMIC_LEN = 96  # the engine's max_model_len: 3x the trained positions


def test_dynamic_ntk_is_scaled_for_max_model_len(tiny_llama):
    """transformers rescales dynamic NTK's base at each forward from the sequence's length; the engine
    scales it once, for max_model_len (unscaled where that is within the trained positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from chatserve.models.loader import load_hf_config, resolve_model

    hf = load_hf_config(resolve_model(tiny_llama), DYNAMIC)
    unscaled, _ = rope_inv_freq(load_hf_config(resolve_model(tiny_llama)), 32)
    assert torch.equal(rope_inv_freq(hf, 32, max_positions=TRAINED)[0], unscaled)
    scaled, scaling = rope_inv_freq(hf, 32, max_positions=DYNAMIC_LEN)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, torch.device("cpu"), seq_len=DYNAMIC_LEN)
    assert torch.equal(scaled, expected.float()) and scaling == 1.0
    assert not torch.allclose(scaled, unscaled)  # (low frequencies stretched)


def test_dynamic_ntk_engine_keeps_one_table(tiny_llama, smollm_tokenizer):
    """The runner's table is transformers' for a max_model_len-long forward, and stays that: a prompt
    of max_model_len - 1 tokens gets transformers' next token at that length, and a prefix computed
    in a short request, reused from the prefix cache in a longer one, answers as a cold run does
    (a table that followed the length would have rotated the cached keys with another base)."""
    hf_model = _hf_model(tiny_llama, smollm_tokenizer, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA})
    common = dict(dtype="float32", cpu_kernels=False, hf_overrides=DYNAMIC, max_model_len=DYNAMIC_LEN, num_kv_blocks=16)
    llm = LLM(str(tiny_llama), **common)
    rotary = llm.engine.runner.model.rotary
    table = rotary.cos_cache.clone(), rotary.sin_cache.clone()
    with torch.no_grad():  # transformers' dynamic update at a DYNAMIC_LEN-token forward
        hf_cos, hf_sin = hf_model.model.rotary_emb(torch.zeros(1, DYNAMIC_LEN, 64), torch.arange(DYNAMIC_LEN)[None])
    assert torch.allclose(table[0], hf_cos[0], atol=1e-6) and torch.allclose(table[1], hf_sin[0], atol=1e-6)

    gen = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(100, 40_000, (DYNAMIC_LEN - 1,), generator=gen).tolist()
    out = llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    token = out[0].outputs[0].token_ids[0]
    with torch.no_grad():  # (position DYNAMIC_LEN - 2 of a DYNAMIC_LEN-token forward sees only the prompt)
        logits = hf_model(torch.tensor([long_prompt + [token]])).logits[0, -2]
    assert token == int(logits.argmax())
    assert out[0].outputs[0].logprobs[0][token].logprob == pytest.approx(float(logits.log_softmax(-1)[token]), abs=1e-3)

    short, longer = long_prompt[:40], long_prompt[:40] + long_prompt[50:80]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.engine.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": short}], params)
    cached = llm.generate([{"prompt_token_ids": longer}], params)[0]
    assert cached.num_cached_tokens >= 32
    cold = LLM(str(tiny_llama), **{**common, "enable_prefix_caching": False}).generate([{"prompt_token_ids": longer}], params)[0]
    assert cached.outputs[0].token_ids == cold.outputs[0].token_ids
    assert torch.equal(rotary.cos_cache, table[0]) and torch.equal(rotary.sin_cache, table[1])
