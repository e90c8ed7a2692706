"""Llama 3.1+ GGUF files carry their llama3 rope scaling only as the tensor `rope_freqs` (llama.cpp's
converter writes no metadata for it). chatserve reads it into `rope_freq_factors` and divides the
default frequencies by it, as llama.cpp does: the rotary tables then equal transformers' llama3
rope for the checkpoint's own `rope_scaling`, on a first start and on a warm one (the saved config),
and the KV fingerprint's rope identity tells such a file from the same file without the tensor."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import REPO_ROOT

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def writer():
    path = REPO_ROOT / "benchmarks" / "models" / "make_random_gguf.py"
    name = "_test_rope_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def files(writer, tmp_path_factory):
    """A tiny Llama-3.2-1B-shaped Q8_0 file with rope_freqs, and the same shape without rope scaling."""
    from chatserve.models.loader import default_model_path

    folder = tmp_path_factory.mktemp("rope-freqs")
    real = writer.PRESETS["llama-3.2-1b"]
    shape = writer.tiny(real, vocab=SMOLLM2_VOCAB + 40)
    scaled = writer.write_llama_gguf(folder / "scaled.gguf", shape, writer.TYPES["q8_0"], default_model_path())
    plain = writer.write_llama_gguf(folder / "plain.gguf", replace(shape, rope=None), writer.TYPES["q8_0"], default_model_path())
    return real, shape, Path(scaled), Path(plain), folder


def _config(path: Path, cache: Path):
    from chatserve.models.loader import load_hf_config, resolve_model

    return load_hf_config(resolve_model(str(path), cache_dir=cache))


def _transformers_llama3(real, shape):
    """transformers' inverse frequencies for the checkpoint's own rope_scaling (Llama 3.2's)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = real.rope
    config = LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                         max_position_embeddings=shape.context, rope_theta=real.rope_theta,
                         rope_scaling={"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                                       "high_freq_factor": rope.high_freq_factor,
                                       "original_max_position_embeddings": rope.original_context})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    return inv_freq.float(), scaling


def test_rope_freqs_give_transformers_llama3_rope(files, tmp_path):
    from chatserve.layers.rotary import RotaryEmbedding, rope_inv_freq

    real, shape, scaled, plain, _ = files
    config = _config(scaled, tmp_path / "cache")
    assert len(config.rope_freq_factors) == shape.head_dim // 2
    ours, scaling = rope_inv_freq(config, shape.head_dim)
    theirs, their_scaling = _transformers_llama3(real, shape)
    assert scaling == their_scaling == 1.0
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    default, _ = rope_inv_freq(_config(plain, tmp_path / "cache"), shape.head_dim)
    assert not hasattr(_config(plain, tmp_path / "cache"), "rope_freq_factors")
    assert (default / ours).max().item() == pytest.approx(real.rope.factor, rel=1e-5)  # the slow frequencies scaled
    assert torch.equal(default[:4], ours[:4])  # the fast ones untouched

    # the tables the model rotates with: far positions differ from the unscaled rope, as they should
    table = RotaryEmbedding(config, shape.head_dim, 2048)
    pos = torch.arange(2048, dtype=torch.float32)
    expected = torch.cat([torch.outer(pos, theirs)] * 2, dim=-1).cos()
    torch.testing.assert_close(table.cos_cache, expected, rtol=0, atol=2e-4)


def test_a_warm_start_reads_the_same_factors(files, tmp_path):
    """The second start reads the saved config (no transformers): the same factors, the same rope."""
    from chatserve.layers.rotary import rope_inv_freq
    from chatserve.models.saved_config import SavedConfig

    _, shape, scaled, _, _ = files
    cache = tmp_path / "cache"
    first = _config(scaled, cache)
    second = _config(scaled, cache)
    assert isinstance(second, SavedConfig) and not isinstance(first, SavedConfig)
    assert second.rope_freq_factors == first.rope_freq_factors
    assert torch.equal(rope_inv_freq(second, shape.head_dim)[0], rope_inv_freq(first, shape.head_dim)[0])


def test_the_kv_fingerprint_tells_the_scaled_file_from_the_plain_one(files, tmp_path):
    from chatserve.models.llama import resolved_rope

    _, shape, scaled, plain, _ = files
    a = resolved_rope(_config(scaled, tmp_path / "cache"), shape.head_dim, 2048)
    b = resolved_rope(_config(plain, tmp_path / "cache"), shape.head_dim, 2048)
    assert a["parameters"] == b["parameters"] and a["inv_freq_sha256"] != b["inv_freq_sha256"]


def test_an_explicit_rope_scaling_replaces_the_files_factors(files, tmp_path):
    """--hf-overrides with a rope scaling: the user's scaling, not the file's factors."""
    from chatserve.layers.rotary import rope_inv_freq
    from chatserve.models.loader import load_hf_config, resolve_model

    real, shape, scaled, _, _ = files
    source = resolve_model(str(scaled), cache_dir=tmp_path / "cache")
    rope = real.rope
    override = {"rope_scaling": {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                                 "high_freq_factor": rope.high_freq_factor,
                                 "original_max_position_embeddings": rope.original_context}}
    config = load_hf_config(source, hf_overrides=override)
    ours, _ = rope_inv_freq(config, shape.head_dim)
    theirs, _ = _transformers_llama3(real, shape)
    torch.testing.assert_close(ours, theirs)  # transformers' own llama3 path, not divided a second time


def test_a_malformed_tensor_is_refused(writer, files, tmp_path):
    """A rope_freqs of the wrong length: a start-up error naming the tensor, not a silent rope."""
    import numpy as np

    from chatserve.models import gguf_families
    from chatserve.models.gguf_header import read_gguf_header

    _, shape, scaled, _, _ = files
    import mmap

    class Config:
        hidden_size, num_attention_heads, head_dim = shape.hidden, shape.heads, shape.head_dim
        rope_parameters = {"rope_type": "default"}

    with open(scaled, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = read_gguf_header(buf)
        cfg = Config()
        gguf_families._complete_rope_freqs(cfg, header, buf, "llama")
        assert np.allclose(cfg.rope_freq_factors, real_factors(writer, shape))
        header.metadata["llama.rope.dimension_count"] = 2 * shape.head_dim  # twice the rotated pairs the tensor has
        with pytest.raises(ValueError, match="rope_freqs"):
            gguf_families._complete_rope_freqs(cfg, header, buf, "llama")
        header.metadata["llama.rope.dimension_count"] = shape.head_dim
        cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0}
        with pytest.raises(ValueError, match="rope_freqs"):
            gguf_families._complete_rope_freqs(cfg, header, buf, "llama")


def real_factors(writer, shape):
    return shape.rope.freq_factors(shape.head_dim, shape.rope_theta)
