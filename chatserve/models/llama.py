"""One Llama-family forward pass over the paged KV cache.

Llama/SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) differ only
by flags of `ModelConfig`. q/k/v and gate/up projections are merged into one
matmul each at load time: fewer, larger matmuls are faster on every device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu_gemv import CpuKernels

from chatserve.attention.dispatch import paged_attention
from chatserve.config import ModelConfig
from chatserve.worker.forward_batch import ForwardBatch
from chatserve.layers.linear import KERNEL_MAX_ROWS, AmxLinear, GemvLinear, PackedEmbedding, PackedLinear, move_weights_to_arena, pack_linears
from chatserve.layers.rotary import RotaryEmbedding, apply_rotary


FAST_NORM_MAX_ROWS = 64  # the C++ norms run rows serially; torch's parallel op wins on big batches


class RMSNorm(nn.Module):
    """Computed in float32 and cast back before the weight, as transformers does (bit-exact in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast = None  # a C++ bf16 RMSNorm, set by LlamaFamilyForCausalLM.optimize_for_cpu
        self.fast_add = None  # the C++ bf16 residual add + RMSNorm, likewise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            if self.fast is not None and x.dim() == 2 and x.shape[0] <= FAST_NORM_MAX_ROWS:
                return self.fast(x, self.weight, self.eps)
            # one fused op; differs from the formula below by at most one bf16 ulp
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add fused with the next norm.

        Same arithmetic either way (the sum is rounded to the stream's dtype before the norm); the
        C++ pass updates `residual` in place for small bf16 batches, saving one op and one pass.
        """
        if (self.fast_add is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.shape[0] <= FAST_NORM_MAX_ROWS and residual.is_contiguous()):
            return self.fast_add(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        self.rope_inplace = None  # C++ bf16 rotary (not with q/k norms), set by optimize_for_cpu
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = self.rope_inplace is not None and qkv.dtype == torch.bfloat16
        if rotated:
            # one C++ pass rotates q and k inside the fused projection's output (qk below views it)
            self.rope_inplace(qkv, batch.rope_cos, batch.rope_sin, self.num_heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not rotated:
            if self.qk_norm:
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
            # q and k rotate together: one set of elementwise ops instead of two
            qk = apply_rotary(qk, batch.rope_cos, batch.rope_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.silu_mul = None  # C++ bf16 silu(gate) * up, set by optimize_for_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None and x.dtype == torch.bfloat16:
            return self.down_proj(self.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the caller adds them
        (the next layer does it fused with its first norm). residual=None for the first layer."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        a = self.self_attn(x, batch, k_cache, v_cache)
        x, residual = self.post_attention_layernorm.add_and_norm(a, residual)
        return self.mlp(x), residual


# HF parameter name fragment -> (our merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions)
        self.logits_head: nn.Module | None = None  # a faster lm_head, set by optimize_for_cpu

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Returns logits (float32) only at `batch.logits_indices`.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        """
        h = self.embed_tokens(batch.input_ids)
        batch.rope_cos, batch.rope_sin = self.rotary.cos_sin(batch.positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, batch, kv_cache[i, 0], kv_cache[i, 1])
        h = (h if residual is None else residual + h).index_select(0, batch.logits_indices)
        if h.shape[0] == 0:  # a step of prefill chunks only: the KV cache is filled, nothing to sample
            return h.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        h = self.norm(h)
        if self.logits_head is not None:
            return self.logits_head(h).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def optimize_for_cpu(self, kernels: CpuKernels | None) -> str:
        """Pick the fastest bf16 matmuls this CPU offers; returns which, for the log.

        Every matmul keeps one copy of its weights. With AMX, each is packed into the tile
        layout (a tied embedding then reads its rows from the lm_head's packed copy); without
        AMX but with the AVX512-BF16 kernels, plain weights (our kernel up to KERNEL_MAX_ROWS
        rows, oneDNN in power-of-two pieces above); with neither, oneDNN-packed weights. With
        the kernels, all the weights live in one huge-page arena, and RMSNorm, rotary and silu*up
        run in C++.
        """
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if kernels is None:
            self.logits_head = PackedLinear(head_weight, None)
            pack_linears(self.layers)
            self.lm_head = None  # the packed copy replaces it (a tied one stays as the embedding)
            return "oneDNN prepacked"
        self._use_fused_kernels(kernels)
        amx, gemv = kernels.amx, kernels.gemv
        if amx is not None:
            self.logits_head = move_weights_to_arena(
                self.layers, head_weight, kernels, amx.packed_shape,
                lambda w, b, view: AmxLinear(w, b, amx, out=view))
            impl = "AMX tiles over packed weights"
        else:
            self.logits_head = move_weights_to_arena(
                self.layers, head_weight, kernels, lambda n, k: (n, k),
                lambda w, b, view: GemvLinear(w, b, gemv, out=view))
            impl = f"avx512-bf16 kernel (<= {KERNEL_MAX_ROWS} rows) + oneDNN"
        if self.lm_head is None:  # tied: the lm_head's copy serves the embedding too
            if amx is not None:
                self.embed_tokens = PackedEmbedding(self.logits_head)
            else:
                self.embed_tokens.weight = nn.Parameter(self.logits_head.weight, requires_grad=False)
        self.lm_head = None
        del head_weight
        kernels.release_free_memory()  # the last plain weights (nothing refers to them now)
        return f"{impl} (one huge-page arena); C++ RMSNorm, rotary, silu*up"

    def _use_fused_kernels(self, kernels: CpuKernels) -> None:
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fast = kernels.rms_norm
                if module.weight.shape[0] % 16 == 0:
                    module.fast_add = kernels.add_rms_norm
            elif isinstance(module, MLP) and module.intermediate_size % 16 == 0:
                module.silu_mul = kernels.silu_mul
            elif isinstance(module, Attention) and not module.qk_norm and module.head_dim % 32 == 0:
                module.rope_inplace = kernels.rope_inplace

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, merging q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        cfg = self.config
        qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy
            shard = None
            for frag, (merged, idx) in _STACKED.items():
                if f".{frag}." in name:
                    name = name.replace(frag, merged)
                    shard = idx
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint for {cfg.architecture}")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    _copy(param, tensor, hf_name)
                    filled.add(name)
                else:
                    sizes = qkv_sizes if "qkv_proj" in name else [cfg.intermediate_size] * 2
                    start = sum(sizes[:shard])
                    _copy(param.narrow(0, start, sizes[shard]), tensor, hf_name)
                    filled.add(f"{name}#{shard}")
        missing = []
        for name in params:
            if "qkv_proj" in name or "gate_up_proj" in name:
                n = 3 if "qkv_proj" in name else 2
                missing += [f"{name}#{i}" for i in range(n) if f"{name}#{i}" not in filled]
            elif name not in filled:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
