"""LayerOps knows whether the whole forward path is batch- and thread-invariant (issue 51).

The flag (`LayerOps.batch_invariant`, `LLMEngine.batch_invariant`, `stats()["batch_invariant"]`,
`stats()["spec_decode"]["exact"]`) is False wherever anything runs outside the kernel tier in a way
whose bits depend on the batch or the threads, each such fallback is logged at start with its reason,
and speculative decoding's exactness warning reads the same flag (before, it checked only whether a
kernel tier existed: a bf16 model whose heads the paged kernel does not take ran the torch reference
attention and was called exact).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from chatserve.layers.ops import LayerOps, select_layer_ops
from tests.conftest import KERNEL_TIERS, require_kernels

pytestmark = pytest.mark.skipif(not KERNEL_TIERS, reason="no kernel tier on this CPU (needs AVX2 + FMA)")


def _ops(**kw) -> LayerOps:
    args = dict(dtype=torch.bfloat16, device=torch.device("cpu"), attention_backend="auto", cpu_kernels=True, amx=False,
                head_dim=32, num_heads=4, num_kv_heads=2, cpu_kernel_tier=KERNEL_TIERS[0])
    args.update(kw)
    return select_layer_ops(**args)


def test_the_kernel_tier_path_is_invariant_and_each_fallback_is_named():
    require_kernels(KERNEL_TIERS[0])
    ops = _ops()
    assert ops.batch_invariant and ops.fallbacks == []
    for kw, op, words in (
        (dict(head_dim=48), "attention", "head_dim 48 is not a multiple of 32"),
        (dict(head_dim=288), "attention", "head_dim 288"),
        (dict(dtype=torch.float32), "every layer", "dtype float32"),
        (dict(cpu_kernels=False), "every layer", "cpu_kernels=False"),
    ):
        ops = _ops(**kw)
        assert not ops.batch_invariant, kw
        (fallback,) = ops.fallbacks
        assert fallback.op == op and words in fallback.reason and not fallback.invariant, (kw, fallback)


def test_a_matmul_that_failed_its_self_check_is_a_named_fallback(monkeypatch):
    """The batch-invariant matmul missing (its self-check failed): the layers get oneDNN, and the flag says so."""
    import chatserve.layers.ops as ops_module

    kernels = require_kernels(KERNEL_TIERS[0])
    broken = dataclasses.replace(kernels, gemm=None, amx=None)
    monkeypatch.setattr(ops_module, "load_cpu_kernels", lambda **_: broken)
    ops = _ops()
    assert not ops.batch_invariant
    (fallback,) = ops.fallbacks
    assert fallback.op == "matmul" and "failed its self-check" in fallback.reason, fallback


def test_audit_collects_what_the_built_layers_report():
    from chatserve.layers.activation import GeluTanhAndMul, SiluAndMul
    from chatserve.models.gemma import GemmaRMSNorm

    kernels = require_kernels(KERNEL_TIERS[0])
    ops = _ops()
    whole = nn.ModuleList([SiluAndMul(72, kernels), GeluTanhAndMul(72, kernels), GemmaRMSNorm(40, 1e-6, kernels)])
    ops.audit(whole)
    assert ops.batch_invariant and ops.fallbacks == []  # every width on the kernels
    lacking = dataclasses.replace(kernels, gelu_tanh_mul=None, rms_norm_f32w=None)  # (a hand-made CpuKernels)
    ops.audit(nn.ModuleList([GeluTanhAndMul(72, lacking), GemmaRMSNorm(40, 1e-6, lacking)]))
    assert not ops.batch_invariant and {f.op for f in ops.fallbacks} == {"gelu*up", "Gemma RMSNorm"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_logs_its_fallbacks_and_speculation_is_not_called_exact(dtype, tiny_checkpoint, caplog):
    """The tiny Llama's heads are 16 wide: on a kernel tier its attention is the torch reference. The
    start-up log names that fallback, the engine reports a path that is not batch-invariant, and
    speculative decoding warns that it is exact only up to float rounding, in bf16 (a kernel tier is
    loaded: the old check called this exact) as in float32."""
    from chatserve import LLM

    require_kernels(KERNEL_TIERS[0])
    caplog.set_level(logging.INFO)
    llm = LLM(str(tiny_checkpoint("llama")), dtype=dtype, max_model_len=64, num_kv_blocks=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = llm.engine
    assert (engine.runner.ops.cpu is not None) == (dtype == "bfloat16")
    assert not engine.batch_invariant
    stats = engine.stats()
    assert stats["batch_invariant"] is False and stats["spec_decode"]["exact"] is False
    text = caplog.text
    reason = "head_dim 16 is not a multiple of 32" if dtype == "bfloat16" else "dtype float32"
    assert "fallback: " in text and reason in text, text[-3000:]
    warning = [r for r in caplog.records if "speculative decoding on" in r.getMessage()]
    assert warning and warning[0].levelno == logging.WARNING and reason in warning[0].getMessage()
    assert "forward pass NOT batch-invariant" in text


@pytest.mark.parametrize("invariant", [True, False])
def test_metrics_report_the_one_flag(invariant):
    """/metrics says whether the path is batch-invariant from the engine's one flag (stats()["batch_invariant"])."""
    from prometheus_client import generate_latest

    from chatserve.server.metrics import ServerMetrics

    text = generate_latest(ServerMetrics(lambda: {"batch_invariant": invariant}, "m").registry).decode()
    assert f'chatserve:batch_invariant{{model_name="m"}} {1.0 if invariant else 0.0}' in text
