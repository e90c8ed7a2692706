"""Attention time per layer on the CPU backends, for the default model's shapes (9 heads, 3 KV heads, head_dim 64).

Cases: a 1,000-token prefill (one extend from position 0), the same prompt extended in 96-token
chunks over its cached prefix, and decode at batch 32 over ~500-token contexts (plain, and 8 decoders
sharing an 800-token cached prefix, the cascade case). Each case times `backend.forward` (K/V store
included) with the metadata prepared once, as a model step does.

    python benchmarks/kernels/bench_attention.py [--backend cpu|torch] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from chatserve.attention import select_attention_backend
from chatserve.attention.base import BatchLayout, slots_of
from chatserve.kernels.cpu import load_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _time(fn, repeat: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _case(backend, layout: BatchLayout, positions_per_seq: list[list[int]], tables: list[list[int]], cache, repeat: int) -> float:
    k_cache, v_cache = cache
    slots = []
    for table, positions in zip(tables, positions_per_seq):
        slots.extend(slots_of(table, positions[0], positions[-1] + 1, BLOCK))
    t = len(slots)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv = torch.randn(t, 2 * KV_HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16).view(t, 2 * KV_HEADS, HEAD_DIM)
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    meta = backend.prepare(layout, torch.device("cpu"))
    return _time(lambda: backend.forward(q, k, v, k_cache, v_cache, slot_mapping, meta, HEAD_DIM**-0.5), repeat)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cpu", choices=["cpu", "torch"])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    kernels = load_cpu_kernels() if args.backend == "cpu" else None
    backend = select_attention_backend("auto", torch.device("cpu"), kernels=kernels, head_dim=HEAD_DIM,
                                       num_heads=HEADS, num_kv_heads=KV_HEADS)
    num_blocks = 2048
    gen = torch.Generator().manual_seed(0)
    cache = tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
    print(f"backend: {getattr(backend, 'description', backend.name)}; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.2f}")

    def table(first: int, n: int) -> list[int]:
        return list(range(first, first + n))

    # 1. prefill of 1,000 tokens from an empty cache
    n = 1000
    tab = table(0, (n + BLOCK - 1) // BLOCK)
    layout = BatchLayout([], [], [0], [n], [tab], BLOCK)
    ms = _case(backend, layout, [list(range(n))], [tab], cache, args.repeat)
    print(f"prefill 1000 tokens: {ms:.2f} ms/layer")

    # 2. the same prompt's last chunk of 96 tokens over a 904-token cached prefix
    layout = BatchLayout([], [], [904], [96], [tab], BLOCK)
    ms = _case(backend, layout, [list(range(904, 1000))], [tab], cache, args.repeat)
    print(f"extend 96 over 904 cached: {ms:.2f} ms/layer")

    # 3. decode batch 32, contexts 480..511
    tables, positions = [], []
    for i in range(32):
        ctx = 480 + i
        tables.append(table(100 + i * 40, (ctx + BLOCK - 1) // BLOCK))
        positions.append([ctx - 1])
    layout = BatchLayout([p[0] for p in positions], tables, [], [], [], BLOCK)
    ms = _case(backend, layout, positions, tables, cache, args.repeat)
    print(f"decode batch 32, context ~500: {ms:.3f} ms/layer")

    # 4. decode: 8 sequences sharing an 800-token cached prefix (50 blocks), 40 own tokens each
    shared = table(1500, 50)
    tables, positions = [], []
    for i in range(8):
        tables.append(shared + table(1560 + i * 4, 3))
        positions.append([800 + 40 + i])
    layout = BatchLayout([p[0] for p in positions], tables, [], [], [], BLOCK)
    ms = _case(backend, layout, positions, tables, cache, args.repeat)
    print(f"decode 8 sharing an 800-token prefix: {ms:.3f} ms/layer")


if __name__ == "__main__":
    main()
