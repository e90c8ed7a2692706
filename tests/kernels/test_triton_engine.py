"""The engine with attention_backend="triton" (Triton's CPU interpreter) against "torch", token for token."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

# NOTE: before chatserve.kernels.triton_attention is first imported (see test_triton_kernels.py).
if "chatserve.kernels.triton_attention" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from chatserve import LLM, SamplingParams  # noqa: E402
from chatserve.attention import select_attention_backend  # noqa: E402
from chatserve.kernels import triton_attention as tk  # noqa: E402

if not tk.is_interpreted():
    pytest.skip("Triton kernels were imported compiled (TRITON_INTERPRET unset at first import)", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module", params=[16, 32], ids=lambda bs: f"bs{bs}")
def engines(request, tiny_checkpoint):
    folder = str(tiny_checkpoint("llama"))
    common = dict(dtype="float32", num_kv_blocks=64, block_size=request.param, max_num_batched_tokens=256)
    torch_llm = LLM(folder, attention_backend="torch", **common)
    triton_llm = LLM(folder, attention_backend="triton", **common)
    assert torch_llm.engine.attention_backend == "torch"
    assert triton_llm.engine.attention_backend == "triton"
    return torch_llm, triton_llm


def run_both(engines, prompts, params=GREEDY):
    results = []
    for llm in engines:
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
        results.append(([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]))
    return results


def test_cold_prompt_and_prefix_cache_hit_give_the_same_tokens(engines):
    rng = random.Random(11)
    for llm in engines:
        assert llm.engine.reset_prefix_cache()
    bs = engines[0].engine.block_manager.block_size
    first = {"prompt_token_ids": random_ids(rng, 3 * bs + 5)}
    (torch_tokens, torch_cached), (triton_tokens, triton_cached) = run_both(engines, [first])
    assert torch_cached == triton_cached == [0]
    assert triton_tokens == torch_tokens

    # the same prompt plus a new suffix: the prompt's full blocks come from the prefix cache
    hit = {"prompt_token_ids": first["prompt_token_ids"] + random_ids(rng, 7)}
    (torch_tokens, torch_cached), (triton_tokens, triton_cached) = run_both(engines, [hit])
    assert triton_cached == torch_cached and triton_cached[0] >= 3 * bs
    assert triton_tokens == torch_tokens


def test_ragged_batch_gives_the_same_tokens(engines):
    """Several prompts of different lengths in one generate call: decodes of different context
    lengths and prefill chunks share forward passes; some prompts share a cached prefix."""
    rng = random.Random(5)
    bs = engines[0].engine.block_manager.block_size
    shared = random_ids(rng, 2 * bs)
    prompts = [{"prompt_token_ids": random_ids(rng, n)} for n in (1, 9, bs, 2 * bs + 3)]
    prompts += [{"prompt_token_ids": shared + random_ids(rng, n)} for n in (1, 4, bs + 2)]
    (torch_tokens, _), (triton_tokens, _) = run_both(engines, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert triton_tokens == torch_tokens


def test_backend_selection():
    """One selector, from the EngineArgs string: on the CPU "auto" and "torch" are the torch path
    (the C++ kernels join it when loaded), "triton" the interpreted kernels; anything else is refused."""
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu).name == "torch"
    assert select_attention_backend("torch", cpu).name == "torch"
    assert select_attention_backend("triton", cpu).name == "triton"
    with pytest.raises(ValueError, match="auto, torch or triton"):
        select_attention_backend("cuda", cpu)
