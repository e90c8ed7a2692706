#!/usr/bin/env python3
"""Write a Llama-shaped GGUF with random weights: the models people run on CPUs, at their real sizes (#30, #57).

    python benchmarks/models/make_random_gguf.py --preset llama-3.2-1b --type q4_0 --out /tmp/llama-3.2-1b-q4_0.gguf
    python benchmarks/models/make_random_gguf.py --preset llama-3.2-3b --type q8_0 --out /tmp/llama-3.2-3b-q8_0.gguf
    python benchmarks/models/make_random_gguf.py --preset llama-3.1-8b --type q4_0 --out /tmp/llama-3.1-8b-q4_0.gguf
    python benchmarks/models/make_random_gguf.py --hidden 1024 --layers 8 --ffn 4096 --type q4_0 --out small.gguf

Presets copy the real configs' sizes: hidden size, layers, heads, KV heads (GQA), head dim, FFN, the
128,256-token vocabulary, tied embeddings (3.2) or a separate output matrix (3.1 8B), rope theta
500,000 and the llama3 rope scaling (written as llama.cpp's converter writes it: a `rope_freqs.weight`
tensor of per-frequency factors). Every matrix is in the one `--type` (a "pure" file: llama-quantize
would put the output matrix in Q6_K), norms in F32.

The tokenizer is SmolLM2's (the default model's vocabulary, merges, special ids and chat template),
padded to the model's vocabulary with unreachable normal tokens `[unused_N]` (no merge produces
them), so the embedding and output matrices have the real 128,256 rows (what decode reads per token)
while every engine tokenizes real text. The text generated is noise, which is all a speed
measurement needs (benchmarks ignore EOS).

Written tensor by tensor (the header first, then each tensor's bytes as it is made), never the whole
model in memory: each quantized matrix is random blocks made directly (random 4- or 8-bit quants and
an fp16 scale per block, chosen so the weights have std ~ 0.5/sqrt(fan-in)): valid Q4_0/Q8_0 blocks, at
disk speed (an 8B Q4_0 file in about a minute) where quantizing float32 with numpy would take hours.
Without `--preset`, the shape flags give the older 1B-class default (SmolLM2's 49,152-token vocabulary).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# ggml type ids and the GGUF file types (general.file_type) of "mostly" that type
TYPES = {"q4_0": 2, "q8_0": 8}
FILE_TYPES = {2: 2, 8: 7}
# block layout: values per block, bytes per block, std of the integer quant (uniform random)
_BLOCKS = {2: (32, 18, math.sqrt((16**2 - 1) / 12)), 8: (32, 34, math.sqrt((256**2 - 1) / 12))}
PAD_TOKEN = "[unused_{}]"


@dataclass(frozen=True)
class Llama3Rope:
    """transformers' `rope_scaling` of type llama3 (Llama 3.1 / 3.2)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def freq_factors(self, head_dim: int, theta: float) -> np.ndarray:
        """The per-frequency divisors llama.cpp reads from `rope_freqs.weight` (its converter's formula)."""
        freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        low_wavelen = self.original_context / self.low_freq_factor
        high_wavelen = self.original_context / self.high_freq_factor
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.factor)
            else:
                smooth = (self.original_context / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                out.append(1 / ((1 - smooth) / self.factor + smooth))
        return np.asarray(out, dtype=np.float32)


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture model's sizes and rope: what the GGUF header says and the tensors' shapes."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    context: int
    tied: bool
    rope_theta: float = 500000.0
    rope: Llama3Rope | None = None
    rms_eps: float = 1e-5

    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


# The real configs (config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B)
PRESETS = {
    "llama-3.2-1b": ModelShape("Llama-3.2-1B (random)", hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64,
                               layers=16, vocab=128256, context=131072, tied=True, rope=Llama3Rope(32.0)),
    "llama-3.2-3b": ModelShape("Llama-3.2-3B (random)", hidden=3072, ffn=8192, heads=24, kv_heads=8, head_dim=128,
                               layers=28, vocab=128256, context=131072, tied=True, rope=Llama3Rope(32.0)),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B (random)", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128,
                               layers=32, vocab=128256, context=131072, tied=False, rope=Llama3Rope(8.0)),
}


def tiny(shape: ModelShape, vocab: int) -> ModelShape:
    """The same family at test size (tied or not, its rope scaling and head-dim ratio kept): for tests."""
    return replace(shape, name=shape.name + " tiny", hidden=2 * shape.head_dim, ffn=256, heads=2,
                   kv_heads=1 if shape.kv_heads < shape.heads else 2, layers=2, vocab=vocab, context=2048)


