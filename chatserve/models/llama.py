"""One Llama-family forward pass over the paged KV cache.

Llama/SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) differ only
by flags of `ModelConfig`; so do the mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE),
whose layers' MLP is a `FusedMoE` (layers/moe.py) where `ModelConfig.moe` says. q/k/v and gate/up projections are merged into one
matmul each at load time: fewer, larger matmuls are faster on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from chatserve.attention.base import AttentionBackend
from chatserve.forward_batch import ForwardBatch
from chatserve.layers.activation import GeluTanhAndMul, SiluAndMul
from chatserve.layers.fallbacks import Fallback
from chatserve.layers.linear import Linear
from chatserve.layers.moe import FusedMoE
from chatserve.layers.norm import RMSNorm
from chatserve.layers.ops import LayerOps
from chatserve.layers.quantized_linear import QuantizedTensor
from chatserve.layers.rotary import QKRotary, RotaryEmbedding
from chatserve.models.config import ModelConfig
from chatserve.models.layer_stack import build_layer_stack

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin for the batch's positions, [T, 1, head_dim]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: LayerOps, window: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.scale
        self.window = window  # this layer's sliding window (0: global), see ModelConfig.window_of
        # what the backend gets past the scale: nothing for plain attention (the hot path's call as before)
        self._attn_extra: tuple[int, float] | tuple[()] = (window, cfg.attn_softcap) if window or cfg.attn_softcap else ()
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, ops.linear)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, ops.linear)
        qk_norm = None
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim of q and k, before the rotation (OLMoE: over all of q, k)
            self.q_norm = RMSNorm(self.q_size if cfg.qk_norm_full else cfg.head_dim, cfg.rms_norm_eps, ops.cpu)
            self.k_norm = RMSNorm(self.kv_size if cfg.qk_norm_full else cfg.head_dim, cfg.rms_norm_eps, ops.cpu)
            qk_norm = (self.q_norm, self.k_norm)
        self.rotate = QKRotary(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=qk_norm, kernels=ops.cpu,
                               rotary_dim=cfg.rotary_dim, qk_norm_full=cfg.qk_norm_full, clip_qkv=cfg.clip_qkv)
        self.attn: AttentionBackend = ops.attention
        self._qkv_proj, self._o_proj = direct(self.qkv_proj), direct(self.o_proj)

    def kernel_fallbacks(self) -> list[Fallback]:
        return self.rotate.kernel_fallbacks()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeTables, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotate(self._qkv_proj(x), *rope)
        out = self.attn.forward(q, k, v, k_cache, v_cache, batch.slot_mapping, batch.attn, self.scale, *self._attn_extra)
        return self._o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, ops.linear)
        self.act = (SiluAndMul(cfg.intermediate_size, ops.cpu) if cfg.hidden_act == "silu"
                    else GeluTanhAndMul(cfg.intermediate_size, ops.cpu))
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, ops.linear)
        self._gate_up_proj, self._act, self._down_proj = direct(self.gate_up_proj), direct(self.act), direct(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down_proj(self._act(self._gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: LayerOps, window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        self.self_attn = Attention(cfg, layer_idx, ops, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        moe = cfg.moe
        if moe is not None and layer_idx in moe.sparse_layers:  # a mixture-of-experts layer (layers/moe.py)
            self.mlp: nn.Module = FusedMoE(cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                           moe.renormalize, ops.linear, ops.cpu)
        else:
            self.mlp = MLP(cfg, ops)
        self._input_norm, self._input_add_norm = direct(self.input_layernorm), self.input_layernorm.add_and_norm
        self._self_attn, self._post_add_norm = direct(self.self_attn), self.post_attention_layernorm.add_and_norm
        self._mlp = direct(self.mlp)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTables,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the caller adds them
        (the next layer does it fused with its first norm). residual=None for the first layer."""
        if residual is None:
            residual, x = h, self._input_norm(h)
        else:
            x, residual = self._input_add_norm(h, residual)
        a = self._self_attn(x, batch, rope, k_cache, v_cache)
        x, residual = self._post_add_norm(a, residual)
        return self._mlp(x), residual


