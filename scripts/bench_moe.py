#!/usr/bin/env python3
"""Decode (batch 1) and prefill (1,000 tokens) speed of a ~1B-parameter mixture-of-experts model (#33).

    python scripts/bench_moe.py --out /tmp/qwen3moe-1b-q8_0.gguf            # write the file once, then measure
    python scripts/bench_moe.py --out /tmp/qwen3moe-1b-q8_0.gguf --runs 3   # the file exists: measure only

The model is Qwen3-MoE-shaped (llama.cpp architecture `qwen3moe`, so llama.cpp loads the same file):
hidden 1024, 16 layers, 16 heads of 64 with 4 KV heads, q/k norms, 8 experts of width 2816 per layer
and 2 of them per token: about 1.2B parameters in all, ~0.36B active per token. Weights are random
normal (fixed seed) in the chosen ggml type (router and norms F32, as llama.cpp's converter leaves
them); the tokenizer is the default model's. The text is noise, which is all a speed measurement
needs (EOS is ignored).

Measured: decode tokens/s of one stream (64 tokens after a 16-token prompt) and prefill tokens/s of
a 1,000-token prompt (time to its first token), each the median of `--runs` alternated runs, through
`LLM` in-process with the default kernel tier and `quantization="auto"` (the file's blocks kept).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TYPES = {"q4_0": 2, "q8_0": 8, "f16": 1}


def write_random_moe_gguf(path: Path, default_gguf: str, *, hidden: int, layers: int, heads: int, kv_heads: int,
                          head_dim: int, experts: int, used: int, expert_ffn: int, qtype: int, seed: int = 0) -> Path:
    import gguf

    from tests.helpers.tiny_gguf import _tokenizer_fields

    rng = np.random.default_rng(seed)
    fields = _tokenizer_fields(default_gguf)
    vocab = len(fields["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("random-qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(expert_ffn)
    w.add_expert_feed_forward_length(expert_ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_vocab_size(vocab)
    for key, add in (("tokenizer.ggml.model", w.add_tokenizer_model), ("tokenizer.ggml.pre", w.add_tokenizer_pre),
                     ("tokenizer.ggml.tokens", w.add_token_list), ("tokenizer.ggml.token_type", w.add_token_types),
                     ("tokenizer.ggml.merges", w.add_token_merges), ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id), ("tokenizer.chat_template", w.add_chat_template)):
        add(fields[key])
    t = gguf.GGMLQuantizationType(qtype)

    def matmul(name: str, shape: tuple[int, ...], fan_in: int) -> None:
        a = rng.standard_normal(shape, dtype=np.float32) * fan_in**-0.5
        if qtype == 1:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matmul("token_embd.weight", (vocab, hidden), 1)
    norm("output_norm.weight", hidden)
    matmul("output.weight", (vocab, hidden), hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        matmul(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), heads * head_dim)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((experts, hidden)) * hidden**-0.5).astype(np.float32))
        matmul(f"blk.{i}.ffn_gate_exps.weight", (experts, expert_ffn, hidden), hidden)
        matmul(f"blk.{i}.ffn_up_exps.weight", (experts, expert_ffn, hidden), hidden)
        matmul(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, expert_ffn), expert_ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf to measure (written first where missing)")
    p.add_argument("--type", choices=sorted(TYPES), default="q8_0")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=2816)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    args = p.parse_args()

    out = Path(args.out)
    if not out.exists():
        from chatserve.models.loader import default_model_path

        t0 = time.perf_counter()
        write_random_moe_gguf(out, default_model_path(), hidden=args.hidden, layers=args.layers, heads=16, kv_heads=4,
                              head_dim=64, experts=args.experts, used=args.used, expert_ffn=args.expert_ffn,
                              qtype=TYPES[args.type])
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)

    from chatserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(out), max_model_len=2048, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    cfg = llm.engine.model_config
    model = llm.engine.runner.model
    total = sum(p.numel() for p in model.parameters())  # plain parameters left (norms, router, embeddings)
    print(f"loaded in {load_s:.1f} s: {cfg.architecture}, {cfg.num_layers} layers, MoE {cfg.moe}; "
          f"{llm.engine.runner.ops.describe()}; {total / 1e6:.0f}M plain parameters besides the packed matmuls", flush=True)

    rng = np.random.default_rng(1)
    decode_prompt = [int(t) for t in rng.integers(200, 40000, 16)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": decode_prompt}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
    decode_tps, prefill_tps = [], []
    for run in range(args.runs):  # alternated: decode, prefill, decode, prefill ...
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": decode_prompt}, prefill)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": decode_prompt}, decode)
        decode_tps.append((args.decode_tokens - 1) / (time.perf_counter() - t0 - first))
        prompt = [int(t) for t in np.random.default_rng(100 + run).integers(200, 40000, args.prefill_tokens)]
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, prefill)
        prefill_tps.append(args.prefill_tokens / (time.perf_counter() - t0))
        print(f"run {run}: decode {decode_tps[-1]:.1f} tok/s, prefill {prefill_tps[-1]:.0f} tok/s", flush=True)
    print(f"median of {args.runs}: decode batch 1 {statistics.median(decode_tps):.1f} tok/s, "
          f"prefill {args.prefill_tokens} tokens {statistics.median(prefill_tps):.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