def random_quant_blocks(qtype: int, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of valid Q4_0 / Q8_0 blocks: random quants, fp16 scales near std / quant std."""
    per, nbytes, qstd = _BLOCKS[qtype]
    if cols % per:
        raise ValueError(f"cols={cols} is not a multiple of the {per}-value block")
    nblocks = rows * cols // per
    blocks = np.frombuffer(rng.bytes(nblocks * nbytes), dtype=np.uint8).reshape(nblocks, nbytes).copy()
    scale = (std / qstd) * (1 + 0.1 * rng.standard_normal(nblocks, dtype=np.float32))
    blocks[:, 0:2] = np.abs(scale).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    return blocks.reshape(rows, -1)


def tokenizer_metadata(writer, tokenizer_gguf: str, vocab: int) -> None:
    """SmolLM2's tokenizer from `tokenizer_gguf`, padded with `[unused_N]` normal tokens to `vocab`."""
    from tests.helpers.tiny_gguf import _tokenizer_fields

    fields = _tokenizer_fields(tokenizer_gguf)
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    if vocab < len(tokens):
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    tokens += [PAD_TOKEN.format(i) for i in range(pad)]
    types += [1] * pad  # NORMAL: reachable by no merge, decoded as their text
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    for key, add in (("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
                     ("tokenizer.ggml.add_bos_token", writer.add_add_bos_token)):
        if key in fields:
            add(fields[key])
    writer.add_chat_template(fields["tokenizer.chat_template"])


def write_llama_gguf(path: Path, shape: ModelShape, qtype: int, tokenizer_gguf: str, seed: int = 0) -> Path:
    """`shape` with random `qtype` (Q4_0 or Q8_0) matrices at `path`, one tensor in memory at a time."""
    import gguf

    if qtype not in _BLOCKS:
        raise ValueError(f"type must be Q4_0 or Q8_0 (ggml {sorted(_BLOCKS)}), not {qtype}")
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType(qtype)
    per, nbytes, _ = _BLOCKS[qtype]
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    # (name, kind, shape (out, in), std): kind "q" a quantized matrix, "norm" F32 ones-ish, "rope" F32 factors
    plan: list[tuple[str, str, tuple[int, ...], float]] = [("token_embd.weight", "q", (shape.vocab, h), 0.5 / math.sqrt(h))]
    if not shape.tied:
        plan.append(("output.weight", "q", (shape.vocab, h), 0.5 / math.sqrt(h)))
    plan.append(("output_norm.weight", "norm", (h,), 0.0))
    if shape.rope is not None:
        plan.append(("rope_freqs.weight", "rope", (shape.head_dim // 2,), 0.0))
    mats = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (shape.ffn, h), "ffn_up": (shape.ffn, h), "ffn_down": (h, shape.ffn)}
    for i in range(shape.layers):
        plan.append((f"blk.{i}.attn_norm.weight", "norm", (h,), 0.0))
        plan.append((f"blk.{i}.ffn_norm.weight", "norm", (h,), 0.0))
        plan += [(f"blk.{i}.{m}.weight", "q", dims, 0.5 / math.sqrt(dims[1])) for m, dims in mats.items()]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(shape.name)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    tokenizer_metadata(writer, tokenizer_gguf, shape.vocab)
    for name, kind, dims, _ in plan:
        if kind == "q":
            rows, cols = dims
            writer.add_tensor_info(name, (rows, cols // per * nbytes), np.dtype(np.uint8), rows * cols // per * nbytes,
                                   raw_dtype=qt)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, kind, dims, std in plan:
        if kind == "q":
            data = random_quant_blocks(qtype, dims[0], dims[1], std, rng)
        elif kind == "norm":
            data = (1 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32)
        else:
            data = shape.rope.freq_factors(shape.head_dim, shape.rope_theta)  # type: ignore[union-attr]
        writer.write_tensor_data(data)
        del data
    writer.close()
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf to write")
    p.add_argument("--type", choices=sorted(TYPES), default="q4_0", help="ggml type of every matrix (embedding too)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape (overrides the shape flags)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=49152, help="without --preset (at least SmolLM2's 49,152)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_common as bc

    if args.preset:
        shape = PRESETS[args.preset]
    else:
        shape = ModelShape(f"random llama h{args.hidden} l{args.layers}", hidden=args.hidden, ffn=args.ffn,
                           heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, layers=args.layers,
                           vocab=args.vocab, context=args.context, tied=True, rope_theta=10000.0)
    t0 = time.perf_counter()
    out = write_llama_gguf(Path(args.out), shape, TYPES[args.type], bc.resolve_model(None).path, seed=args.seed)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.0f} MiB, {args.type}, {shape.params() / 1e9:.2f}B params, {shape.name}) "
          f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
