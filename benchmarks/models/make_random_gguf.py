#!/usr/bin/env python3
"""Write a Llama-shaped GGUF with random weights, to measure how cost grows with model size (#30).

    python benchmarks/models/make_random_gguf.py --type q4_0 --out /tmp/llama-1b-q4_0.gguf     # ~1.1B, Llama-3.2-1B-like
    python benchmarks/models/make_random_gguf.py --type q8_0 --out /tmp/llama-1b-q8_0.gguf
    python benchmarks/models/make_random_gguf.py --hidden 1024 --layers 8 --ffn 4096 --type q4_0 --out small.gguf

The default shape is 1B-class (hidden 2048, 16 layers, 32 heads of 64 with 8 KV heads, FFN 8192, tied
embeddings): about 1.07B parameters. The tokenizer (vocabulary 49,152) and chat template are copied
from the default model's GGUF, so chatserve and llama.cpp load the file like any other. Weights are
normal with std ~ 1/sqrt(hidden) (fixed seed), quantised by the `gguf` package's numpy quantiser; the
text it generates is noise, which is all a speed measurement needs (benchmarks ignore EOS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.helpers.tiny_gguf import LlamaShape, write_tiny_gguf  # noqa: E402

TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "f16": 1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf to write")
    p.add_argument("--type", choices=sorted(TYPES), default="q4_0", help="ggml type of every matrix (embedding too)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_common as bc

    shape = LlamaShape(hidden=args.hidden, ffn=args.ffn, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, layers=args.layers, context=args.context)
    t0 = time.perf_counter()
    out = write_tiny_gguf(Path(args.out), bc.resolve_model(None).path, {}, TYPES[args.type], seed=args.seed, shape=shape)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.0f} MiB, {args.type}, {shape}) in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
