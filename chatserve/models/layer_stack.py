"""A Llama-family model's decoder layers as one C++ call a step (every CPU kernel tier, issue #30).

Why: a decode step of a small model spends as long between its kernels as in them. SmolLM2-135M
runs ~300 kernel calls a token (30 layers of norms, three projections, rotary, K/V store, attention,
silu); from Python each costs a few microseconds of binding, views and attribute lookups, ~4 ms a
step on a 2-core Zen 3, as much as all of the step's matmuls. csrc/tier_kernels.cpp's `LayerStack`
holds each layer's packed weights and calls the same kernels with the same arguments in the same
order, with the GIL released, so a step gives the Python path's bits exactly (tests/kernels/test_layer_stack.py)
and which path ran is invisible in the output.

Used only where every piece of a layer is one of the tier's compiled kernels: bf16 on a CPU kernel
tier, the paged attention kernel, the fused norm / rotary / silu kernels, and projections that are
GGUF / int8 blocks (tier_quant) or bf16 panels (tier_gemm) of that same tier. Anything else (q/k
norms, another attention backend, the AMX matmul, float32) keeps the Python layers. The model
calls it for steps without a between-layers abort check (decode-only steps: engine/llm_engine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from chatserve.attention.cpu_backend import CpuPagedAttentionBackend
from chatserve.kernels.tiers import TIERS, build_tier_module
from chatserve.layers.linear import Linear, PackedGemmLinearMethod
from chatserve.layers.quantized_linear import QuantizedLinearMethod

if TYPE_CHECKING:
    from chatserve.models.llama import LlamaFamilyForCausalLM


def _segments(layer: Linear, module: Any, tier: str) -> list[tuple[int, int, int, torch.Tensor]] | None:
    """(start, rows, qtype or BF16_PANELS, packed) of each row segment, or None where the layer's
    method is not one of this tier's compiled kernels."""
    method = layer.method
    if isinstance(method, QuantizedLinearMethod):
        if getattr(method.quant, "tier", None) != tier or method.quant.linear is not module.quant_linear:
            return None  # the torch reference, or another tier's kernels
        if any(s.qtype is None for s in layer.quant_segments) and (method.gemm is None or method.gemm.linear is not module.gemm):
            return None  # bf16 rows through F.linear
        return [(s.start, s.n, module.BF16_PANELS if s.qtype is None else s.qtype, s.packed) for s in layer.quant_segments]
    if isinstance(method, PackedGemmLinearMethod) and method.gemm.linear is module.gemm:
        return [(0, layer.out_features, module.BF16_PANELS, layer.packed_weight)]
    return None


def build_layer_stack(model: LlamaFamilyForCausalLM) -> Any | None:
    """The model's layers as a C++ `LayerStack`, or None where some part of a layer is not one of the
    tier's compiled kernels (the Python layers then run every step). Call after `process_weights`."""
    ops, cfg = model.ops, model.config
    if ops.cpu is None or cfg.qk_norm or cfg.moe is not None:
        return None
    if any(layer.self_attn.window for layer in model.layers) or cfg.attn_softcap or cfg.rotary_dim:
        return None  # the C++ runner calls plain attention over every key, full-width rotary
    if not isinstance(ops.attention, CpuPagedAttentionBackend):
        return None
    module = build_tier_module(TIERS[ops.cpu.tier], ops.cpu.build_dir)
    if module is None or ops.attention._attend is not module.paged_attention_bf16:
        return None
    stack = module.LayerStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim**-0.5)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        kernels_ok = (layer.input_layernorm._kernel is not None and layer.post_attention_layernorm._kernel_add is not None
                      and (layer is model.layers[0] or layer.input_layernorm._kernel_add is not None)
                      and attn.rotate._kernel is not None and mlp.act._kernel is not None)
        parts = [_segments(lin, module, ops.cpu.tier) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if not kernels_ok or any(p is None for p in parts) or attn.scale != cfg.head_dim**-0.5:
            return None
        bias = attn.qkv_proj.bias
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        cfg.hidden_size, cfg.intermediate_size, parts[0], None if bias is None else bias.detach(),
                        parts[1], parts[2], parts[3])
    return stack
