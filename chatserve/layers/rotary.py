"""Rotary position embeddings, with the config's scaling computed by transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chatserve.kernels.cpu import CpuKernels
from chatserve.layers.fallbacks import Fallback


def rope_inv_freq(hf_config: Any, head_dim: int, *, layer_type: str | None = None,
                  max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) exactly as transformers computes them for this config.

    Default rope is computed here, divided by `rope_freq_factors` where a GGUF's rope_freqs tensor
    set them (models/gguf_families.py; an explicit rope scaling, e.g. from --hf-overrides, replaces
    them); every scaled variant (linear, dynamic, yarn, llama3, longrope) comes from transformers'
    ROPE_INIT_FUNCTIONS.
    layer_type: the per-layer-type settings of configs that have them (Gemma 3: "sliding_attention"
    layers rotate with rope_local_base_freq, "full_attention" ones with rope_theta and its scaling).
    max_positions: the engine's context length, for the types that transformers recomputes per forward
    from the current length: longrope (Phi-3) uses its long factors for every position where the
    engine serves contexts past original_max_position_embeddings, as llama.cpp decides from its
    context size; dynamic NTK scales its base once for max_positions (no scaling up to
    max_position_embeddings). transformers switches per forward, which re-rotates nothing already
    cached and would give one prefix other keys at another length; one table for the engine's life
    keeps a token's keys one rotation, so the prefix cache stays right.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type == "default":
        theta = params.get("rope_theta") if isinstance(params, dict) else None
        theta = theta or getattr(hf_config, "rope_theta", 10000.0)
        factor = (params.get("partial_rotary_factor") if isinstance(params, dict) else None) or 1.0
        dim = int(head_dim * factor)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        inv_freq = 1.0 / (theta**exponent)
        factors = getattr(hf_config, "rope_freq_factors", None)
        if factors is not None:  # a GGUF's rope_freqs (Llama 3.1+'s llama3 scaling): llama.cpp divides by them
            divisors = torch.tensor(factors, dtype=torch.float32)
            if divisors.shape != inv_freq.shape:
                raise ValueError(f"rope_freq_factors has {divisors.numel()} values; the rotary has {inv_freq.numel()} frequencies")
            inv_freq = inv_freq / divisors
        return inv_freq, 1.0
    # Scaled rope: transformers' functions (importing transformers, ~1 s on a 2-core host, only for these configs),
    # which call a transformers config's methods: a config saved for warm starts hands over transformers' own.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not hasattr(hf_config, "standardize_rope_params") and hasattr(hf_config, "to_transformers"):
        hf_config = hf_config.to_transformers()

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs: dict[str, Any] = {}
    if layer_type is not None:
        kwargs["layer_type"] = layer_type
    if rope_type in ("longrope", "dynamic") and max_positions is not None:
        kwargs["seq_len"] = max_positions  # (dynamic: transformers takes the larger of it and max_position_embeddings)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for every position up to `max_positions`."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            inv_freq, scaling = rope_inv_freq(hf_config, head_dim, layer_type=layer_type, max_positions=max_positions)
            pos = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] tables for the batch, computed once per forward and shared by all layers."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; the rotate-half convention of HF Llama checkpoints. Tables narrower
    than head_dim (partial rotary, Phi-4-mini) rotate the first dims and pass the rest through."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


class QKRotary:
    """Rotates q and k of a fused q|k|v projection output; which implementation is fixed at
    construction. With the C++ bf16 kernels, every shape runs them: without q/k norms the rotation
    happens in place inside the projection's output; with them (Qwen3, OLMoE, Gemma 3) the norms run
    as the norm kernels over rows and the normed q|k are rotated in one fresh buffer; a partial
    rotary (Phi-4-mini) rotates the first dims of each head as rows of their own (each head's cos/sin
    repeated: copies, exact). Without kernels: q/k RMSNorm then `apply_rotary` (torch)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, qk_norm: tuple[nn.Module, nn.Module] | None,
                 kernels: CpuKernels | None, rotary_dim: int = 0, qk_norm_full: bool = False,
                 clip_qkv: float | None = None) -> None:
        """qk_norm_full: the norms run over the whole q and k projections (OLMoE), not each head;
        clip_qkv: q, k (after their norms) and v clamped to +-clip_qkv (OLMoE), as transformers does."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm = qk_norm
        self.qk_norm_full, self.clip_qkv = qk_norm_full and qk_norm is not None, clip_qkv
        if clip_qkv is not None and not self.qk_norm_full:
            raise ValueError("clip_qkv is implemented for OLMoE's whole-projection q/k norms only")
        self.rotary_dim = rotary_dim or head_dim
        fits = self.rotary_dim % 2 == 0 and self.rotary_dim <= head_dim
        self._kernel = kernels.rope_inplace if kernels is not None and fits else None
        self._in_place = self._kernel is not None and qk_norm is None and self.rotary_dim == head_dim
        self._fallback = None if kernels is None or fits else f"rotary over {self.rotary_dim} of {head_dim} dims: torch ops"
        self._heads = [num_heads, num_kv_heads, num_kv_heads]  # q|k|v heads, as split_with_sizes takes them

    def kernel_fallbacks(self) -> list[Fallback]:
        return [] if self._fallback is None else [Fallback("rotary", self._fallback)]

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D], rotated k [T, KVH, D], v [T, KVH, D]."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self._in_place and qkv.dtype == torch.bfloat16:
            self._kernel(qkv, cos, sin, h + kvh, d)
            # NOTE: one view and one split into q, k, v (the same views as splitting twice): this runs
            # every layer of every step, and each torch view op costs microseconds of Python.
            q, k, v = qkv.view(qkv.shape[0], h + 2 * kvh, d).split_with_sizes(self._heads, dim=1)
            return q, k, v
        if self._kernel is not None and qkv.dtype == torch.bfloat16:
            return self._kernel_rotate(qkv, cos, sin)
        t = qkv.shape[0]
        if self.qk_norm_full:
            return self._full_norm(qkv, cos, sin)
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.view(t, h + kvh, d)
        if self.qk_norm is not None:
            q, k = qk.split([h, kvh], dim=1)
            qk = torch.cat((self.qk_norm[0](q), self.qk_norm[1](k)), dim=1)
        # q and k rotate together: one set of elementwise ops instead of two
        q, k = apply_rotary(qk, cos, sin).split([h, kvh], dim=1)
        return q, k, v.view(t, kvh, d)

    def _kernel_rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel path for q/k norms and partial rotary: q|k (normed, clamped) in one contiguous
        buffer [T, (H + KVH) * D], rotated in place there."""
        assert self._kernel is not None
        h, kvh, d, t = self.num_heads, self.num_kv_heads, self.head_dim, qkv.shape[0]
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        if self.qk_norm is None:
            qk = qkv[:, : (h + kvh) * d].contiguous()
        else:
            if self.qk_norm_full:  # OLMoE: one norm over all of q (all of k), then the clamp
                q, k = self.qk_norm[0](q), self.qk_norm[1](k)
                if self.clip_qkv is not None:
                    c = self.clip_qkv
                    q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
            else:  # per head: rows of head_dim
                q, k = self.qk_norm[0](q.reshape(t * h, d)), self.qk_norm[1](k.reshape(t * kvh, d))
            qk = torch.cat((q.reshape(t, h * d), k.reshape(t, kvh * d)), dim=1)
        rot = self.rotary_dim
        if rot == d:
            self._kernel(qk, cos, sin, h + kvh, d)
        else:  # each head's first `rot` dims as a row of its own, each with its position's cos/sin
            rows = qk.view(t * (h + kvh), d)[:, :rot]
            self._kernel(rows, cos.reshape(t, rot).repeat_interleave(h + kvh, dim=0),
                         sin.reshape(t, rot).repeat_interleave(h + kvh, dim=0), 1, rot)
        q, k = qk.view(t, h + kvh, d).split([h, kvh], dim=1)
        return q, k, v.reshape(t, kvh, d)

    def _full_norm(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """OLMoE: RMSNorm over all of q and all of k (one weight of H*D / KVH*D values), then the clamp."""
        assert self.qk_norm is not None
        h, kvh, d, t = self.num_heads, self.num_kv_heads, self.head_dim, qkv.shape[0]
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k = self.qk_norm[0](q.contiguous()), self.qk_norm[1](k.contiguous())
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        qk = torch.cat((q, k), dim=1).view(t, h + kvh, d)
        q, k = apply_rotary(qk, cos, sin).split([h, kvh], dim=1)
        return q, k, v.reshape(t, kvh, d)
