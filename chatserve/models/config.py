"""`ModelConfig`: the one normalised description of a model's architecture that every family reads.

It sits in models/ (below `chatserve/config.py`, which holds how the engine runs a model) so the
model code and the loaders read it without importing the engine's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatserve.models.registry import MODEL_TYPES, check_architecture


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): `num_experts` gated SiLU experts of
    `intermediate_size`, `top_k` of them per token, chosen by a router over softmax probabilities.

    Every family here routes the same way (softmax over all experts in float32, then the top k)
    and differs only in `renormalize`: whether the k weights are divided by their sum. Mixtral always
    does (which equals a softmax over the k chosen logits); Qwen3-MoE and OLMoE follow
    `norm_topk_prob` (OLMoE's checkpoints leave it off). Layers not in `sparse_layers` keep the
    dense MLP of the model's own `intermediate_size` (Qwen3-MoE's `mlp_only_layers` /
    `decoder_sparse_step`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, arch: str, hf_config: Any) -> MoEConfig | None:
        """The MoE settings of an HF config of a MoE architecture, or None for a dense one."""
        if arch not in MOE_ARCHITECTURES:
            return None
        num_layers = hf_config.num_hidden_layers
        if arch == "MixtralForCausalLM":
            num_experts, intermediate, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
            sparse = frozenset(range(num_layers))
        else:
            # NOTE: transformers 5 saves Qwen3-MoE's and OLMoE's num_experts as num_local_experts (an attribute_map
            # alias), which a config read back without the model's class (a GGUF metadata folder) knows only by that name
            num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
            intermediate = (getattr(hf_config, "moe_intermediate_size", None) if arch == "Qwen3MoeForCausalLM"
                            else None) or hf_config.intermediate_size
            renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
            sparse = frozenset(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        top_k = hf_config.num_experts_per_tok
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (the number of experts); got {top_k}")
        return cls(num_experts, top_k, intermediate, renormalize, sparse)


# Architectures whose MLP is (in some layers) a mixture of experts.
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"})
# q/k RMSNorm over each head (Qwen3, Qwen3-MoE) or over the whole q / k projection (OLMoE).
_QK_NORM_PER_HEAD = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
_QK_NORM_FULL = frozenset({"OlmoeForCausalLM"})


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
    qk_norm_full: bool = False  # OLMoE: that RMSNorm over the whole q (and k) projection instead of each head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (None: not clamped)
    moe: MoEConfig | None = None  # a mixture-of-experts MLP (in the layers it names); None: dense
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
            qk_norm=arch in _QK_NORM_PER_HEAD or arch in _QK_NORM_FULL,
            qk_norm_full=arch in _QK_NORM_FULL,
            clip_qkv=getattr(hf_config, "clip_qkv", None) if arch in _QK_NORM_FULL else None,
            moe=MoEConfig.from_hf(arch, hf_config),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hf_config=hf_config,
        )


__all__ = ["MOE_ARCHITECTURES", "ModelConfig", "MoEConfig"]
