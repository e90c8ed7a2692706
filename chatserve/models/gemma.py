"""Gemma 2 and Gemma 3 (text): the Llama family's attention and matmuls, in Gemma's own layer.

What differs from Llama, and where it lives:
- norms are RMSNorm scaled by (1 + w), computed in float32 and cast back at the end (`GemmaRMSNorm`),
  four a layer: before and after attention, before and after the MLP (a "sandwich"); on the kernel
  tiers the fp32-weight RMSNorm kernel, as GeGLU and the final soft-cap run theirs (batch invariance);
- the token embedding is scaled by sqrt(hidden_size), rounded to the model's dtype as transformers does;
- the MLP is a GeGLU (gelu_pytorch_tanh; ModelConfig.hidden_act, layers/activation.py);
- attention: the softmax scale is query_pre_attn_scalar^-1/2, and per layer a sliding window
  (`sliding_attention` layers of config.layer_types) and, on Gemma 2, a tanh soft-cap of the scores
  (ModelConfig.layer_windows, attn_softcap: the attention backends take both per call);
- Gemma 2 soft-caps the final logits (ModelConfig.final_softcap, in `LlamaFamilyForCausalLM.logits`);
- Gemma 3: q/k RMSNorm (the (1 + w) kind) before the rotation, and two rotary tables: local layers
  with rope_local_base_freq, global ones with rope_theta and its scaling (`rope_parameters` per
  layer type). Gemma3ForConditionalGeneration checkpoints serve their language model only.

Everything else (merged q|k|v and gate|up matmuls, quantized GGUF weights, the paged KV cache, the
loader's checks that every weight is filled) is the Llama family's code, inherited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chatserve.forward_batch import ForwardBatch
from chatserve.kernels.cpu import CpuKernels
from chatserve.layers.fallbacks import Fallback
from chatserve.layers.ops import LayerOps
from chatserve.layers.quantized_linear import QuantizedTensor
from chatserve.layers.rotary import QKRotary, RotaryEmbedding
from chatserve.models.config import ModelConfig
from chatserve.models.llama import MLP, Attention, LlamaFamilyForCausalLM, RopeTables, direct

LOCAL_LAYER, GLOBAL_LAYER = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, cast to x's dtype at the end (transformers' Gemma2RMSNorm).

    The stored weight is the checkpoint's w (bf16 in a bf16 model, as transformers keeps it);
    `process_weights` (called by the model's `post_load`, so on a weight-cache hit too) computes
    1 + w once in float32, so bf16 models do not round 1 + w to bf16 (which would move every norm
    by up to 0.4%). With the C++ kernels, bf16 rows (of any rank: Gemma 3's q/k norms are per head)
    run the fp32-weight RMSNorm kernel: one fixed order per row, whatever the batch and the threads.
    """

    def __init__(self, dim: int, eps: float, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self._scale: torch.Tensor | None = None
        self._kernel = kernels.rms_norm_f32w if kernels is not None else None
        self._missing = kernels is not None and self._kernel is None

    def kernel_fallbacks(self) -> list[Fallback]:
        return [Fallback("Gemma RMSNorm", "these kernels have no rms_norm_f32w: torch ops")] if self._missing else []

    def process_weights(self) -> None:
        self._scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and self._scale is not None and x.dtype == torch.bfloat16:
            return self._kernel(x.reshape(-1, x.shape[-1]), self._scale, self.eps).view(x.shape)
        scale = self._scale if self._scale is not None else 1.0 + self.weight.float()
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype)


class GemmaAttention(Attention):
    """The Llama family's attention; Gemma 3's q/k norms are the (1 + w) kind."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: LayerOps, window: int = 0) -> None:
        super().__init__(cfg, layer_idx, ops, window)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops.cpu)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops.cpu)
            self.rotate = QKRotary(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=(self.q_norm, self.k_norm),
                                   kernels=ops.cpu, rotary_dim=cfg.rotary_dim)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: LayerOps, window: int = 0) -> None:
        super().__init__()
        types = getattr(cfg.hf_config, "layer_types", None)
        self.layer_type = types[layer_idx] if types else GLOBAL_LAYER
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        self.self_attn = GemmaAttention(cfg, layer_idx, ops, window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        self.mlp = MLP(cfg, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: RopeTables, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), batch, rope, k_cache, v_cache)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


def _has_local_rope(hf_config: Any) -> bool:
    """Whether the config sets rope per layer type (Gemma 3), not one rope for all layers (Gemma 2)."""
    params = getattr(hf_config, "rope_parameters", None)
    return isinstance(params, dict) and isinstance(params.get(LOCAL_LAYER), dict)


# Gemma3ForConditionalGeneration checkpoints: the language model's prefixes, and what is not text
_MULTIMODAL_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


class GemmaForCausalLM(LlamaFamilyForCausalLM):
    layer_stack_capable = False  # the C++ LayerStack runs Llama's layer, not Gemma's sandwich
    layer_cls = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: LayerOps) -> None:
        super().__init__(cfg, max_positions, ops)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        # the local layers' rotary table (Gemma 3), built by post_load next to the global one
        self.rotary_local: RotaryEmbedding | None = None
        self._gemma_layers: tuple[Callable[..., torch.Tensor], ...] = tuple(direct(layer) for layer in self.layers)
        self._local = tuple(layer.layer_type == LOCAL_LAYER for layer in self.layers)

    def _normalizer(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to `dtype`, as transformers multiplies the embedding by it."""
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(dtype))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        h = h * self._normalizer(h.dtype)
        rope_global = self.rotary.cos_sin(batch.positions, h.dtype)
        rope_local = rope_global if self.rotary_local is None else self.rotary_local.cos_sin(batch.positions, h.dtype)
        for layer_forward, local, (k_cache, v_cache) in zip(self._gemma_layers, self._local, self.layer_caches(kv_cache)):
            h = layer_forward(h, batch, rope_local if local else rope_global, k_cache, v_cache)
            if between_layers is not None:
                between_layers()
        h = h.index_select(0, batch.logits_indices)
        if h.shape[0] == 0:
            return h.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.logits(h)

    def rope_tables(self) -> dict[str, str | None]:
        """Gemma 3: the global layers' table (rope_theta and its scaling) and the local layers' one
        (rope_local_base_freq); Gemma 2: one table for every layer."""
        if _has_local_rope(self.config.hf_config):
            return {"rotary": GLOBAL_LAYER, "rotary_local": LOCAL_LAYER}
        return {"rotary": None}

    def post_load(self) -> None:
        """The rotary tables (`rope_tables`) and each norm's 1 + w, on every load path: a weight-cache
        hit maps the weights and runs neither load_weights nor process_weights."""
        super().post_load()
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.process_weights()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(_text_weights(weights))


def _text_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A multimodal Gemma 3 checkpoint's language-model tensors under the text model's names; the
    vision tower and projector are left out (this engine serves text)."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix in _MULTIMODAL_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        if name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        yield name, tensor
