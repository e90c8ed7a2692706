"""The paged attention kernel of any tier (csrc/tier_attention.cpp) against torch SDPA in fp32, per layer.

The default model's shapes (9 heads, 3 KV heads, head_dim 64): a 1,000-token causal prefill (one
extend from position 0), its last 96 tokens as a chunk over the 904 cached ones, single-sequence
decode at contexts of 1,000-8,000 keys, a decode batch of 32 over 1,000-key contexts, and 8 decodes
sharing an 800-token cached prefix (one group: the prefix read once). The kernel reads paged caches
(K/V stored beforehand, not timed) in bf16 or, with --kv-dtype int8, 8-bit (per token and head
scales); SDPA gets contiguous fp32 [1, heads, keys, D] tensors (its fastest CPU input: no gather)
of the same values (dequantized for int8). --no-sdpa skips the SDPA column (shorter runs).

    python benchmarks/kernels/bench_tier_attention.py [--tier avx2] [--kv-dtype int8] [--block-size 16] [--repeat 20] [--threads 2]
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


def _dequantized(kv: torch.Tensor) -> torch.Tensor:
    """bf16 K/V rows as the 8-bit cache holds them (the KV contract: per row scale amax / 127, RNE)."""
    x = kv.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale == 0, torch.zeros_like(x), (x / scale).round().clamp(-127, 127))
    return q * scale


def _case(ext, seqs: list[tuple[int, int]], block: int, kv_dtype: str, repeat: int, sdpa: bool,
          shared: int = 0) -> tuple[float, float | None]:
    """seqs: (start position, new tokens) per sequence; the first `shared` keys (whole blocks) are
    one cached prefix every sequence's table names, processed as one group -> (kernel ms, SDPA fp32 ms)."""
    gen = torch.Generator().manual_seed(0)
    shared_blocks = shared // block
    per_seq = [-(-(s + n) // block) - shared_blocks for s, n in seqs]
    width = HEAD_DIM + 4 if kv_dtype == "int8" else HEAD_DIM
    dtype = torch.int8 if kv_dtype == "int8" else torch.bfloat16
    k_cache = torch.zeros(shared_blocks + sum(per_seq), block, KV_HEADS, width, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    prefix = torch.randn(shared, 2, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    if shared:
        ext.store_kv_paged_bf16(prefix[:, 0], prefix[:, 1], k_cache, v_cache, torch.arange(shared))
    tables, first, keys = [], shared_blocks, []
    for (s, n), count in zip(seqs, per_seq):
        own = list(range(first, first + count))
        tables.append(list(range(shared_blocks)) + own)
        first += count
        kv = torch.randn(s + n - shared, 2, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        ext.store_kv_paged_bf16(kv[:, 0], kv[:, 1], k_cache, v_cache, torch.arange(own[0] * block, own[0] * block + s + n - shared))
        keys.append(torch.cat([prefix, kv]))
    width = max(len(t) for t in tables)
    padded = _i64([t + [t[0]] * (width - len(t)) for t in tables])
    query_start = [0]
    for _, n in seqs:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    groups = [0, len(seqs)] if shared else list(range(len(seqs) + 1))
    args = (padded, _i64(query_start), _i64([s for s, _ in seqs]), torch.arange(len(seqs)), _i64(groups))
    scale = HEAD_DIM**-0.5
    kernel = _time(lambda: ext.paged_attention_bf16(q, k_cache, v_cache, *args, scale), repeat)
    if not sdpa:
        return kernel, None

    qf = q.float()
    values = [_dequantized(kv) if kv_dtype == "int8" else kv.float() for kv in keys]
    dense = [(qf[query_start[i] : query_start[i + 1]].transpose(0, 1).unsqueeze(0),
              kv[:, 0].transpose(0, 1).unsqueeze(0).contiguous(), kv[:, 1].transpose(0, 1).unsqueeze(0).contiguous(), s)
             for i, ((s, _), kv) in enumerate(zip(seqs, values))]

    def run_sdpa() -> None:
        for qs, ks, vs, start in dense:
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=start == 0 and qs.shape[2] > 1, scale=scale, enable_gqa=True)

    return kernel, _time(run_sdpa, repeat)


def main() -> None:
    supported = [t.name for t in supported_tiers(cap=EngineArgs.from_env().max_cpu_tier)]
    parser = argparse.ArgumentParser()
    parser.add_argument("--tier", default=supported[0] if supported else "avx2", choices=list(TIERS))
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-sdpa", action="store_true", help="time the kernel only")
    parser.add_argument("--cases", default="", help="comma-separated case-name prefixes to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = build_tier_family("attention", TIERS[args.tier])
    if ext is None:
        raise SystemExit(f"the {args.tier} attention kernel could not be built")
    bs = args.block_size
    cases: list[tuple[str, list[tuple[int, int]], int]] = [("prefill 1000", [(0, 1000)], 0), ("extend 96 over 904", [(904, 96)], 0)]
    cases += [(f"decode ctx {c}", [(c - 1, 1)], 0) for c in (1000, 2000, 4000, 8000)]
    cases += [("decode b32 ctx 1000", [(999, 1)] * 32, 0)]
    cases += [("decode 8 sharing 800", [(800 + 40 + i, 1) for i in range(8)], 800 // bs * bs)]
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    print(f"tier {args.tier}, KV {args.kv_dtype}, block {bs}, {args.threads} threads, {HEADS} heads / {KV_HEADS} KV heads, "
          f"D {HEAD_DIM}")
    print(f"{'case':<22}{'kernel ms':>11}{'SDPA fp32 ms':>14}{'speedup':>9}")
    for name, seqs, shared in cases:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        kernel, sdpa = _case(ext, seqs, bs, args.kv_dtype, args.repeat, not args.no_sdpa, shared)
        tail = f"{sdpa:>14.3f}{sdpa / kernel:>8.2f}x" if sdpa is not None else f"{'-':>14}{'-':>9}"
        print(f"{name:<22}{kernel:>11.3f}{tail}")


if __name__ == "__main__":
    main()
