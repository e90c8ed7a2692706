"""The one list of architectures we serve: HF `config.architectures[0]` -> our implementation.

Names map to "module:Class" strings and are imported only when a model is built, so reading the
list (config validation, `--help`) costs no torch import. A new architecture is one line here
(and, if its layer is not Llama's, one small module beside llama.py: gemma.py, phi3.py).
"""

from __future__ import annotations

import importlib

# One Llama-family implementation, configured by flags of ModelConfig (QKV bias, q/k norm, ...).
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "MistralForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "Qwen2ForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "Qwen3ForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    # the same attention and matmuls in Gemma's layer (sandwich norms, GeGLU, soft-caps, local/global rope)
    "Gemma2ForCausalLM": "chatserve.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "chatserve.models.gemma:GemmaForCausalLM",
    "Gemma3ForConditionalGeneration": "chatserve.models.gemma:GemmaForCausalLM",  # its language model
    # Llama's layer; fused qkv / gate_up checkpoint tensors split at load, long-rope, partial rotary
    "Phi3ForCausalLM": "chatserve.models.phi3:Phi3ForCausalLM",
    # mixture of experts: the same layers with a routed MLP (layers/moe.py) where ModelConfig.moe says
    "Qwen3MoeForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "MixtralForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "OlmoeForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
}

# HF `model_type` -> architecture, for configs that do not list `architectures` (some GGUF files).
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def check_architecture(arch: str) -> None:
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; chatserve supports: {', '.join(MODEL_REGISTRY)}")


def model_class_for(architecture: str) -> type:
    check_architecture(architecture)
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["MODEL_REGISTRY", "MODEL_TYPES", "check_architecture", "model_class_for"]
