"""Stream HF-named tensors out of a GGUF file, one tensor at a time.

A drop-in for transformers' ``load_gguf_checkpoint(..., return_tensors=True)``
with the same names and values, minus its costs: we parse only the header
(skipping the tokenizer's string arrays without building numpy objects), build
the GGUF -> HF name map once from the names we expect, and memory-map the data
so peak memory is one de-quantised tensor on top of the model.

De-quantisation is ``gguf.dequantize`` (what transformers uses) and llama-arch
q/k weights are un-permuted the way transformers' ``LlamaTensorProcessor`` does,
so the values are bit-identical to transformers'.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from chatserve.models.gguf_header import GGUFHeader, GGUFTensorInfo, raw_array, read_gguf_header
from chatserve.models.gguf_moe import EXPERT_PLACEHOLDER, MOE_MODEL_TYPES, moe_tensor_names

logger = logging.getLogger(__name__)

# GGUF architectures we map, and whether transformers un-permutes their q/k (llama.cpp permutes
# q/k rows of llama-arch models for its rotary layout; qwen2/qwen3 are stored as in HF).
SUPPORTED_ARCHS = {"llama": True, "qwen2": False, "qwen3": False, "qwen3moe": False, "olmoe": False,
                   "gemma2": False, "gemma3": False, "phi3": False}
# llama.cpp stores these architectures' RMSNorm weights as 1 + w (Gemma's norm scales by 1 + w);
# transformers subtracts the 1 back, and so do we (models/gemma.py adds it in float32)
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
_QK_NORM_ARCHS = frozenset({"qwen3", "qwen3moe", "olmoe", "gemma3"})  # GGUF / HF model types with q/k norms
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "olmoe", "gemma3_text"})


def _expected_hf_names(hf_config: Any, n_layers: int, gguf_arch: str = "llama") -> list[str]:
    """HF parameter names (without .weight/.bias) of a llama / qwen2 / qwen3 / gemma2 / gemma3 /
    phi3 causal LM. Phi-3 keeps q|k|v and gate|up fused (llama.cpp's attn_qkv and ffn_up, whose
    gguf name table also maps the separate names: listing both would map one tensor twice)."""
    fused = gguf_arch == "phi3"
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj"] if fused else [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        names += [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
        names += [f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"] if fused else [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
        names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
        if gguf_arch in _NORM_PLUS_ONE:  # Gemma's sandwich: norms before and after the MLP too
            names += [f"{p}.pre_feedforward_layernorm", f"{p}.post_feedforward_layernorm"]
    return names


def _has_bias(hf_name: str, hf_config: Any, gguf_arch: str) -> bool:
    """Whether the HF model has a bias for this layer (transformers drops GGUF tensors it has no slot for)."""
    model_type = getattr(hf_config, "model_type", gguf_arch)
    if ".self_attn." in hf_name and hf_name.endswith("_proj"):
        if model_type == "qwen2" and not hf_name.endswith("o_proj"):
            return True
        return bool(getattr(hf_config, "attention_bias", False))
    if ".mlp." in hf_name:
        return bool(getattr(hf_config, "mlp_bias", False))
    return False


def gguf_to_hf_names(gguf_arch: str, hf_config: Any, n_layers: int) -> dict[str, str]:
    """``{gguf tensor name: HF parameter name}``, built once with gguf's own name table."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch), None)
    if arch is None:
        raise ValueError(f"the installed gguf package does not know architecture {gguf_arch!r}; upgrade it (`pip install -U gguf`)")
    table = get_tensor_name_map(arch, n_layers)
    has_qk_norm = gguf_arch in _QK_NORM_ARCHS or getattr(hf_config, "model_type", "") in _QK_NORM_TYPES
    mapping: dict[str, str] = {}
    if getattr(hf_config, "model_type", "") in MOE_MODEL_TYPES:  # routers and stacked experts
        mapping.update(moe_tensor_names(n_layers))
    for hf_base in _expected_hf_names(hf_config, n_layers, gguf_arch):
        if not has_qk_norm and hf_base.endswith(("q_norm", "k_norm")):
            continue  # only Qwen3, Qwen3-MoE, OLMoE and Gemma 3 have q/k norms; transformers skips them elsewhere
        gguf_base = table.get_name(hf_base)
        if gguf_base is None:
            continue
        mapping[f"{gguf_base}.weight"] = f"{hf_base}.weight"
        if _has_bias(hf_base, hf_config, gguf_arch):
            mapping[f"{gguf_base}.bias"] = f"{hf_base}.bias"
    return mapping