def check_attention_features(cfg: ModelConfig, max_positions: int, ops: LayerOps) -> tuple[int, ...]:
    """Each layer's effective sliding window (0: global); refuses, at build time, an attention
    backend that cannot run this model's windows or soft-capping (rather than at its first step)."""
    windows = tuple(cfg.window_of(i, max_positions) for i in range(cfg.num_layers))
    if (any(windows) or cfg.attn_softcap) and not getattr(ops.attention, "supports_sliding_window", True):
        raise ValueError(f"attention backend {ops.attention.name!r} has no sliding-window or soft-capped attention, "
                         f"which {cfg.architecture} needs; use attention_backend='torch' (or 'auto' on the CPU)")
    return windows


def direct(module: nn.Module) -> Callable[..., Any]:
    """`module`'s own forward, bound once, for a parent to call on the per-layer hot path.

    Why: `module(x)` goes through nn.Module.__call__ (hook dispatch) and reading a child attribute
    through nn.Module.__getattr__; together ~2 us, paid ~8 times a layer, 30 layers a token: about
    as long as a decode step's norm, rotary and attention kernels. Nobody registers hooks on the
    engine's model, so nothing is skipped. Children are never replaced after construction (loading
    and `to_empty` change their tensors, not the modules), so the bound method stays theirs.
    """
    return module.forward


