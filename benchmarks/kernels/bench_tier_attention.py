"""The tiered paged attention kernel (csrc/tier_attention.cpp) against torch SDPA in fp32, per layer.

The default model's shapes (9 heads, 3 KV heads, head_dim 64): a 1,000-token causal prefill (one
extend from position 0) and single-sequence decode at contexts of 1,000-4,000 keys, plus a decode
batch of 32 over 1,000-key contexts. The kernel reads bf16 paged caches (K/V stored beforehand, not
timed); SDPA gets contiguous fp32 [1, heads, keys, D] tensors (its fastest CPU input: no gather).

    python benchmarks/kernels/bench_tier_attention.py [--tier avx2] [--block-size 16] [--repeat 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from chatserve.config import EngineArgs
from chatserve.kernels.tiers import TIERS, build_tier_family, supported_tiers

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _time(fn, repeat: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _case(ext, seqs: list[tuple[int, int]], block: int, repeat: int) -> tuple[float, float]:
    """seqs: (start position, new tokens) per sequence -> (kernel ms, SDPA fp32 ms)."""
    gen = torch.Generator().manual_seed(0)
    per_seq = [-(-(s + n) // block) for s, n in seqs]
    k_cache = torch.zeros(sum(per_seq), block, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    tables, first, keys = [], 0, []
    for (s, n), count in zip(seqs, per_seq):
        tables.append(list(range(first, first + count)))
        first += count
        kv = torch.randn(s + n, 2, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        ext.store_kv_paged_bf16(kv[:, 0], kv[:, 1], k_cache, v_cache, torch.arange(tables[-1][0] * block, tables[-1][0] * block + s + n))
        keys.append(kv.float())
    width = max(per_seq)
    padded = _i64([t + [t[0]] * (width - len(t)) for t in tables])
    query_start = [0]
    for _, n in seqs:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    args = (padded, _i64(query_start), _i64([s for s, _ in seqs]), torch.arange(len(seqs)), _i64(list(range(len(seqs) + 1))))
    scale = HEAD_DIM**-0.5
    kernel = _time(lambda: ext.paged_attention_bf16(q, k_cache, v_cache, *args, scale), repeat)

    qf = q.float()
    dense = [(qf[query_start[i] : query_start[i + 1]].transpose(0, 1).unsqueeze(0),
              kv[:, 0].transpose(0, 1).unsqueeze(0).contiguous(), kv[:, 1].transpose(0, 1).unsqueeze(0).contiguous(), s)
             for i, ((s, _), kv) in enumerate(zip(seqs, keys))]

    def sdpa() -> None:
        for qs, ks, vs, start in dense:
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=start == 0 and qs.shape[2] > 1, scale=scale, enable_gqa=True)

    return kernel, _time(sdpa, repeat)


def main() -> None:
    tiered = [t.name for t in supported_tiers(cap=EngineArgs.from_env().max_cpu_tier)]
    parser = argparse.ArgumentParser()
    parser.add_argument("--tier", default=tiered[0] if tiered else "avx2", choices=list(TIERS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = build_tier_family("attention", TIERS[args.tier])
    if ext is None:
        raise SystemExit(f"the {args.tier} attention kernel could not be built")
    cases = [("prefill 1000", [(0, 1000)])]
    cases += [(f"decode ctx {c}", [(c - 1, 1)]) for c in (1000, 2000, 4000)]
    cases += [("decode b32 ctx 1000", [(999, 1)] * 32)]
    print(f"tier {args.tier}, block {args.block_size}, {args.threads} threads, {HEADS} heads / {KV_HEADS} KV heads, D {HEAD_DIM}")
    print(f"{'case':<22}{'kernel ms':>11}{'SDPA fp32 ms':>14}{'speedup':>9}")
    for name, seqs in cases:
        kernel, sdpa = _case(ext, seqs, args.block_size, args.repeat)
        print(f"{name:<22}{kernel:>11.3f}{sdpa:>14.3f}{sdpa / kernel:>8.2f}x")


if __name__ == "__main__":
    main()
