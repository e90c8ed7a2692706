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

import torch

WINDOW = 16

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (config class, config kwargs beyond the common ones)
    "gemma2": ("Gemma2Config", {
        "head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
    }),
    "phi3": ("Phi3Config", {  # long-rope past 64 positions, a window over every layer, untied lm_head
        "hidden_size": 128, "sliding_window": WINDOW, "tie_word_embeddings": False, "original_max_position_embeddings": 64,
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
    tokenizer.save_pretrained(folder)
    return folder