def _unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (same as transformers' ``LlamaTensorProcessor``)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def iter_gguf_weights(path: str, hf_config: Any, dtype: torch.dtype,
                      keep_qtypes: frozenset[int] = frozenset()) -> Iterator[tuple[str, Any]]:
    """Yield ``(HF parameter name, tensor in dtype)`` for every mapped tensor of a GGUF file, in file order.

    Names and values equal transformers' ``load_gguf_checkpoint(return_tensors=True)``; tensors
    without an HF counterpart (e.g. ``rope_freqs``) are skipped, as transformers does.

    A matmul weight (and a tied token embedding, which the lm_head shares) whose ggml type is in
    `keep_qtypes` is yielded as a `QuantizedTensor` instead: its blocks copied out of the mmap, q/k
    rows un-permuted (the permutation moves whole rows, and a row's blocks run along K), nothing
    de-quantised. Other quantized types are then de-quantised, with one log line naming them.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield from _iter_tensors(path, buf, hf_config, dtype, keep_qtypes)
    finally:
        try:
            buf.close()
        except BufferError:  # a caller still holds a view; the mmap closes when it is collected
            pass


_PLAIN_TYPES = frozenset({0, 1, 28, 30})  # F32, F16, F64, BF16: stored as values, converted as before


def _keeps_blocks(hf_name: str, info: GGUFTensorInfo, hf_config: Any) -> bool:
    """Whether this tensor can stay in blocks at all: a 2-D matmul weight, or the token embedding of
    a tied model (its rows are then read back from the lm_head's copy)."""
    if len(info.shape) != (3 if ".experts." in hf_name else 2) or not hf_name.endswith(".weight") or info.ggml_type in _PLAIN_TYPES:
        return False
    if hf_name == "model.embed_tokens.weight":
        return bool(getattr(hf_config, "tie_word_embeddings", False))
    return hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight"


def _log_fallbacks(path: str, header: GGUFHeader, names: dict[str, str], hf_config: Any, keep_qtypes: frozenset[int]) -> None:
    """One line naming the quantized types of this file that are de-quantised at load, and how many tensors."""
    from collections import Counter

    from gguf import GGMLQuantizationType

    fallback = Counter(GGMLQuantizationType(info.ggml_type).name for info in header.tensors
                       if info.name in names and _keeps_blocks(names[info.name], info, hf_config)
                       and info.ggml_type not in keep_qtypes)
    if fallback:
        listed = ", ".join(f"{name} ({n} tensor{'s' if n > 1 else ''})" for name, n in sorted(fallback.items()))
        logger.warning("%s: de-quantised at load, no quantized kernel for: %s", os.path.basename(path), listed)


def _iter_tensors(path: str, buf: mmap.mmap, hf_config: Any, dtype: torch.dtype,
                  keep_qtypes: frozenset[int] = frozenset()) -> Iterator[tuple[str, Any]]:
    from gguf import GGMLQuantizationType, dequantize

    header = read_gguf_header(buf)
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHS)}); "
            "convert the model to a Hugging Face safetensors folder and pass that folder instead."
        )
    n_layers = int(md.get(f"{arch}.block_count", getattr(hf_config, "num_hidden_layers", 0)))
    names = gguf_to_hf_names(arch, hf_config, n_layers)
    # NOTE: like transformers, head counts come from the GGUF metadata, and without both no un-permute happens.
    n_head, n_kv_head = md.get(f"{arch}.attention.head_count"), md.get(f"{arch}.attention.head_count_kv")
    unpermute = SUPPORTED_ARCHS[arch] and n_head is not None and n_kv_head is not None
    if keep_qtypes:
        _log_fallbacks(path, header, names, hf_config, keep_qtypes)

    for info in header.tensors:
        hf_name = names.get(info.name)
        if hf_name is None:
            continue
        if ".experts." in hf_name:  # llama.cpp stacks a layer's experts in one tensor: one expert at a time
            yield from _experts(buf, info, hf_name, dtype, info.ggml_type in keep_qtypes and _keeps_blocks(hf_name, info, hf_config))
            continue
        if info.ggml_type in keep_qtypes and _keeps_blocks(hf_name, info, hf_config):
            yield hf_name, _quantized(buf, info, unpermute, n_head, n_kv_head)
            continue
        weights = dequantize(raw_array(buf, info), GGMLQuantizationType(info.ggml_type))
        if arch in _NORM_PLUS_ONE and "norm.weight" in info.name:
            weights = weights - 1  # as transformers' Gemma2TensorProcessor
        if unpermute and ".attn_q." in info.name:
            weights = _unpermute_qk(weights, int(n_head))
        elif unpermute and ".attn_k." in info.name:
            weights = _unpermute_qk(weights, int(n_kv_head))
        if not weights.flags.writeable:  # still a view of the read-only mmap
            weights = np.copy(weights)
        tensor = torch.from_numpy(weights).to(dtype)
        del weights
        yield hf_name, tensor
        del tensor


def _quantized(buf: mmap.mmap, info: GGUFTensorInfo, unpermute: bool, n_head: Any, n_kv_head: Any) -> Any:
    """The tensor's blocks as a `QuantizedTensor` (uint8 rows copied out of the mmap, q/k rows un-permuted)."""
    from chatserve.layers.quantized_linear import QuantizedTensor

    raw = raw_array(buf, info)  # uint8 [N, row_bytes], a view of the mmap
    if unpermute and ".attn_q." in info.name:
        raw = _unpermute_qk(raw, int(n_head))
    elif unpermute and ".attn_k." in info.name:
        raw = _unpermute_qk(raw, int(n_kv_head))
    n, k = info.shape
    return QuantizedTensor(torch.from_numpy(np.array(raw, copy=True)), info.ggml_type, n, k)


def _experts(buf: mmap.mmap, info: GGUFTensorInfo, hf_name: str, dtype: torch.dtype, keep: bool) -> Iterator[tuple[str, Any]]:
    """Each expert of a stacked ``ffn_*_exps`` tensor ([experts, N, K]) under its own HF name: its
    blocks as a `QuantizedTensor` where `keep`, else de-quantised to `dtype` (one expert at a time)."""
    from gguf import GGMLQuantizationType, dequantize

    from chatserve.layers.quantized_linear import QuantizedTensor

    if len(info.shape) != 3:
        raise ValueError(f"GGUF tensor {info.name!r} has shape {info.shape}; stacked experts are [experts, rows, cols]")
    raw = raw_array(buf, info)
    _, n, k = info.shape
    for e in range(info.shape[0]):
        name = hf_name.replace(EXPERT_PLACEHOLDER, str(e))
        if keep:
            yield name, QuantizedTensor(torch.from_numpy(np.array(raw[e], copy=True)), info.ggml_type, n, k)
        else:
            weights = dequantize(raw[e], GGMLQuantizationType(info.ggml_type))
            yield name, torch.from_numpy(np.array(weights, copy=True)).to(dtype)
