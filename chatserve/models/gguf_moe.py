"""Mixture-of-experts GGUF files (Qwen3-MoE, Mixtral, OLMoE): the config transformers does not read
right from their metadata, and the names of their stacked expert tensors.

Why: we read a GGUF file's config and tokenizer with transformers (models/loader.py), and for these
three families its GGUF support is missing or partial, in ways that change the numbers:

- **qwen3moe**: the experts' width (``expert_feed_forward_length``) is not read, so the config gets
  transformers' default ``moe_intermediate_size``; and ``norm_topk_prob`` is left at its default
  (off), while llama.cpp always renormalises Qwen3-MoE's top-k weights (as the released checkpoints
  ask).
- **Mixtral**: llama.cpp's converter writes it as architecture ``llama`` with ``expert_count``;
  transformers builds a dense ``LlamaConfig`` from it.
- **olmoe**: not supported at all (an error naming the architecture).

So while transformers parses such a file, `gguf_moe_metadata` lets it accept ``olmoe`` (the
llama-style keys it maps for other families) and then corrects the parsed config from the file's
own metadata: the model type and architecture, the expert count, the experts per token, their width,
whether the top-k weights are renormalised (``expert_weights_norm`` where the file says, else
llama.cpp's choice for the architecture), the layers that stay dense (no ``ffn_gate_inp``), and
OLMoE's ``clamp_kqv``. The tokenizer is read by transformers as for any GGUF file.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from typing import Any

from chatserve.models.gguf_header import GGUFHeader, read_gguf_header

# llama.cpp architecture -> (HF model_type, HF architecture, renormalises the top-k weights by default).
# Mixtral is "llama" with experts; llama.cpp's build_moe_ffn(norm_w) choice per architecture.
MOE_GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", True),
    "llama": ("mixtral", "MixtralForCausalLM", True),
    "olmoe": ("olmoe", "OlmoeForCausalLM", False),
}

# llama.cpp's names of a MoE layer's router and stacked experts -> ours (FusedMoE's, models/llama.py)
MOE_MODEL_TYPES = frozenset(model_type for model_type, _, _ in MOE_GGUF_ARCHS.values())

EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERT_PLACEHOLDER = "{expert}"  # in a mapped name: the tensor holds every expert, cut along its first dim


def moe_tensor_names(n_layers: int) -> dict[str, str]:
    """``{gguf name: HF name}`` of the router and the stacked experts of each layer (an expert name
    holds `EXPERT_PLACEHOLDER` where the expert's index goes), and of the MLP of a dense layer."""
    names: dict[str, str] = {}
    for i in range(n_layers):
        names[f"blk.{i}.ffn_gate_inp.weight"] = f"model.layers.{i}.mlp.gate.weight"
        for proj in ("gate", "up", "down"):  # a dense layer of a MoE model (Qwen3-MoE's mlp_only_layers), which
            names[f"blk.{i}.ffn_{proj}.weight"] = f"model.layers.{i}.mlp.{proj}_proj.weight"  # gguf's qwen3moe table lacks
        for gguf_name, proj in EXPERT_TENSORS.items():
            names[f"blk.{i}.{gguf_name}.weight"] = f"model.layers.{i}.mlp.experts.{EXPERT_PLACEHOLDER}.{proj}.weight"
    return names


def is_moe(header: GGUFHeader) -> bool:
    arch = header.metadata.get("general.architecture")
    return arch in MOE_GGUF_ARCHS and int(header.metadata.get(f"{arch}.expert_count", 0) or 0) > 0


def moe_config_fixes(header: GGUFHeader) -> dict[str, Any]:
    """The HF config values a MoE GGUF file's metadata gives that transformers does not read (see the
    module docstring); {} for a dense file."""
    if not is_moe(header):
        return {}
    md = header.metadata
    arch = md["general.architecture"]
    model_type, architecture, renormalize = MOE_GGUF_ARCHS[arch]
    n_layers = int(md[f"{arch}.block_count"])
    num_experts = int(md[f"{arch}.expert_count"])
    used = md.get(f"{arch}.expert_used_count")
    if used is None:
        raise ValueError(f"GGUF field {arch}.expert_used_count (experts per token) is missing from a MoE file")
    if f"{arch}.expert_weights_norm" in md:
        renormalize = bool(md[f"{arch}.expert_weights_norm"])
    fixes: dict[str, Any] = {"model_type": model_type, "architectures": [architecture], "num_experts_per_tok": int(used)}
    tensor_names = {t.name for t in header.tensors}
    sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    if arch == "llama":
        fixes["num_local_experts"] = num_experts
        if len(sparse) != n_layers:
            raise ValueError(f"a Mixtral GGUF has experts in every layer; this file has a router in layers {sparse} only")
    else:
        fixes["num_experts"] = num_experts
        fixes["norm_topk_prob"] = renormalize
    if arch == "qwen3moe":
        width = md.get(f"{arch}.expert_feed_forward_length")
        if width is None:
            raise ValueError("GGUF field qwen3moe.expert_feed_forward_length (the experts' width) is missing")
        fixes["moe_intermediate_size"] = int(width)
        fixes["mlp_only_layers"] = [i for i in range(n_layers) if i not in sparse]
        fixes["decoder_sparse_step"] = 1
    elif arch == "olmoe":
        if len(sparse) != n_layers:
            raise ValueError(f"an OLMoE GGUF has experts in every layer; this file has a router in layers {sparse} only")
        clamp = md.get(f"{arch}.attention.clamp_kqv")
        fixes["clip_qkv"] = float(clamp) if clamp else None
    return fixes


def _olmoe_config_keys(gguf_utils: Any) -> dict[str, Any]:
    """transformers' GGUF -> config key map for llama-style families, for olmoe (which it lacks)."""
    mapping = dict(gguf_utils.GGUF_TO_TRANSFORMERS_MAPPING["config"]["qwen3_moe"])
    mapping.pop("attention.key_length", None)  # OLMoE's head_dim is hidden / heads
    return mapping


@contextlib.contextmanager
def gguf_moe_metadata() -> Iterator[None]:
    """Within the block, transformers' metadata-only GGUF reads accept olmoe and return MoE files'
    configs corrected by `moe_config_fixes` (AutoConfig and AutoTokenizer both read through it)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    config_maps = gguf_utils.GGUF_TO_TRANSFORMERS_MAPPING["config"]
    added_arch = "olmoe" not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES
    added_map = "olmoe" not in config_maps

    def corrected(path: Any, return_tensors: bool = False, **kw: Any) -> Any:
        result = original(path, return_tensors=return_tensors, **kw)
        if not return_tensors:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                fixes = moe_config_fixes(read_gguf_header(buf))
            result["config"].update(fixes)
        return result

    if added_map:
        config_maps["olmoe"] = _olmoe_config_keys(gguf_utils)
    if added_arch:
        gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append("olmoe")
    gguf_utils.load_gguf_checkpoint = corrected
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original
        if added_arch:
            gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.remove("olmoe")
        if added_map:
            config_maps.pop("olmoe", None)


__all__ = ["EXPERT_PLACEHOLDER", "MOE_GGUF_ARCHS", "gguf_moe_metadata", "is_moe", "moe_config_fixes", "moe_tensor_names"]
