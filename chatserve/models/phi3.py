"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layer, with the checkpoint's fused projections.

Phi-3 checkpoints (and llama.cpp's phi3 GGUF files) store q|k|v as one `qkv_proj` and gate|up as
one `gate_up_proj`, in the order our merged matmuls use; they are split into their parts at load
and merged again by the Llama family's loader, so its shape checks and quantized-segment handling
apply unchanged. The rest is configuration the shared code reads: long-rope (su / longrope) scaling
with short and long factors (layers/rotary.py: the factors fixed for the engine's context length,
as llama.cpp does), partial rotary (Phi-4-mini rotates 3/4 of each head) and a sliding window over
every layer (Phi-3-mini's 2,047; ModelConfig.layer_windows).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from chatserve.layers.quantized_linear import QuantizedTensor
from chatserve.models.config import ModelConfig
from chatserve.models.llama import LlamaFamilyForCausalLM


def _rows(tensor: Any, start: int, n: int) -> Any:
    """Rows [start, start + n) of a weight: a view of a plain tensor, or those rows' blocks."""
    if isinstance(tensor, QuantizedTensor):
        return QuantizedTensor(tensor.raw[start : start + n], tensor.qtype, n, tensor.k)
    return tensor.narrow(0, start, n)


def split_fused(weights: Iterable[tuple[str, Any]], cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj, every other tensor as it comes."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            parts = (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
            fused = "qkv_proj"
        elif ".mlp.gate_up_proj." in name:
            parts = (("gate_proj", 0, inter), ("up_proj", inter, inter))
            fused = "gate_up_proj"
        else:
            yield name, tensor
            continue
        rows = parts[-1][1] + parts[-1][2]
        if tensor.shape[0] != rows:
            raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, expected {rows} (the {fused} parts)")
        for part, start, n in parts:
            yield name.replace(fused, part), _rows(tensor, start, n)


class Phi3ForCausalLM(LlamaFamilyForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(split_fused(weights, self.config))
