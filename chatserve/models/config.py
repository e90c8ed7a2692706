"""`ModelConfig`: the one normalised description of a model's architecture that every family reads.

It sits in models/ (below `chatserve/config.py`, which holds how the engine runs a model) so the
model code and the loaders read it without importing the engine's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatserve.models.registry import MODEL_TYPES, check_architecture


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts our one Llama-family forward pass needs.

    Architecture differences are flags here (QKV bias, q/k norm, tied
    embeddings, rope scaling), not copies of the model code.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        archs = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", "")
        arch = archs[0] if archs else MODEL_TYPES.get(model_type, model_type or "<unknown>")
        check_architecture(arch)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)) or arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hf_config=hf_config,
        )


__all__ = ["ModelConfig"]
