"""Typed configuration objects: what the model looks like and how the engine runs it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        arch = archs[0] if archs else _arch_from_model_type(getattr(hf_config, "model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; chatserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(model_type, model_type or "<unknown>")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16: measured about twice as fast as float32 on AVX-512 CPUs and on GPUs.

    CPUs without native bf16 still run it (slower); pass dtype="float32" there
    or for bit-exactness tests.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}") from None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size wins over the memory budget
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # While any sequence is decoding, each prefill advances by at most this many tokens a step,
    # so a long prompt never stalls running streams (on the 2-core dev box a 96-token chunk
    # costs about one decode step); prompts shorter than this are unaffected.
    max_prefill_tokens_while_decoding: int = 96


@dataclass(frozen=True)
class EngineArgs:
    """Every option of `LLM` and the server's engine, in one place."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 96
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    num_threads: int | None = None
    # Kernel switches (what used to be environment variables): the compiled C++ CPU kernels where
    # the CPU has AVX512-BF16, and within them Intel AMX tiles where the CPU has those.
    cpu_kernels: bool = True
    amx: bool = True
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_prefill_tokens_while_decoding < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {self.max_prefill_tokens_while_decoding}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
