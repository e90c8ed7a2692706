"""Our streaming GGUF reader against transformers' ``load_gguf_checkpoint``: same names, bit-identical values."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from chatserve.models.gguf import iter_gguf_weights
from chatserve.models.gguf_header import read_gguf_header

gguf = pytest.importorskip("gguf")


def _hf_config(default_gguf: Path):
    """transformers' config class of the file, read from the run's converted metadata (the same
    values as transformers' own parse of the GGUF: tests/models/test_gguf_metadata_cache.py)."""
    from transformers import AutoConfig

    from chatserve.models.loader import gguf_metadata_folder, resolve_model

    return AutoConfig.from_pretrained(gguf_metadata_folder(resolve_model(default_gguf)))


def _skeleton(hf_config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


@pytest.fixture(scope="module")
def default_weights(default_gguf):
    """(config, {name: tensor}, seconds) from one pass of our reader over the default model, float32."""
    config = _hf_config(default_gguf)
    start = time.perf_counter()
    weights = dict(iter_gguf_weights(str(default_gguf), config, torch.float32))
    return config, weights, time.perf_counter() - start


def test_default_model_names_and_timing(default_weights):
    config, weights, seconds = default_weights
    print(f"\niter_gguf_weights over the default model: {seconds:.2f} s, {len(weights)} tensors")
    expected = set(_skeleton(config).state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # the GGUF stores no output.weight; the model ties it
    assert set(weights) == expected
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in weights.values())


def test_default_model_sample_matches_transformers_processor(default_gguf, default_weights):
    """A few tensors recomputed the way transformers does: GGUFReader + dequantize + LlamaTensorProcessor."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config, weights, _ = default_weights
    reader = gguf.GGUFReader(str(default_gguf))
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    wanted = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    seen = 0
    for tensor in reader.tensors:
        if tensor.name not in wanted:
            continue
        ref = processor.process(weights=gguf.dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        assert torch.equal(weights[wanted[tensor.name]], torch.from_numpy(np.copy(ref))), tensor.name
        seen += 1
    assert seen == len(wanted)


def test_header_matches_gguf_reader_on_tensor_table(default_gguf):
    import mmap

    with open(default_gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = read_gguf_header(buf)
        metadata = dict(header.metadata)
        tensors = header.tensors
    assert header.version == 3
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 30
    assert metadata["tokenizer.ggml.tokens"].count == 49152
    assert len(tensors) == 272
    assert tensors[0].name == "token_embd.weight" and tensors[0].shape == (49152, 576)


def test_default_model_identical_to_transformers(default_weights, hf_default):
    """Every name and value, against the model transformers builds from the same GGUF through its whole
    `load_gguf_checkpoint` path (the session's reference model: one transformers load for the run)."""
    config, weights, _ = default_weights
    model, _ = hf_default
    theirs = model.state_dict()
    expected = set(theirs)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # the model's tie of the embedding, not a tensor of the file
    assert set(weights) == expected
    for name, tensor in weights.items():
        assert theirs[name].dtype == torch.float32 and torch.equal(tensor, theirs[name]), name


# ---------------------------------------------------------------- tiny GGUFs written here

H, FF, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 40


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (the one we undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_config(arch: str):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    extra = {"head_dim": H // HEADS} if arch == "qwen3" else {}
    return cls(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        tie_word_embeddings=False,
        **extra,
    )


def _tiny_hf_weights(arch: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    hd = H // HEADS
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, H), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(H, dtype=np.float32),
        "lm_head.weight": rng.standard_normal((VOCAB, H), dtype=np.float32),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (HEADS * hd, H),
            "self_attn.k_proj": (KV_HEADS * hd, H),
            "self_attn.v_proj": (KV_HEADS * hd, H),
            "self_attn.o_proj": (H, HEADS * hd),
            "mlp.gate_proj": (FF, H),
            "mlp.up_proj": (FF, H),
            "mlp.down_proj": (H, FF),
        }
        for name, shape in shapes.items():
            w[f"{p}.{name}.weight"] = rng.standard_normal(shape, dtype=np.float32)
        w[f"{p}.input_layernorm.weight"] = rng.standard_normal(H, dtype=np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = rng.standard_normal(H, dtype=np.float32)
        if arch == "qwen2":
            for x in "qkv":
                w[f"{p}.self_attn.{x}_proj.bias"] = rng.standard_normal(shapes[f"self_attn.{x}_proj"][0], dtype=np.float32)
        if arch == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = rng.standard_normal(hd, dtype=np.float32)
            w[f"{p}.self_attn.k_norm.weight"] = rng.standard_normal(hd, dtype=np.float32)
    return w


_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, suffix = hf_name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}.{suffix}"


def _write_tiny_gguf(path: Path, arch: str, hf: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])  # a string array the header parser must skip
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_tensor("rope_freqs.weight", np.ones(H // HEADS // 2, dtype=np.float32))  # no HF counterpart
    for i, (name, w) in enumerate(hf.items()):
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, KV_HEADS)
        if w.ndim == 2 and i % 3 == 0:
            w = w.astype(np.float16)  # mix F16 and F32 tensors
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trips_and_matches_transformers(tmp_path, arch):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf = _tiny_hf_weights(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, arch, hf)
    config = _tiny_config(arch)

    ours = dict(iter_gguf_weights(str(path), config, torch.float32))
    assert set(ours) == set(hf)  # rope_freqs skipped, everything else named as in HF
    for name, w in hf.items():
        assert ours[name].shape == w.shape, name
        expected = torch.from_numpy(w)
        if ours[name].dtype != expected.dtype or not torch.equal(ours[name], expected):
            # F16-stored tensors lose precision; the un-permute must still land every row in place
            torch.testing.assert_close(ours[name], expected, rtol=1e-3, atol=1e-3, msg=name)

    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=_skeleton(config), torch_dtype=torch.float32)
    ref = ref["tensors"]
    assert list(ours) == list(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)

    half = dict(iter_gguf_weights(str(path), config, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, ours[k].to(torch.bfloat16)) for k, t in half.items())


def test_unsupported_architecture_fails_clearly(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        next(iter_gguf_weights(str(path), _tiny_config("llama"), torch.float32))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        next(iter_gguf_weights(str(path), _tiny_config("llama"), torch.float32))
