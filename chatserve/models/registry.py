"""Model registry: HF `config.architectures[0]` -> our implementation."""

from __future__ import annotations

from chatserve.config import ModelConfig
from chatserve.models.llama import LlamaFamilyForCausalLM

# One implementation, configured by flags; the registry names what we accept.
MODEL_REGISTRY: dict[str, type[LlamaFamilyForCausalLM]] = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
}


def model_class_for(cfg: ModelConfig) -> type[LlamaFamilyForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; chatserve supports: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


__all__ = ["MODEL_REGISTRY", "LlamaFamilyForCausalLM", "model_class_for"]