# HF parameter name fragment -> (our merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaFamilyForCausalLM(nn.Module):
    """Built with its `LayerOps` (what every layer runs, chosen once by the model runner);
    `load_weights` fills the HF-named tensors in, `process_weights` then lets each layer's method
    repack them, and `post_load` builds what is not a weight (the rotary tables, values derived from
    the weights). The weight cache (models/weight_cache.py) skips the first two on a hit, never the
    third: the loader calls `post_load` last on every path."""

    # every layer through csrc/tier_kernels.cpp's LayerStack where its kernels allow; a family whose
    # layers differ from Llama's (models/gemma.py) sets False
    layer_stack_capable = True
    layer_cls: type[nn.Module] = DecoderLayer  # a family with other layers (models/gemma.py) names its own

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: LayerOps) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        # NOTE: given its (uninitialised) weight, nn.Embedding skips its random init: load_weights
        # overwrites it, and on the meta device torch runs the init through torch._refs, which imports
        # torch._dynamo, triton and sympy (~100 MiB resident that a CPU engine never uses).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.windows = check_attention_features(cfg, max_positions, ops)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, ops, self.windows[i]) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.cpu)
        # A tied lm_head gets the embedding's weight at load (`load_weights`), then its method's layout.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, ops.linear)
        self.max_positions = max_positions  # the rows of the rotary tables (and long-rope's choice of factors)
        # (rebuilt on the weights' device by post_load, whichever way the weights arrive)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions)
        self._layer_forwards = tuple(direct(layer) for layer in self.layers)
        self._layer_caches: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # every layer in one C++ call for steps without an abort check (models/layer_stack.py); set by
        # process_weights where the layers run only tiered kernels, else None (the Python layers)
        self.layer_stack: Any | None = None

    def layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views of `kv_cache`, made once per cache tensor (the runner keeps one
        for its life): two indexing ops a layer per step were ~6 us a layer, 30 layers a token."""
        cached = self._layer_caches
        if cached is None or cached[0] is not kv_cache:
            cached = (kv_cache, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(len(self._layer_forwards))])
            self._layer_caches = cached
        return cached[1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Returns logits (float32) only at `batch.logits_indices`.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        between_layers: called after each layer (the engine's abort check; it may raise to stop).
        """
        h = self.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, h.dtype)
        residual = None
        stack = self.layer_stack
        if stack is not None and between_layers is None:  # the same kernels, in one call (the same bits)
            m = batch.attn
            h, residual = stack.forward(h, rope[0], rope[1], kv_cache, batch.slot_mapping, m.block_tables,
                                        m.query_start, m.start_pos, m.seq_order, m.group_start)
        else:
            for layer_forward, (k_cache, v_cache) in zip(self._layer_forwards, self.layer_caches(kv_cache)):
                h, residual = layer_forward(h, residual, batch, rope, k_cache, v_cache)
                if between_layers is not None:
                    between_layers()
        h = (h if residual is None else residual + h).index_select(0, batch.logits_indices)
        if h.shape[0] == 0:  # a step of prefill chunks only: the KV cache is filled, nothing to sample
            return h.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the last hidden states (final norm, lm_head, the config's soft-cap: the
        C++ kernel in place where the kernels are loaded, one fixed computation per element)."""
        out = self.lm_head(self.norm(h))
        logits = out.float()
        cap = self.config.final_softcap
        if not cap:
            return logits
        softcap = self.ops.cpu.softcap_ if self.ops.cpu is not None else None
        if softcap is not None and logits is not out and logits.is_contiguous():  # (a fresh fp32 copy: ours to change)
            softcap(logits, cap)
            return logits
        return torch.tanh(logits / cap) * cap

    def kernel_fallbacks(self) -> list[Fallback]:
        """What this model's own code runs outside the kernels (the layers report theirs)."""
        if self.config.final_softcap and self.ops.cpu is not None and self.ops.cpu.softcap_ is None:
            return [Fallback("final soft-cap", "these kernels have no softcap_: torch's tanh")]
        return []

    @torch.inference_mode()
    def process_weights(self) -> None:
        """After `load_weights`: every Linear hands its weight to its method (packed, moved into
        the huge-page arena, or left as is), layer by layer, giving the plain copies back to the OS
        as it goes, so the resident set peaks at one copy of the weights plus a layer. A tied
        embedding then reads the lm_head's copy where the method allows (one copy in all)."""
        plan = getattr(self.ops.linear, "plan", None)  # a method that places all layers at once (quantized)
        if plan is not None:
            plan([m for m in self.modules() if isinstance(m, Linear)])
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.process_weights()
            self.ops.release_memory()
        self.lm_head.process_weights()
        self.finish_processing()

    def rope_tables(self) -> dict[str, str | None]:
        """The rotary tables this model rotates with: attribute name -> the layer type whose rope
        settings build it (None: the config's one rope for every layer). Read by `post_load` and by
        `rope_identity`; a family with per-layer-type rope (Gemma 3) names more than one."""
        return {"rotary": None}

    def post_load(self) -> None:
        """Build the model's state that is not a weight, from its config and its loaded weights: each
        rotary table of `rope_tables` (on the weights' device) and whatever a family derives from its
        weights without keeping it in a parameter or a Linear's processed state (Gemma's (1 + w) norm
        scales). The loader calls it last on every path, weights filled from the checkpoint or mapped
        from the weight cache (`weight_cache.load_weights_cached`), so nothing a model computes at load
        may live only in `load_weights` or `process_weights`: a cache hit runs neither. Idempotent; a
        family that builds more overrides it and calls this one first."""
        device = self.norm.weight.device
        hf, head_dim = self.config.hf_config, self.config.head_dim
        for name, layer_type in self.rope_tables().items():
            setattr(self, name, RotaryEmbedding(hf, head_dim, self.max_positions, layer_type=layer_type).to(device))

    def rope_identity(self) -> dict[str, Any]:
        """What each rotary table is built from, resolved (`resolved_rope`): a KV block's bytes
        depend on it, so the KV tiers' fingerprint holds it (engine/kv_tiering.py)."""
        cfg = self.config
        return {name: resolved_rope(cfg.hf_config, cfg.head_dim, self.max_positions, layer_type)
                for name, layer_type in sorted(self.rope_tables().items())}

    @torch.inference_mode()
    def finish_processing(self) -> None:
        """What `process_weights` does once every Linear holds its final layout; the weight cache
        (models/weight_cache.py) calls it too, after putting those layouts back from its file. A model
        class without this method is loaded without the cache."""
        if self.config.tie_word_embeddings:
            self.embed_tokens = self.lm_head.method.tied_embedding(self.lm_head, self.embed_tokens)
        self.ops.release_memory()
        self.layer_stack = build_layer_stack(self) if self.layer_stack_capable else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy HF-named tensors in, merging q/k/v and gate/up; every parameter must be filled.

        A `QuantizedTensor` (GGUF blocks the loader kept) goes to its Linear's method at its row
        offset in the merged weight, and the plain weight is never written; a tied model's quantized
        token embedding becomes the lm_head's (the embedding then reads its rows from that copy)."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        cfg = self.config
        qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: some checkpoints still store a copy
            if cfg.moe is not None:
                name = _moe_name(name)
            shard = None
            for frag, (merged, idx) in _STACKED.items():
                if f".{frag}." in name:
                    name = name.replace(frag, merged)
                    shard = idx
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint for {cfg.architecture}")
            param = params[name]
            if isinstance(tensor, QuantizedTensor):
                tied_embedding = name == "embed_tokens.weight" and cfg.tie_word_embeddings
                layer = self.lm_head if tied_embedding else self.get_submodule(name.removesuffix(".weight"))
                load = getattr(layer.method, "load_quantized", None) if isinstance(layer, Linear) else None
                if load is None:  # a method without quantized kernels: de-quantise here
                    tensor = tensor.dequantize()
                else:
                    start = 0
                    if shard is not None:
                        sizes = qkv_sizes if "qkv_proj" in name else [param.shape[0] // 2] * 2
                        start = sum(sizes[:shard])
                        if tensor.n != sizes[shard]:
                            raise ValueError(f"weight {hf_name!r} has shape {tensor.shape}, expected ({sizes[shard]}, {tensor.k})")
                        filled.add(f"{name}#{shard}")
                    else:
                        if tensor.shape != tuple(param.shape):
                            raise ValueError(f"weight {hf_name!r} has shape {tensor.shape}, expected {tuple(param.shape)}")
                        filled.update((name, "lm_head.weight") if tied_embedding else (name,))
                    load(layer, start, tensor)
                    continue
            with torch.no_grad():
                if shard is None:
                    _copy(param, tensor, hf_name)
                    filled.add(name)
                else:
                    sizes = qkv_sizes if "qkv_proj" in name else [param.shape[0] // 2] * 2
                    start = sum(sizes[:shard])
                    _copy(param.narrow(0, start, sizes[shard]), tensor, hf_name)
                    filled.add(f"{name}#{shard}")
        if cfg.tie_word_embeddings and "lm_head.weight" not in filled:
            self.lm_head.weight = self.embed_tokens.weight  # shared until process_weights
            filled.add("lm_head.weight")
        missing = []
        for name in params:
            if "qkv_proj" in name or "gate_up_proj" in name:
                n = 3 if "qkv_proj" in name else 2
                missing += [f"{name}#{i}" for i in range(n) if f"{name}#{i}" not in filled]
            elif name not in filled:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


# rope types whose tables depend on the engine's context length (layers/rotary.py: long-rope picks its
# factors by it, dynamic NTK scales its base for it)
_LENGTH_DEPENDENT_ROPE = frozenset({"longrope", "dynamic"})


def resolved_rope(hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> dict[str, Any]:
    """One rotary table's identity: the rope parameters as the config resolves them for `layer_type`
    (type, theta, the scaling's own keys), the context length where the type depends on it (else
    None), and a SHA-256 of the inverse frequencies and attention scaling `rope_inv_freq` computes
    from them, so a change in how they are computed (transformers' rope functions) changes it too."""
    import hashlib
    import json
    import struct

    from chatserve.layers.rotary import rope_inv_freq

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = {k: v for k, v in params.items() if not isinstance(v, dict)}  # (another layer type's settings)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_type", rope_type)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    inv_freq, scaling = rope_inv_freq(hf_config, head_dim, layer_type=layer_type, max_positions=max_positions)
    digest = hashlib.sha256(inv_freq.contiguous().numpy().tobytes() + struct.pack("<d", scaling)).hexdigest()
    return {
        "parameters": json.loads(json.dumps(params, sort_keys=True, default=str)),
        "max_positions": max_positions if rope_type in _LENGTH_DEPENDENT_ROPE else None,
        "inv_freq_sha256": digest,
    }


# Mixtral's expert names -> Qwen3-MoE / OLMoE's (which FusedMoE's parameters follow)
_MIXTRAL_EXPERT = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _moe_name(name: str) -> str:
    """A MoE checkpoint's name in our module's terms: Mixtral's ``block_sparse_moe.experts.{e}.w1``
    is ``mlp.experts.{e}.gate_proj`` (w3: up, w2: down), its router ``block_sparse_moe.gate`` is ``mlp.gate``."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in _MIXTRAL_EXPERT.items():
        if old in name:
            return name.replace(old, new)
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
