"""The C++ decoder-layer runner (models/layer_stack.py, csrc/tier_kernels.cpp; issue #30) gives the
Python layers' bits exactly, on every kernel tier this CPU runs, for the default model's GGUF blocks
and for bf16 panels; and it is used only where every part of a layer is one of the tier's kernels.

Why bits and not closeness: which path a step takes depends on the step (decode-only steps take the
runner, prefill chunks the Python layers), so any difference would make output depend on scheduling,
which the determinism suite forbids."""

from __future__ import annotations

import pytest
import torch

from chatserve import LLM, SamplingParams
from tests.conftest import KERNEL_TIERS

PROMPTS = [
    [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
]


def _run(llm: LLM, use_stack: bool) -> list[tuple[list[int], list[float]]]:
    model = llm.engine.runner.model
    stack = model.layer_stack
    if not use_stack:
        model.layer_stack = None
    try:
        # a batch of three (decode steps of 1-3 rows, two sequences sharing a cached prefix), greedy
        # with the chosen token's logprob: equal logprobs mean equal logits, not only equal argmaxes
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
        outs = llm.chat(PROMPTS, params)
    finally:
        model.layer_stack = stack
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [float(next(iter(step.values())).logprob) for step in c.logprobs]
        result.append((list(c.token_ids), lps))
    return result


@pytest.fixture(scope="module", params=KERNEL_TIERS or ["none"])
def tier(request) -> str:
    if request.param == "none":
        pytest.skip("no kernel tier on this CPU (needs AVX2 + FMA)")
    return request.param


@pytest.mark.parametrize("quantization", ["auto", "none"], ids=["gguf-blocks", "bf16-panels"])
def test_runner_gives_the_python_layers_bits(tier, quantization):
    llm = LLM(cpu_kernel_tier=tier, quantization=quantization, max_model_len=1024, amx=False)
    model = llm.engine.runner.model
    assert model.layer_stack is not None and len(model.layer_stack) == model.config.num_layers
    with_stack = _run(llm, True)
    python = _run(llm, False)
    assert with_stack == python
    assert all(len(tokens) == 24 for tokens, _ in with_stack)


def test_runner_forward_matches_the_layers_on_a_decode_batch(tier):
    """One decode-only step through `forward`, the runner against the Python layers: the same logits."""
    llm = LLM(cpu_kernel_tier=tier, max_model_len=1024, amx=False)
    engine, model = llm.engine, llm.engine.runner.model
    captured: list[torch.Tensor] = []
    original = type(model).forward

    def forward(self, batch, kv_cache, between_layers=None):
        logits = original(self, batch, kv_cache, between_layers)
        if between_layers is None and batch.num_extends == 0:
            stack, self.layer_stack = self.layer_stack, None
            try:  # the same step again through the Python layers (K/V rewritten with the same bits)
                captured.append((logits, original(self, batch, kv_cache, None)))
            finally:
                self.layer_stack = stack
        return logits

    type(model).forward = forward
    try:
        llm.chat(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        type(model).forward = original
    assert captured and engine.num_steps > 0
    for stacked, python in captured:
        assert torch.equal(stacked, python)


def test_not_used_where_a_layer_is_not_all_the_tiers_kernels():
    llm = LLM(dtype="float32", max_model_len=512)
    assert llm.engine.runner.model.layer_stack is None  # torch ops
    if "avx512_bf16" in KERNEL_TIERS:
        bf16 = LLM(cpu_kernel_tier="avx512_bf16", quantization="none", max_model_len=512)
        # the AMX matmul (where the CPU has tiles) is not one the runner calls; the tier's own is
        assert (bf16.engine.runner.model.layer_stack is None) == (bf16.engine.runner.ops.cpu.amx is not None)
