"""`--hf-overrides` (applied to the Hugging Face config dict before its class is built; keys that
change tensor shapes refused at start-up), the context a scaled rope reaches (a warning past it),
and the default KV pool that grows to hold `--max-model-len`: the default model serves 32768 tokens
with a YaRN override and no other flag. YaRN's numerics on every path: tests/models/test_yarn.py."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from chatserve.cli import main, options_from_args, parse_args
from chatserve.config import KV_POOL_HEADROOM, EngineArgs
from chatserve.models.hf_overrides import apply_hf_overrides, parse_hf_overrides

SMOL_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}


# ---- the option ----------------------------------------------------------------------------------------
def test_the_option_is_a_json_object_without_shape_keys():
    assert parse_hf_overrides(None) is parse_hf_overrides("") is parse_hf_overrides("{}") is None
    given = {"rope_scaling": SMOL_YARN, "text_config": {"sliding_window": 512}}
    assert parse_hf_overrides(json.dumps(given)) == parse_hf_overrides(given) == given
    for bad, says in (("[1]", "JSON object"), ("{nope", "JSON object"), (3, "JSON object"),
                      ({"rope_scaling": "yarn"}, r"hf_overrides\.rope_scaling must be a JSON object or null")):
        with pytest.raises(ValueError, match=says):
            parse_hf_overrides(bad)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "num_hidden_layers", "num_experts", "num_local_experts", "tie_word_embeddings"):
        with pytest.raises(ValueError, match=rf"hf_overrides\.{key} cannot be overridden: it changes the shape"):
            parse_hf_overrides({key: 1})
    with pytest.raises(ValueError, match=r"hf_overrides\.text_config\.hidden_size"):
        parse_hf_overrides({"text_config": {"hidden_size": 8}})
    with pytest.raises(ValueError, match=r"hf_overrides\.head_dim"):  # at construction, before any load
        EngineArgs(hf_overrides='{"head_dim": 128}')


def test_a_shape_key_is_a_start_up_error_naming_it(capsys):
    assert main(["serve", "--hf-overrides", '{"rope_scaling": {"factor": 2}, "vocab_size": 7}'], environ={}) == 2
    err = capsys.readouterr().err
    assert "hf_overrides.vocab_size cannot be overridden" in err


def test_rope_scaling_goes_where_the_config_keeps_it_with_the_models_theta():
    v5 = {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    for key in ("rope_scaling", "rope_parameters"):
        out = apply_hf_overrides(v5, {key: SMOL_YARN})
        assert out["rope_parameters"] == {**SMOL_YARN, "rope_theta": 100000.0} and "rope_scaling" not in out
    assert v5["rope_parameters"]["rope_type"] == "default"  # (a copy)
    assert apply_hf_overrides(v5, {"rope_scaling": {**SMOL_YARN, "rope_theta": 5.0}})["rope_parameters"]["rope_theta"] == 5.0
    assert apply_hf_overrides(v5, {"rope_scaling": None})["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    # an older config.json: rope_theta a top-level key, the scaling under the override's name, never both names
    legacy = {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    out = apply_hf_overrides(legacy, {"rope_parameters": SMOL_YARN})
    assert out["rope_parameters"] == SMOL_YARN and "rope_scaling" not in out and out["rope_theta"] == 500000.0
    # per layer type (Gemma 3): each layer type keeps its own theta
    nested = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    out = apply_hf_overrides(nested, {"rope_parameters": {"full_attention": SMOL_YARN,
                                                          "sliding_attention": {"rope_type": "default"}}})
    assert out["rope_parameters"]["full_attention"] == {**SMOL_YARN, "rope_theta": 1e6}
    assert out["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    # a nested config merges key by key; other values replace
    multimodal = {"text_config": {"sliding_window": 1024, "rms_norm_eps": 1e-6}, "max_position_embeddings": 8}
    out = apply_hf_overrides(multimodal, {"text_config": {"sliding_window": 512}, "max_position_embeddings": 16})
    assert out == {"text_config": {"sliding_window": 512, "rms_norm_eps": 1e-6}, "max_position_embeddings": 16}


# ---- both loaders: a Hugging Face folder and a GGUF file's converted metadata --------------------------
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_hf_folder_config_is_built_from_the_overridden_dict(key, tiny_checkpoint):
    from chatserve.models.config import ModelConfig
    from chatserve.models.loader import load_hf_config, resolve_model

    source = resolve_model(tiny_checkpoint("llama"))
    plain = load_hf_config(source)
    config = load_hf_config(source, {key: {"rope_type": "yarn", "factor": 4}, "rms_norm_eps": 1e-3})
    assert type(config) is type(plain)
    theta = plain.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_theta"] == theta
    # built by the class from the dict: transformers filled YaRN's original length from max_position_embeddings
    assert config.rope_parameters["original_max_position_embeddings"] == plain.max_position_embeddings == 512
    assert config.rms_norm_eps == 1e-3
    assert ModelConfig.from_hf(config).context_len == 4 * 512
    assert ModelConfig.from_hf(plain).context_len == 512


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_gguf_metadata_config_is_built_from_the_overridden_dict(key, default_gguf, smollm_tokenizer):
    """(smollm_tokenizer: the default GGUF's metadata, converted once for the session)"""
    from chatserve.layers.rotary import rope_inv_freq
    from chatserve.models.config import ModelConfig
    from chatserve.models.loader import load_hf_config, resolve_model

    source = resolve_model(default_gguf)
    plain = load_hf_config(source)
    config = load_hf_config(source, {key: SMOL_YARN})
    assert plain.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_theta"] == 100000.0
    _, scaling = rope_inv_freq(config, 64)
    assert scaling > 1.1  # YaRN's attention factor
    assert ModelConfig.from_hf(config).context_len == 32768 and ModelConfig.from_hf(plain).context_len == 8192


# ---- the context and the KV pool ------------------------------------------------------------------------
def test_context_len_follows_the_rope_scaling():
    from types import SimpleNamespace

    from chatserve.models.config import trained_context_len

    def ctx(params, max_pos=4096, **extra):
        return trained_context_len(SimpleNamespace(max_position_embeddings=max_pos, rope_parameters=params, **extra))

    assert ctx({"rope_type": "default", "rope_theta": 1e4}) == 4096
    assert ctx(None) == 4096
    assert ctx({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960) == 131072  # Qwen3
    assert ctx({"rope_type": "yarn", "factor": 2.0}) == 8192  # (original: max_position_embeddings)
    assert ctx({"rope_type": "linear", "factor": 2.0}) == 8192
    assert ctx({"rope_type": "dynamic", "factor": 2.0}) == 8192
    assert ctx({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072) == 131072
    assert ctx({"rope_type": "longrope", "original_max_position_embeddings": 4096}, 131072) == 131072
    assert ctx({"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {}}, 131072) == 131072


def test_the_default_pool_grows_to_hold_max_model_len():
    assert EngineArgs().cache_config().min_pool_tokens == 0  # no max_model_len: the pool caps the default
    assert EngineArgs(max_model_len=32768).cache_config().min_pool_tokens == int(32768 * (1 + KV_POOL_HEADROOM))
    assert EngineArgs(max_model_len=32768, num_kv_blocks=64).cache_config().min_pool_tokens == 0  # explicit: as given
    assert EngineArgs(max_model_len=32768, kv_cache_memory_gb=0.1).cache_config().min_pool_tokens == 0


def test_past_the_trained_context_warns(tiny_checkpoint, caplog):
    """The tiny Llama is trained for 512 positions: 2048 warns, unless a YaRN override reaches it."""
    from chatserve import LLM

    folder = str(tiny_checkpoint("llama"))
    with caplog.at_level(logging.WARNING, logger="chatserve.models.config"):
        LLM(folder, dtype="float32", max_model_len=2048, num_kv_blocks=256)
    warned = [r.getMessage() for r in caplog.records if "trained for" in r.getMessage()]
    assert len(warned) == 1 and "max_model_len=2048 is past the 512 positions" in warned[0], warned
    assert '"rope_type": "yarn", "factor": 4' in warned[0]  # (what would reach it)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chatserve.models.config"):
        LLM(folder, dtype="float32", max_model_len=2048, num_kv_blocks=256,
            hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4}})
        LLM(folder, dtype="float32", num_kv_blocks=256)  # (the default max_model_len is the model's own)
    assert not [r for r in caplog.records if "trained for" in r.getMessage()]


def test_default_model_serves_32768_with_yarn_and_no_other_flag(caplog):
    """`chatserve serve --max-model-len 32768 --hf-overrides '{yarn x4 of 8192}'`: the engine those flags
    build starts (without the grown pool it refuses: the default budget holds fewer tokens) with the
    whole length and no warning, and answers."""
    from chatserve import LLM, SamplingParams

    flags = ["serve", "--max-model-len", "32768", "--hf-overrides", json.dumps({"rope_scaling": SMOL_YARN})]
    args = options_from_args(EngineArgs, parse_args(flags, environ={}))
    with caplog.at_level(logging.WARNING, logger="chatserve.models.config"):
        llm = LLM(**dataclasses.asdict(args))
    engine = llm.engine
    assert engine.max_model_len == 32768 and engine.max_model_len_note == ""
    assert engine.runner.pool.num_tokens >= 32768 * (1 + KV_POOL_HEADROOM)
    assert engine.input_processor.max_model_len == 32768
    assert engine.hf_config.rope_parameters["rope_type"] == "yarn"
    assert not [r for r in caplog.records if "trained for" in r.getMessage()]
    out = llm.generate(["The lighthouse keeper"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
