"""`--hf-overrides` (vLLM's flag): a JSON object applied to a model's Hugging Face config dict
before the config class is built from it, e.g. ``{"rope_scaling": {"rope_type": "yarn", "factor": 4}}``.

Why before: transformers derives values while it builds a config (transformers 5 moves
`rope_scaling` into `rope_parameters` with the model's `rope_theta`, fills YaRN's
`original_max_position_embeddings`, derives `layer_types` from a window); an attribute set on the
built object would skip all of that. So every path that turns a dict into a config applies them
first: a Hugging Face folder's config.json, a GGUF file's converted metadata (models/loader.py).

Keys that change a tensor's shape (or which tensors exist) are refused at start-up, naming the key:
the checkpoint's weights fix them. A leaf: imports nothing of torch or transformers, so
`EngineArgs` checks the flag without loading a model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from chatserve.json_options import read_json_object

# Keys whose value fixes a weight's shape or which weights exist; their usual spellings in other configs too.
SHAPE_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias",
    # mixture of experts: expert counts and sizes, which layers are sparse
    "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace",
    # other configs' names for the same dimensions
    "n_embd", "n_layer", "n_head", "n_inner", "d_model", "ffn_dim", "num_layers", "num_heads", "num_kv_heads",
    # what the checkpoint is: another model class reads other weights
    "model_type", "architectures",
})
ROPE_KEYS = ("rope_parameters", "rope_scaling")
# what a rope dict carries about the model itself rather than its scaling (transformers 5 keeps them there)
_ROPE_MODEL_FACTS = ("rope_theta", "partial_rotary_factor")


def parse_hf_overrides(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The flag's JSON text or `LLM(hf_overrides={...})`'s dict, checked; None (or blank, or {}) is none.

    Raises ValueError for anything but a JSON object, and for a key that changes a tensor shape
    (at any depth: `text_config.hidden_size` too), naming it."""
    value = read_json_object("hf_overrides", value) if value is not None else None
    if value is None:
        return None
    _refuse_shape_keys(value, "hf_overrides")
    for key in ROPE_KEYS:
        if value.get(key) is not None and not isinstance(value[key], Mapping):
            raise ValueError(f"hf_overrides.{key} must be a JSON object or null; got {type(value[key]).__name__}")
    return copy.deepcopy(dict(value)) or None


def _refuse_shape_keys(value: Mapping[str, Any], path: str) -> None:
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{path} keys must be strings; got {key!r}")
        if key in SHAPE_KEYS:
            raise ValueError(f"{path}.{key} cannot be overridden: it changes the shape of the model's tensors "
                             "(the checkpoint's weights fix it); drop it from --hf-overrides")
        if isinstance(item, Mapping) and key not in ROPE_KEYS:
            _refuse_shape_keys(item, f"{path}.{key}")


def apply_hf_overrides(config_dict: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `config_dict` (a config.json's values) with `overrides` applied.

    A nested object (e.g. a multimodal model's `text_config`) is merged into the config's nested
    object key by key; any other value replaces the config's. Rope scaling, under either name
    (`rope_scaling`, or transformers 5's `rope_parameters`), replaces the config's scaling but keeps
    what its rope dict says about the model (`rope_theta`, `partial_rotary_factor`) unless the
    override names them, and goes under the name the config already uses: transformers 5 reads a
    `rope_scaling` key in place of `rope_parameters`, and would then fall back to the class's default
    theta (10000), not the checkpoint's (SmolLM2's is 100000).
    """
    result = copy.deepcopy(config_dict)
    for key, value in (overrides or {}).items():
        value = copy.deepcopy(value)
        if key in ROPE_KEYS:
            _apply_rope(result, key, value)
        elif isinstance(value, Mapping) and isinstance(result.get(key), dict):
            result[key] = apply_hf_overrides(result[key], value)
        else:
            result[key] = value
    return result


def _apply_rope(config: dict[str, Any], key: str, value: Any) -> None:
    current = next((config[k] for k in ROPE_KEYS if isinstance(config.get(k), dict)), None) or {}
    if value is None:
        value = {"rope_type": "default"}
    if not isinstance(value, Mapping):
        raise ValueError(f"hf_overrides.{key} must be a JSON object or null; got {type(value).__name__}")
    value = dict(value)
    nested = bool(value) and all(isinstance(v, Mapping) for v in value.values())
    if nested:  # per layer type (Gemma 3: sliding_attention / full_attention)
        value = {layer: _with_model_facts(dict(params), _dict_or_empty(current.get(layer))) for layer, params in value.items()}
    else:
        value = _with_model_facts(value, current)
    # transformers 5's spelling where the config has it (the scaling lives there, beside the theta), else
    # the override's own (an older config.json keeps rope_theta as a top-level key); never both, since
    # transformers 5 takes a `rope_scaling` key over `rope_parameters`
    target = "rope_parameters" if "rope_parameters" in config else key
    for name in ROPE_KEYS:
        config.pop(name, None)
    config[target] = value


def _dict_or_empty(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _with_model_facts(params: dict[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    for fact in _ROPE_MODEL_FACTS:
        if fact not in params and fact in current:
            params[fact] = current[fact]
    return params


def describe(overrides: Mapping[str, Any] | None) -> str:
    """One canonical line (sorted keys): for logs, and for fingerprints of what the overrides change."""
    return json.dumps(overrides or {}, sort_keys=True, separators=(",", ":"))


__all__ = ["SHAPE_KEYS", "apply_hf_overrides", "describe", "parse_hf_overrides"]
