"""Tiny random checkpoints of the dense families beyond Llama (Gemma 2, Gemma 3, Phi-3, Phi-4-mini,
Mistral with a sliding window), written by transformers itself with a fixed seed.

Every windowed family gets a window of 16 tokens, so a prompt of 80+ tokens crosses it several
times; head_dim 32 (the C++ paged attention's smallest), 4 layers, so Gemma's local and global
layers both appear. Norm weights are randomised (transformers initialises Gemma's to zero, which
would hide a wrong (1 + w)), and soft-caps are small enough to bite on random weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatserve.models.loader import save_tokenizer

WINDOW = 16

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (config class, config kwargs beyond the common ones)
    "gemma2": ("Gemma2Config", {
        "head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,  # = head_dim: what a GGUF implies
        "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
    }),
    "phi3": ("Phi3Config", {  # long-rope past 64 positions, a window over every layer, untied lm_head
        "hidden_size": 128, "initializer_range": 0.1, "sliding_window": WINDOW, "tie_word_embeddings": False,
        "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0,
                            "short_factor": [1.0 + 0.05 * i for i in range(16)],
                            "long_factor": [1.0 + 0.5 * i for i in range(16)],
                            "original_max_position_embeddings": 64},
    }),
    "phi4mini": ("Phi3Config", {  # partial rotary (3/4 of each head), tied, no window
        "hidden_size": 128, "tie_word_embeddings": True, "partial_rotary_factor": 0.75,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75},
    }),
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW, "tie_word_embeddings": False}),
}

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "phi4mini": "Phi3ForCausalLM", "mistral-window": "MistralForCausalLM"}


def hf_config(name: str, vocab_size: int, bos: int | None, eos: int | None) -> Any:
    import transformers

    cls_name, extra = FAMILIES[name]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, initializer_range=0.2,
    )
    if not cls_name.startswith("Phi3"):  # Phi-3's head_dim is hidden_size / heads
        kwargs["head_dim"] = 32
    kwargs.update(extra)
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [ARCHITECTURES[name]]
    config._attn_implementation = "eager"  # soft-caps and windows as the reference computes them
    return config


def build_hf_model(name: str, vocab_size: int, bos: int | None = None, eos: int | None = None) -> Any:
    """The random model (float32, eager attention), with non-trivial norm weights."""
    import transformers

    config = hf_config(name, vocab_size, bos, eos)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma's (1 + w) starts at w = 0; give every norm a real weight
                centre = 0.0 if name.startswith("gemma") else 1.0
                p.copy_(centre + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def write_family_checkpoint(folder: Path, name: str, tokenizer: Any) -> Path:
    model = build_hf_model(name, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)  # the added tokens listed, as a hub repository's are
    return folder


GGUF_ARCHS = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}


def write_family_gguf(path: Path, name: str, model: Any, default_gguf: str, qtype: int) -> Path:
    """`model`'s weights as llama.cpp's converter writes a GGUF of its architecture: tensor names
    from gguf's table (Phi-3's fused attn_qkv and ffn_up), Gemma's norms stored as 1 + w, the
    family's metadata keys (soft-caps, window, rope scaling, long-rope factors as tensors), matmul
    weights and the token embedding in `qtype` (0: F32), norms in F32; SmolLM2's tokenizer."""
    import gguf

    from .tiny_gguf import add_default_tokenizer

    arch = GGUF_ARCHS[name]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if arch in ("gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rot)
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "longrope":
            import math

            orig = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(orig)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg.max_position_embeddings / orig) / math.log(orig)))
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    add_default_tokenizer(writer, default_gguf)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        base = hf_name.removesuffix(".weight")
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_base = table.get_name(base)
        assert gguf_base is not None, hf_name
        w = tensor.float().numpy()
        if "norm" in hf_name:
            writer.add_tensor(f"{gguf_base}.weight", (w + 1 if arch != "phi3" else w).astype(np.float32))
        elif qtype == 0:
            writer.add_tensor(f"{gguf_base}.weight", w.astype(np.float32))
        else:
            t = gguf.GGMLQuantizationType(qtype)
            writer.add_tensor(f"{gguf_base}.weight", gguf.quants.quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- chat templates with each family's tool-call syntax (issue 55) ---------------------------------------
# tests/helpers/tool_templates/: written after the families' own templates (Llama 3.1's JSON tool calls as
# vLLM's example has them, Mistral's v11 `[TOOL_CALLS]name[ARGS]` with its 9-alphanumeric id check, Mistral
# v13's `[TOOL_CALLS]name[CALL_ID]id[ARGS]`, Mistral v3's JSON list, Qwen3-Coder's XML, Llama 3.2's pythonic
# calls), for tiny random models with SmolLM2's tokenizer.
TOOL_TEMPLATES = Path(__file__).resolve().parent / "tool_templates"


def tool_template(name: str) -> str:
    return (TOOL_TEMPLATES / f"{name}.jinja").read_text()


TOOL_FAMILIES: dict[str, tuple[str, str]] = {
    # --tool-call-parser name (a second spelling of one: name_spelling): (tiny architecture, template file)
    "llama3_json": ("llama", "llama3.1_json"),
    "mistral": ("mistral", "mistral_v11"),
    "mistral_v13": ("mistral", "mistral_v13"),
    "qwen3_coder": ("qwen3", "qwen3_coder"),
    "pythonic": ("llama", "llama3.2_pythonic"),
}


def with_chat_template(checkpoint: Path, folder: Path, template: str) -> Path:
    """A copy of a tiny checkpoint whose tokenizer carries `template` as its chat template."""
    import json
    import shutil

    shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return folder
