#!/usr/bin/env python
"""Sweep the Triton attention kernels' launch parameters on this GPU (target: one H200, ~2 minutes).

    python benchmarks/gpu/gpu_tune.py                    # prints, per case, the default and the best configs
    python benchmarks/gpu/gpu_tune.py --json out.json

Cases are the ones `benchmarks/gpu/gpu_check.py` times (Qwen2.5-0.5B heads: 14 query / 2 KV of 64, bf16,
block 16). Decode sweeps split count x BLOCK_N x warps x stages; extend sweeps BLOCK_M x BLOCK_N x
warps x stages. Every timed config is first checked against the torch reference (a config that
gives a wrong answer or fails to compile is reported, never chosen). Times: the median of
`triton.testing.do_bench`, microseconds. SDPA on dense, pre-gathered K/V is printed as a yardstick.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
from bench_common import PagedCache, blocks_needed, sdpa_extend  # noqa: E402  (stdlib-only at import time)

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    import triton

    sys.path.insert(0, str(ROOT))  # a checkout without `pip install -e .` still works
    from chatserve.kernels import reference as ref_ops
    from chatserve.kernels import triton_attention as tk

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    dev = torch.device("cuda")
    heads, kv_heads, head_dim, block_size, dtype = 14, 2, 64, 16, torch.bfloat16
    scale = head_dim**-0.5
    rep = heads // kv_heads
    results: list[dict] = []

    def bench(fn) -> float:
        return 1000 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")

    def sweep(name: str, run, ref, configs, default: dict, sdpa_us: float) -> None:
        rows = []
        for cfg in configs:
            try:
                out = run(**cfg)
                torch.cuda.synchronize()
                if not torch.allclose(out.float(), ref.float(), atol=2.5e-2, rtol=2e-2):
                    rows.append((cfg, None, "WRONG"))
                    continue
                rows.append((cfg, bench(lambda: run(**cfg)), "ok"))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                rows.append((cfg, None, f"error: {type(exc).__name__}: {str(exc)[:80]}"))
        timed = [r for r in rows if r[1] is not None]
        best = min(timed, key=lambda r: r[1])
        base = next((r for r in timed if r[0] == default), None)
        wrong = [r for r in rows if r[2] == "WRONG"]
        print(f"\n== {name}: SDPA dense {sdpa_us:.1f} us; default {default} "
              f"{base[1] if base else float('nan'):.1f} us; best {best[0]} {best[1]:.1f} us; "
              f"{len(timed)} timed, {len(wrong)} wrong, {len(rows) - len(timed) - len(wrong)} failed")
        for cfg, t, _status in sorted(timed, key=lambda r: r[1])[:5]:
            print(f"   {t:8.1f} us  {cfg}")
        for cfg, _, status in rows:
            if status != "ok":
                print(f"   {status}  {cfg}")
        results.append({"case": name, "sdpa_us": sdpa_us, "default": default, "default_us": base[1] if base else None,
                        "best": best[0], "best_us": best[1], "top5": [(c, t) for c, t, _ in sorted(timed, key=lambda r: r[1])[:5]],
                        "wrong": [c for c, _, _ in wrong]})

    # ---- decode ----
    for batch, ctx_len in [(1, 4096), (1, 1024), (8, 4096), (64, 1024), (64, 4096)]:
        rng = random.Random(batch * 7919 + ctx_len)
        lens = [ctx_len] * batch
        cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, dev)
        tables = cache.padded_tables([cache.table_for(n) for n in lens])
        context_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
        ref = ref_ops.paged_decode_attention(q, cache.k, cache.v, tables, context_lens, scale, max_len=ctx_len)
        kd, vd = cache.dense(ref_ops, tables, ctx_len, rep)
        qd = q.unsqueeze(2)
        sdpa = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
        auto = tk.choose_num_splits(batch, kv_heads, ctx_len, dev)
        splits = sorted({1, 2, 4, 8, 16, 32, 64, 128, auto})
        configs = [dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st)
                   for s, bn, w, st in itertools.product(splits, (32, 64, 128), (2, 4, 8), (2, 3))
                   if s * 16 <= ctx_len]

        def run_decode(**cfg):
            return tk.paged_decode_attention(q, cache.k, cache.v, tables, context_lens, scale, max_len=ctx_len, **cfg)

        sweep(f"decode B={batch} ctx={ctx_len}", run_decode, ref, configs,
              dict(num_splits=auto, block_n=64, num_warps=4, num_stages=2), sdpa)

    # ---- extend ----
    for batch, prefix, new in [(1, 0, 2048), (4, 2048, 512), (16, 1024, 128), (8, 0, 512)]:
        rng = random.Random(batch * 31 + prefix + new)
        lens = [prefix + new] * batch
        cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, dev)
        tables = cache.padded_tables([cache.table_for(n) for n in lens])
        qsl = torch.arange(0, (batch + 1) * new, new, dtype=torch.int64, device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        q = torch.randn(batch * new, heads, head_dim, device=dev, dtype=dtype)
        ref = ref_ops.paged_extend_attention(q, cache.k, cache.v, tables, qsl, seq_lens, scale)
        kd, vd = cache.dense(ref_ops, tables, prefix + new, rep)
        qd = q.view(batch, new, heads, head_dim).transpose(1, 2).contiguous()
        sdpa = bench(sdpa_extend(qd, kd, vd, prefix=prefix, scale=scale)[0])
        configs = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                   for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]

        def run_extend(**cfg):
            return tk.paged_extend_attention(q, cache.k, cache.v, tables, qsl, seq_lens, scale, max_query_len=new, **cfg)

        sweep(f"extend B={batch} prefix={prefix} new={new}", run_extend, ref, configs,
              dict(block_m=64, block_n=64, num_warps=4, num_stages=2), sdpa)

    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
