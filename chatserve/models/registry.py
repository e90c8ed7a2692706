"""The one list of architectures we serve: HF `config.architectures[0]` -> our implementation.

Names map to "module:Class" strings and are imported only when a model is built, so reading the
list (config validation, `--help`) costs no torch import. A new architecture is one line here
(and, if it is not a Llama-family variant, one module beside llama.py).
"""

from __future__ import annotations

import importlib

# One Llama-family implementation, configured by flags of ModelConfig (QKV bias, q/k norm, ...).
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "MistralForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "Qwen2ForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
    "Qwen3ForCausalLM": "chatserve.models.llama:LlamaFamilyForCausalLM",
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
