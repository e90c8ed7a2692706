"""Tiny random mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE), written by transformers, and
GGUF copies of the same weights in llama.cpp's layout, written with the `gguf` package.

The GGUF writer does what llama.cpp's convert_hf_to_gguf.py does for these families: experts
stacked into ``ffn_{gate,up,down}_exps`` ([experts, rows, cols]), the router as ``ffn_gate_inp``
(float32, as llama-quantize leaves it), Mixtral as architecture ``llama`` with ``expert_count`` and
its q/k rows permuted for llama.cpp's rotary layout, Qwen3-MoE's expert width in
``expert_feed_forward_length``. Matmul weights take the asked ggml type (F32 for exactness, Q8_0 /
Q4_0 via gguf's own quantizer); norms stay F32. The tokenizer is the real SmolLM2 one (copied from
the default model's metadata), so the engine loads these like any GGUF file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from chatserve.models.loader import save_tokenizer

from .tiny_gguf import add_default_tokenizer

# head_dim 32: the fused C++ rotary and paged attention kernels' sizes (smaller heads take torch paths)
HIDDEN, HEADS, KV_HEADS, LAYERS, EXPERTS, TOP_K = 128, 4, 2, 2, 8, 2

# family -> (transformers config class, its extra kwargs, llama.cpp architecture)
FAMILIES = {
    # Qwen3-MoE: per-head q/k norms, renormalised top-k, and layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": EXPERTS, "moe_intermediate_size": 32, "intermediate_size": 96,
                                     "norm_topk_prob": True, "head_dim": 32, "mlp_only_layers": [1]}, "qwen3moe"),
    "mixtral": ("MixtralConfig", {"num_local_experts": EXPERTS, "intermediate_size": 64}, "llama"),
    # OLMoE: q/k norms over the whole projection, no renormalisation, q/k/v clamped
    "olmoe": ("OlmoeConfig", {"num_experts": EXPERTS, "intermediate_size": 64, "norm_topk_prob": False,
                              "clip_qkv": 6.0}, "olmoe"),
}


def write_tiny_moe(folder: Path, family: str, tokenizer, seed: int = 1234, snap_qtype: int | None = None) -> Path:
    """A random `family` model with 8 experts (2 per token), saved by transformers with `tokenizer`.

    snap_qtype: every matmul weight but the routers rounded through that ggml type (quantised and
    de-quantised with gguf's own code), so a GGUF copy in that type holds exactly these weights and
    transformers in float32 is the reference for the quantized kernels' arithmetic alone (a random
    model's routing is chaotic: rounding the weights alone moves its logprobs by tenths of a nat)."""
    import transformers

    cls_name, extra, _ = FAMILIES[family]
    config = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, num_experts_per_tok=TOP_K, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.2, tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights, so the tests see where each norm applies
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(2.0)  # peaked next-token distributions (a random model's are nearly flat)
        if snap_qtype is not None:
            import gguf

            t = gguf.GGMLQuantizationType(snap_qtype)
            for name, p in model.named_parameters():
                if p.dim() >= 2 and not name.endswith(("norm.weight", ".gate.weight")):  # experts: [E, N, K]
                    w = p.detach().float().numpy()
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t)))
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)  # the added tokens listed, as a hub repository's are
    return folder


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path: Path, folder: Path, family: str, default_gguf: str, qtype: int = 0) -> Path:
    """The weights of the transformers checkpoint in `folder` as a llama.cpp-layout GGUF at `path`;
    matmul weights (experts included) in ggml type `qtype` (0: F32)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    arch = FAMILIES[family][2]
    sd = {k: v.float().numpy() for k, v in load_file(str(Path(folder, "model.safetensors"))).items()}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "olmoe" and cfg.clip_qkv is not None:
        w.add_clamp_kqv(float(cfg.clip_qkv))
    add_default_tokenizer(w, default_gguf)

    def matmul(name: str, a: np.ndarray) -> None:
        if qtype == 0:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            t = gguf.GGMLQuantizationType(qtype)
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), t), raw_dtype=t)

    def plain(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    matmul("token_embd.weight", sd["model.embed_tokens.weight"])
    plain("output_norm.weight", sd["model.norm.weight"])
    matmul("output.weight", sd["lm_head.weight"])
    moe_prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    expert_names = {"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral" else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        plain(f"blk.{i}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        plain(f"blk.{i}.ffn_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        q, k = sd[f"{p}.self_attn.q_proj.weight"], sd[f"{p}.self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _llama_cpp_permute(q, cfg.num_attention_heads), _llama_cpp_permute(k, cfg.num_key_value_heads)
        matmul(f"blk.{i}.attn_q.weight", q)
        matmul(f"blk.{i}.attn_k.weight", k)
        matmul(f"blk.{i}.attn_v.weight", sd[f"{p}.self_attn.v_proj.weight"])
        matmul(f"blk.{i}.attn_output.weight", sd[f"{p}.self_attn.o_proj.weight"])
        if f"{p}.self_attn.q_norm.weight" in sd:
            plain(f"blk.{i}.attn_q_norm.weight", sd[f"{p}.self_attn.q_norm.weight"])
            plain(f"blk.{i}.attn_k_norm.weight", sd[f"{p}.self_attn.k_norm.weight"])
        if f"{p}.{moe_prefix}.gate.weight" in sd:
            plain(f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}.{moe_prefix}.gate.weight"])
            for kind, hf in expert_names.items():
                stacked = np.stack([sd[f"{p}.{moe_prefix}.experts.{e}.{hf}.weight"] for e in range(EXPERTS)])
                matmul(f"blk.{i}.ffn_{kind}_exps.weight", stacked)
        else:  # a dense layer (Qwen3-MoE's mlp_only_layers)
            for kind in ("gate", "up", "down"):
                matmul(f"blk.{i}.ffn_{kind}.weight", sd[f"{p}.mlp.{kind}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
