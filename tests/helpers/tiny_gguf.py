"""Tiny llama GGUF files in any quantized type, written by the tests themselves.

hidden 256 (so K-quants' 256-value blocks fit), 2 layers, 4 heads of 64 (2 KV heads), FFN 512,
tied embeddings, and the real SmolLM2 tokenizer copied from the default model's metadata (so the
engine loads them like any GGUF; the vocabulary is therefore 49,152). Types gguf's numpy quantizer
implements (Q4_0, Q4_1, Q5_0, Q8_0, ...) quantize random normal weights; for Q4_K and Q6_K, which
it cannot quantize, each block is built directly: random quants and scales with small finite fp16
super-block scales, which is all a valid block is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

H, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-shaped model's sizes (the tests' tiny one by default; benchmarks/models/make_random_gguf.py
    writes 1B-class ones with the same code)."""

    hidden: int = H
    ffn: int = FF
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    layers: int = LAYERS
    context: int = 512

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14


@functools.lru_cache(maxsize=1)
def _tokenizer_fields(default_gguf: str) -> dict:
    """The default model's `tokenizer.*` metadata as Python values (what `gguf.GGUFReader`'s
    `contents()` gives, read by our header parser in ~0.2 s instead of ~4 s)."""
    import mmap

    from chatserve.models.gguf_header import GGUFArray, read_array, read_gguf_header

    with open(default_gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = read_gguf_header(buf)
        return {k: read_array(buf, v) if isinstance(v, GGUFArray) else v
                for k, v in header.metadata.items() if k.startswith("tokenizer.")}


def add_default_tokenizer(writer, default_gguf: str) -> None:
    """The default model's tokenizer (vocabulary, merges, special ids, chat template) and vocab size,
    as every test GGUF carries it, so the engine loads the file like any GGUF."""
    fields = _tokenizer_fields(default_gguf)
    writer.add_vocab_size(len(fields["tokenizer.ggml.tokens"]))
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(fields["tokenizer.chat_template"])


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks of a K-quant: random bytes, small finite fp16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    if qtype == Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        # scales and mins below 16, so the 12 bytes are simply sc[0:4], m[0:4], sc[4:8] | m[4:8] << 4;
        # m ~ sc * 7.5 / 8 with dmin = 8 d centres each sub-block's values (d * sc * q - dmin * m) on 0
        d = np.abs(rng.normal(1e-3, 2e-4, len(blocks))).astype(np.float16)
        sc = rng.integers(1, 16, size=(len(blocks), 8))
        m = np.clip(np.rint(sc * 7.5 / 8 + rng.normal(0, 0.5, sc.shape)), 0, 15).astype(np.int64)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (d.astype(np.float32) * 8).astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 4:8] = sc[:, :4]
        blocks[:, 8:12] = m[:, :4]
        blocks[:, 12:16] = sc[:, 4:] | (m[:, 4:] << 4)
    elif qtype == Q6_K:  # 128 bytes low bits, 64 bytes high bits, 16 int8 scales, d (fp16)
        blocks[:, 208:210] = np.abs(rng.normal(6e-5, 1e-5, (len(blocks), 1))).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"random_blocks builds K-quant blocks only, not ggml type {qtype}")
    return blocks.reshape(n, -1)


def _tensor(writer, name: str, qtype: int, shape: tuple[int, int], rng: np.random.Generator, std: float) -> None:
    import gguf

    t = gguf.GGMLQuantizationType(qtype)
    if qtype in (Q4_K, Q6_K):
        writer.add_tensor(name, random_blocks(qtype, *shape, rng), raw_dtype=t)
        return
    w = rng.normal(0, std, shape).astype(np.float32)
    if qtype in (0, 1):  # F32, F16
        writer.add_tensor(name, w if qtype == 0 else w.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(w, t), raw_dtype=t)


def write_tiny_gguf(path: Path, default_gguf: str, types: dict[str, int], default_type: int, seed: int = 0,
                    shape: LlamaShape = LlamaShape()) -> Path:
    """A tied llama of `shape` (tiny by default) at `path`; `types` maps a tensor kind (token_embd,
    attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down) to its ggml type, others take
    `default_type`."""
    import gguf

    H, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = (shape.hidden, shape.ffn, shape.heads, shape.kv_heads,  # noqa: N806
                                               shape.head_dim, shape.layers)

    rng = np.random.default_rng(seed)
    fields = _tokenizer_fields(default_gguf)
    vocab = len(fields["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    add_default_tokenizer(writer, default_gguf)
    writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(fields["tokenizer.ggml.add_bos_token"])

    def kind(name: str) -> int:
        return types.get(name, default_type)

    _tensor(writer, "token_embd.weight", kind("token_embd"), (vocab, H), rng, 0.5 * (256 / H) ** 0.5)
    shapes = {"attn_q": (HEADS * HEAD_DIM, H), "attn_k": (KV_HEADS * HEAD_DIM, H), "attn_v": (KV_HEADS * HEAD_DIM, H),
              "attn_output": (H, HEADS * HEAD_DIM), "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + rng.normal(0, 0.1, H)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + rng.normal(0, 0.1, H)).astype(np.float32))
        for name, dims in shapes.items():
            _tensor(writer, f"blk.{i}.{name}.weight", kind(name), dims, rng, 0.08 * (256 / H) ** 0.5)
    writer.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, H)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
