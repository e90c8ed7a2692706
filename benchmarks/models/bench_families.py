#!/usr/bin/env python3
"""Decode batch 1 and a 1,000-token prefill on ~1B random-weight models of each dense family (#33).

    python benchmarks/models/bench_families.py                       # gemma2, gemma3, phi3; Q4_0 GGUF files in /tmp
    python benchmarks/models/bench_families.py --families phi3 --type q8_0 --runs 5

Each family's file is written once (random normal weights, std 1/sqrt(fan-in), fixed seed) the way
llama.cpp's converter names and keys it (tests/helpers/tiny_families.py write_family_gguf), with
SmolLM2's tokenizer (vocabulary 49,152), so llama.cpp can run the same file. Shapes are the real
models' shapes shrunk to ~1B parameters (the vocabulary is SmolLM2's, not the families' 256k):

- gemma2: hidden 2048, 16 layers, 8 heads of 256 (4 KV), FFN 8192, window 4096, soft-caps 50 / 30;
- gemma3: Gemma 3 1B's shape (hidden 1152, 26 layers, 4 heads of 256, 1 KV, FFN 6912, window 512);
- phi3: hidden 2048, 16 layers, 16 heads of 128 (8 KV), FFN 8192, window 2047, partial rotary 3/4.

Prints one JSON line per family: load seconds, prefill seconds for 1,000 tokens and decode tokens/s
at batch 1 (median of --runs alternated runs, prefix cache reset before each prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TYPES = {"q4_0": 2, "q8_0": 8, "f32": 0}

SHAPES = {
    "gemma2": dict(hidden=2048, layers=16, heads=8, kv=4, head_dim=256, ffn=8192, window=4096),
    "gemma3": dict(hidden=1152, layers=26, heads=4, kv=1, head_dim=256, ffn=6912, window=512),
    "phi3": dict(hidden=2048, layers=16, heads=16, kv=8, head_dim=128, ffn=8192, window=2047),
}


def config_of(family: str, vocab: int):
    import transformers

    s = SHAPES[family]
    common = dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv"], max_position_embeddings=4096,
                  sliding_window=s["window"])
    if family == "gemma2":
        return transformers.Gemma2Config(head_dim=s["head_dim"], query_pre_attn_scalar=s["head_dim"], **common)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(head_dim=s["head_dim"], query_pre_attn_scalar=s["head_dim"], **common)
    return transformers.Phi3Config(tie_word_embeddings=False, partial_rotary_factor=0.75,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                                   **common)


class RandomWeights:
    """A stand-in for a transformers model: its config and a lazily generated state dict."""

    def __init__(self, family: str, config, seed: int = 0) -> None:
        self.family, self.config, self.rng = family, config, np.random.default_rng(seed)

    def state_dict(self):
        return SimpleNamespace(items=self._items)

    def _items(self):
        import torch

        c = self.config
        h, hd = c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q, kv, ffn = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size

        def w(n, k):
            return torch.from_numpy((self.rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32))

        def norm(n):
            return torch.from_numpy((0.1 * self.rng.standard_normal(n)).astype(np.float32) + (0.0 if self.family != "phi3" else 1.0))

        yield "model.embed_tokens.weight", w(c.vocab_size, h)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            if self.family == "phi3":
                yield f"{p}.self_attn.qkv_proj.weight", w(q + 2 * kv, h)
                yield f"{p}.mlp.gate_up_proj.weight", w(2 * ffn, h)
            else:
                yield f"{p}.self_attn.q_proj.weight", w(q, h)
                yield f"{p}.self_attn.k_proj.weight", w(kv, h)
                yield f"{p}.self_attn.v_proj.weight", w(kv, h)
                yield f"{p}.mlp.gate_proj.weight", w(ffn, h)
                yield f"{p}.mlp.up_proj.weight", w(ffn, h)
                yield f"{p}.pre_feedforward_layernorm.weight", norm(h)
                yield f"{p}.post_feedforward_layernorm.weight", norm(h)
            if self.family == "gemma3":
                yield f"{p}.self_attn.q_norm.weight", norm(hd)
                yield f"{p}.self_attn.k_norm.weight", norm(hd)
            yield f"{p}.self_attn.o_proj.weight", w(h, q)
            yield f"{p}.mlp.down_proj.weight", w(h, ffn)
            yield f"{p}.input_layernorm.weight", norm(h)
            yield f"{p}.post_attention_layernorm.weight", norm(h)
        yield "model.norm.weight", norm(h)
        if not c.tie_word_embeddings:
            yield "lm_head.weight", w(c.vocab_size, h)


def param_count(family: str, c) -> int:
    """Matrix parameters of the shape (norms are a rounding error): what "~1B" counts."""
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * layer + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--dir", default="/tmp", help="where the GGUF files are written (reused when present)")
    ap.add_argument("--prefill", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=32, help="tokens per decode run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--llamacpp", default="", metavar="PYTHON", help="also run benchmarks/peers/llamacpp_bench.py on each file "
                    "under this interpreter (e.g. .venv-llamacpp/bin/python), right after chatserve: one run, side by side")
    ap.add_argument("--gguf", nargs="*", default=[], help="also measure these files the same way (e.g. the Llama-shaped "
                    "1B of benchmarks/models/make_random_gguf.py, as a baseline)")
    args = ap.parse_args()

    from chatserve import LLM, SamplingParams
    from chatserve.models.loader import default_model_path
    from tests.helpers.tiny_families import write_family_gguf
    from tests.helpers.tiny_gguf import _tokenizer_fields

    default = default_model_path()
    vocab = len(_tokenizer_fields(default)["tokenizer.ggml.tokens"])
    jobs = [(f, Path(args.dir, f"chatserve-bench-{f}-1b-{args.type}.gguf")) for f in args.families]
    jobs += [("file", Path(g)) for g in args.gguf]
    for family, path in jobs:
        config = config_of(family, vocab) if family != "file" else None
        if config is not None and not path.exists():
            t0 = time.perf_counter()
            write_family_gguf(path, family, RandomWeights(family, config), default, TYPES[args.type])
            print(f"# wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        llm = LLM(model=str(path), max_model_len=2048)
        load_s = time.perf_counter() - t0
        params = param_count(family, config) if config is not None else 0
        rng = np.random.default_rng(1)
        prompt = rng.integers(100, vocab - 100, args.prefill).tolist()
        short = rng.integers(100, vocab - 100, 8).tolist()
        prefill, decode = [], []
        llm.generate({"prompt_token_ids": short}, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(args.runs):  # alternated: a prefill, then a decode run
            llm.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, ignore_eos=True))
            prefill.append(time.perf_counter() - t0)
            llm.engine.reset_prefix_cache()
            llm.generate({"prompt_token_ids": short}, SamplingParams(max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": short}, SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True))
            decode.append(args.decode / (time.perf_counter() - t0))
        print(json.dumps({
            "family": family if config is not None else path.name, "type": args.type if config is not None else "",
            "params_b": round(params / 1e9, 3),
            "file_gb": round(path.stat().st_size / 1e9, 2), "load_s": round(load_s, 1),
            f"prefill_{args.prefill}_s": round(statistics.median(prefill), 2),
            "decode_tok_s": round(statistics.median(decode), 2), "runs": args.runs,
            "ops": llm.engine_info().kernels,
        }), flush=True)
        del llm
        if args.llamacpp:
            print(json.dumps({"family": family if config is not None else path.name,
                              **llamacpp_numbers(args.llamacpp, path, args)}), flush=True)
    return 0


def llamacpp_numbers(python: str, path: Path, args: argparse.Namespace) -> dict:
    """llama.cpp on the same file, the same token ids and the same run counts (benchmarks/peers/llamacpp_bench.py)."""
    import subprocess

    cmd = [python, os.path.join(ROOT, "benchmarks", "peers", "llamacpp_bench.py"), str(path), "--prefill", str(args.prefill),
           "--decode", str(args.decode), "--runs", str(args.runs), "--threads", str(getattr(args, "threads", 2))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return {"engine": "llama.cpp", "error": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
