"""What transformers' GGUF config conversion leaves out for Llama 3.1+, Gemma 2/3 and Phi-3, from llama.cpp's keys.

transformers maps a GGUF file's metadata to a config by a fixed table (integrations/ggml.py) that
has no entry for the settings these families run on: Gemma 2's soft-caps, Gemma's attention scale,
Gemma 3's rope scaling, Phi-3's sliding window, original context and long-rope factors (which
llama.cpp's converter stores as the tensors rope_factors_long / rope_factors_short), and the
partial rotary of Phi-4-mini (rope.dimension_count), and Llama 3.1+'s llama3 rope scaling, which
llama.cpp's converter stores as the per-frequency divisors of the tensor rope_freqs. Without them a file would load with the config
class's defaults: plausible for some checkpoints, silently wrong for others. `complete_gguf_config`
fills them in as llama.cpp reads them; the metadata cache (models/loader.py) then stores the result.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from chatserve.models.gguf_header import GGUFHeader, raw_array, read_gguf_header

GEMMA_ARCHS = ("gemma2", "gemma3")


def complete_gguf_config(config: Any, path: str) -> Any:
    """`config` (transformers' from this GGUF file) with the family settings it lacks; unchanged for
    other architectures. Returns it for chaining."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = read_gguf_header(buf)
        arch = header.metadata.get("general.architecture")
        if arch in GEMMA_ARCHS:
            _complete_gemma(config, header, arch)
        elif arch == "phi3":
            _complete_phi3(config, header, buf)
        _complete_rope_freqs(config, header, buf, str(arch))
    finally:
        try:
            buf.close()
        except BufferError:  # a numpy view of it is still referenced; closed when collected
            pass
    return config


ROPE_FREQS_TENSOR = "rope_freqs.weight"


def _complete_rope_freqs(config: Any, header: GGUFHeader, buf: Any, arch: str) -> None:
    """`config.rope_freq_factors`: the per-frequency divisors of a file's `rope_freqs` tensor.

    Why: llama.cpp's converter writes a Llama 3.1 / 3.2 checkpoint's `rope_scaling` (type llama3)
    as no metadata at all, only this tensor of head_dim / 2 factors that llama.cpp's rope divides
    each frequency by. transformers' GGUF table skips it, so the config says "default rope" and
    positions past a few thousand rotate differently from llama.cpp (and from the original
    checkpoint). `layers/rotary.py` divides the default inverse frequencies by these factors, which is
    llama.cpp's arithmetic; the factors themselves are what the file says, whatever formula made them.
    """
    info = next((t for t in header.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if info is None:
        return
    factors = np.asarray(raw_array(buf, info), dtype=np.float32).reshape(-1)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type != "default":
        raise ValueError(f"{arch} GGUF has both a {rope_type!r} rope scaling and a {ROPE_FREQS_TENSOR} tensor; "
                         "llama.cpp applies both, chatserve serves only one of them")
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rotary = int(header.metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if factors.size != rotary // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise ValueError(f"{arch} GGUF's {ROPE_FREQS_TENSOR} has {factors.size} factors (finite, positive ones "
                         f"expected: one per rotated pair, {rotary // 2})")
    config.rope_freq_factors = [float(x) for x in factors]


def _complete_gemma(config: Any, header: GGUFHeader, arch: str) -> None:
    md = header.metadata
    for key, attr in (("attn_logit_softcapping", "attn_logit_softcapping"), ("final_logit_softcapping", "final_logit_softcapping")):
        if f"{arch}.{key}" in md:
            setattr(config, attr, float(md[f"{arch}.{key}"]))
    # llama.cpp's attention scale: 1/sqrt(head_dim), except Gemma 2/3 27B's 1/sqrt(hidden / heads)
    # (46 and 62 layers); a GGUF has no key for query_pre_attn_scalar
    head_dim = int(md.get(f"{arch}.attention.key_length", config.head_dim))
    layers = int(md.get(f"{arch}.block_count", config.num_hidden_layers))
    big = {"gemma2": 46, "gemma3": 62}[arch]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if layers == big else head_dim
    if arch == "gemma3" and md.get("gemma3.rope.scaling.type") == "linear":
        factor = float(md.get("gemma3.rope.scaling.factor", 1.0))
        params = dict(config.rope_parameters)
        full = dict(params.get("full_attention") or {})
        full.update({"rope_type": "linear", "factor": factor})
        params["full_attention"] = full
        config.rope_parameters = params


def _complete_phi3(config: Any, header: GGUFHeader, buf: Any) -> None:
    md = header.metadata
    window = md.get("phi3.attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    head_dim = config.hidden_size // config.num_attention_heads
    rot = int(md.get("phi3.rope.dimension_count", head_dim))
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(md.get("phi3.rope.freq_base", 10000.0)))
    params["partial_rotary_factor"] = rot / head_dim
    if rot != head_dim:
        config.partial_rotary_factor = rot / head_dim
    original = md.get("phi3.rope.scaling.original_context_length")
    factors = {t.name: t for t in header.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:
        if original is None:
            raise ValueError("phi3 GGUF has long-rope factors but no phi3.rope.scaling.original_context_length")
        params.update({
            "rope_type": "longrope",
            "long_factor": [float(x) for x in np.asarray(raw_array(buf, factors["rope_factors_long.weight"]), dtype=np.float32)],
            "short_factor": [float(x) for x in np.asarray(raw_array(buf, factors["rope_factors_short.weight"]), dtype=np.float32)],
            "original_max_position_embeddings": int(original),
        })
        if "phi3.rope.scaling.attn_factor" in md:
            params["attention_factor"] = float(md["phi3.rope.scaling.attn_factor"])
        config.original_max_position_embeddings = int(original)
    elif factors:
        raise ValueError(f"phi3 GGUF has only {sorted(factors)} of the two long-rope factor tensors")
    else:
        params.setdefault("rope_type", "default")
    config.rope_parameters = params
