"""`ModelConfig`: the one normalised description of a model's architecture that every family reads.

It sits in models/ (below `chatserve/config.py`, which holds how the engine runs a model) so the
model code and the loaders read it without importing the engine's configuration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from chatserve.models.registry import MODEL_TYPES, check_architecture

logger = logging.getLogger(__name__)


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
    # Per-layer attention (Gemma 2/3, Phi-3, Mistral): each layer's sliding window (0: global;
    # empty: every layer global), the score soft-cap, and the softmax scale where it is not head_dim^-1/2.
    layer_windows: tuple[int, ...] = ()
    attn_softcap: float = 0.0  # Gemma 2: attn_logit_softcapping
    final_softcap: float = 0.0  # Gemma 2: final_logit_softcapping, on the logits
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5
    rotary_dim: int = 0  # rotated dims of each head (Phi-4-mini: partial_rotary_factor); 0: head_dim
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma's GeGLU)
    # the context the model's positions were trained (or rope-scaled) for; 0: max_position_embeddings
    scaled_context_len: int = 0
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def context_len(self) -> int:
        """The longest context the model is made for: max_position_embeddings, or where its rope is
        scaled, what the scaling stretches it to (`trained_context_len`). The engine's default
        max_model_len, and past it the engine warns."""
        return self.scaled_context_len or self.max_position_embeddings

    def window_of(self, layer: int, max_positions: int) -> int:
        """Layer `layer`'s sliding window, 0 where it has none or where the window covers every
        position the engine serves (a window of at least max_positions masks nothing)."""
        w = self.layer_windows[layer] if self.layer_windows else 0
        return w if 0 < w < max_positions else 0

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        archs = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", "")
        arch = archs[0] if archs else MODEL_TYPES.get(model_type, model_type or "<unknown>")
        check_architecture(arch)
        if arch in TEXT_OF_MULTIMODAL:  # serve the language model: its config is the nested text_config
            hf_config = hf_config.text_config
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
            qk_norm=arch in QK_NORM_ARCHS or arch in _QK_NORM_FULL,
            qk_norm_full=arch in _QK_NORM_FULL,
            clip_qkv=getattr(hf_config, "clip_qkv", None) if arch in _QK_NORM_FULL else None,
            moe=MoEConfig.from_hf(arch, hf_config),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            layer_windows=layer_windows(hf_config),
            attn_softcap=float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
            attn_scale=_query_scale(hf_config),
            rotary_dim=_rotary_dim(hf_config, head_dim),
            hidden_act=_hidden_act(hf_config),
            scaled_context_len=trained_context_len(hf_config),
            hf_config=hf_config,
        )


# multimodal checkpoints whose text model we serve (models/gemma.py maps their weight names)
TEXT_OF_MULTIMODAL = frozenset({"Gemma3ForConditionalGeneration"})
QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"})
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def layer_windows(hf_config: Any) -> tuple[int, ...]:
    """Each layer's sliding window from a transformers config, as transformers' masks read it:
    `layer_types` names the windowed layers where the config has it (Gemma 2/3, Qwen2 with
    use_sliding_window), else a `sliding_window` applies to every layer (Mistral, Phi-3)."""
    window = getattr(hf_config, "sliding_window", None) or 0
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return (window,) * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types: unsupported attention types {sorted(unknown)} (supported: sliding_attention, full_attention)")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def warn_past_context(cfg: ModelConfig, max_model_len: int) -> bool:
    """Log a warning where max_model_len runs past the positions the model is made for (its
    context_len); True where it does. Served anyway: the user asked for it. A rope scaling given
    with --hf-overrides (YaRN) moves context_len, so a scaled model within its reach is quiet."""
    if max_model_len <= cfg.context_len:
        return False
    if cfg.context_len != cfg.max_position_embeddings:
        how = "its rope scaling's reach"
    else:
        factor = 2
        while cfg.context_len * factor < max_model_len:
            factor *= 2
        how = ("max_position_embeddings; to stretch it, scale the rope, e.g. --hf-overrides "
               f'\'{{"rope_scaling": {{"rope_type": "yarn", "factor": {factor}, '
               f'"original_max_position_embeddings": {cfg.max_position_embeddings}}}}}\'')
    logger.warning("max_model_len=%d is past the %d positions %s was trained for (%s): output at positions "
                   "beyond them may degrade", max_model_len, cfg.context_len, cfg.architecture, how)
    return True


# rope types whose factor is already counted in max_position_embeddings (as vLLM reads them)
_FACTOR_IN_MAX_POSITIONS = frozenset({"default", "llama3", "longrope", "su"})


def trained_context_len(hf_config: Any) -> int:
    """The context a config's positions are made for, as vLLM derives it: max_position_embeddings,
    times the rope scaling's factor for linear / dynamic / YaRN scaling (YaRN from its
    original_max_position_embeddings), never less than max_position_embeddings. Llama 3 and long-rope
    configs state the scaled length in max_position_embeddings already, and per-layer-type rope
    (Gemma 3) is taken as stated there too."""
    max_positions = int(getattr(hf_config, "max_position_embeddings", None) or 4096)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return max_positions
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if rope_type in _FACTOR_IN_MAX_POSITIONS or not isinstance(factor, (int, float)) or factor <= 1:
        return max_positions
    base = max_positions
    if rope_type == "yarn":
        base = int(params.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", None) or max_positions)
    return max(max_positions, int(base * factor))


def _query_scale(hf_config: Any) -> float | None:
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    return None if scalar is None else float(scalar) ** -0.5


def _rotary_dim(hf_config: Any, head_dim: int) -> int:
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * factor)
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotated dims of {head_dim}; it must be even and in (0, head_dim]")
    return 0 if dim == head_dim else dim


def _hidden_act(hf_config: Any) -> str:
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
    if act == "gelu" and getattr(hf_config, "model_type", "").startswith("gemma"):
        act = "gelu_pytorch_tanh"  # Gemma checkpoints name the tanh GELU "gelu"; transformers runs it so
    if act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
    return act


__all__ = ["MOE_ARCHITECTURES", "ModelConfig", "MoEConfig", "trained_context_len", "warn_past_context"]
