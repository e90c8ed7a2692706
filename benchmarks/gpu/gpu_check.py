#!/usr/bin/env python
"""One prepared check of chatserve on an NVIDIA GPU (target: one H200; under 8 minutes; no network).

    python benchmarks/gpu/gpu_check.py                 # everything, one table at the end
    python benchmarks/gpu/gpu_check.py --json out.json # ... and the rows as JSON
    python benchmarks/gpu/gpu_check.py --sections kernels,timings   # skip the engine parts
    python benchmarks/gpu/gpu_check.py --sections invariance        # batch- and cache-invariance only
    python benchmarks/gpu/gpu_check.py --smoke         # dry run of this script on a CPU (see below)

Sections:
  kernels  the Triton kernels against the torch reference at realistic sizes (Qwen2.5-0.5B's
           14 query / 2 KV heads of 64, and other head layouts; bf16, fp16, fp32; ragged
           batches; contexts up to 4096), with NaN poisoned into every KV slot outside the
           contexts and into the outputs; also each side's error against float64.
  timings  kernel times (median of CUDA-event timings): Triton vs the torch reference
           (paged, gathers blocks) vs F.scaled_dot_product_attention on dense, pre-gathered
           K/V with the KV heads already repeated (the best case for SDPA: no paging).
  engine   a random-weight model with the shapes of Qwen2.5-0.5B, built in-process with
           transformers (no download) and saved to a temporary folder with a synthetic
           tokenizer; output tokens/s of chatserve (Triton attention, then the torch
           reference) at concurrency 1 and 64 beside transformers' generate on the same weights.
  invariance  does a request's result depend on what runs beside it (issue 20)? Reported, not
           asserted, except as below. Kernel level, bf16 and fp32: a Triton attention row alone vs
           inside a bigger decode launch (with and without a long context that changes the split
           count), a prefill's last rows vs the same rows as a chunk over cached keys, that chunk
           alone vs in a ragged batch, the last prompt row by the extend vs the decode kernel (bitwise
           equal? max |diff|); and row 0 of F.linear / torch.matmul alone vs in M rows (cuBLAS picks
           its kernel by M: not batch-invariant in general). Engine level, Triton attention, greedy,
           bf16 and fp32, the random Qwen-shaped model, 8 prompts (a shared prefix) x 64 tokens
           (--invariance-prompts/--invariance-tokens): (1) each alone with an empty cache, (2) each
           again from the prefix cache, (3) all in one batch, (4) mixed with 2 long prompts prefilled
           in chunks beside them, (5) in one batch with other chunk sizes (max_num_batched_tokens
           64, 32 while decoding); per scenario how many replies are token-identical to (1) and how
           many have bitwise-equal chosen-token logprobs, and the first divergence of each. (2) or
           (3) whose tokens differ from (1) is a MISMATCH row (the CPU path's CI guarantee, see
           tests/engine/test_determinism.py); it fails the run only with --strict-invariance.

Every part is guarded: an exception is printed and becomes an ERROR row, and the run goes
on; parts that would pass the time budget (--budget-s) are skipped and say so. Exit status:
0 all checks passed, 1 a correctness check failed or a part raised (or, with
--strict-invariance, an invariance MISMATCH), 2 no CUDA device.

--smoke runs the same code on the CPU with Triton's interpreter and tiny sizes (a tiny model
instead of Qwen's shapes, 8 tokens a reply): it checks this script, not the GPU, and its numbers
mean nothing (the interpreter's tl.dot is numpy's matmul, whose bits for a row depend on the row's
place in the tile; CPU F.linear is not the engine's C++ kernel).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
from bench_common import PagedCache, blocks_needed, markdown_table, sdpa_extend  # noqa: E402  (stdlib-only at import time)

ROOT = Path(__file__).resolve().parents[2]

# (atol, rtol) of Triton against the reference in the same dtype (the CPU tests use the same numbers)
TOL = {"float32": (1e-5, 1e-5), "float16": (3e-3, 3e-3), "bfloat16": (2.5e-2, 2e-2)}
# Triton may be at most 2x as far from float64 as the reference is, plus this
EXACT_SLACK = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}

QWEN_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False,
)
TINY_MODEL = dict(  # --smoke only
    vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, head_dim=16,
)

SECTIONS = ("kernels", "timings", "engine", "invariance")

LEGEND = """\
Columns by section:
  env      chatserve = value
  kernels  chatserve = max |Triton - float64|, reference = max |torch reference - float64|,
           baseline = max |Triton - reference|; ok when Triton is within the per-dtype tolerance
           of the reference, at most 2x the reference's own error (+ slack) from float64,
           and nothing is left unwritten (NaN)
  timings  chatserve = Triton, reference = torch reference (paged), baseline = SDPA on dense K/V
           (heads repeated); microseconds, median; verdict = speed-ups of Triton
  engine   output tokens/s (prompt + decode wall time): chatserve = Triton attention,
           reference = chatserve with the torch reference attention, baseline = transformers
           generate (SDPA, same weights, bf16); verdict = chatserve / transformers
  invariance  attention / matmul: chatserve = a row computed alone vs in the bigger launch
           (bitwise equal or differs), reference = max |diff| (matmul: torch.matmul's
           result), baseline = what changed (split counts, settings); info only.
           engine (Triton attention, greedy): chatserve = replies token-identical to (1) and
           with bitwise-equal chosen-token logprobs, reference = earliest divergence of each,
           baseline = what the scenario did; (2) and (3) whose tokens differ from (1) say
           MISMATCH (what the CPU path proves in CI)"""


@dataclass
class Row:
    section: str
    case: str
    chatserve: str = ""
    reference: str = ""
    baseline: str = ""
    verdict: str = ""


class Report:
    def __init__(self, budget_s: float) -> None:
        self.rows: list[Row] = []
        self.failed = False
        self.mismatches = 0  # invariance rows marked MISMATCH: a report, failing the run only with --strict-invariance
        self.start = time.monotonic()
        self.budget_s = budget_s

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  [{row.section}] {row.case}: {row.chatserve} | {row.reference} | {row.baseline} | {row.verdict}", flush=True)
        if row.verdict.startswith(("FAIL", "ERROR")):
            self.failed = True
        if row.verdict.startswith("MISMATCH"):
            self.mismatches += 1

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def time_left(self) -> float:
        return self.budget_s - self.elapsed()

    def guarded(self, section: str, case: str, fn: Callable[[], None], *, needs_s: float = 0.0) -> None:
        """Run one part; an exception becomes an ERROR row, a part that would pass the budget a skip row."""
        if self.time_left() < needs_s:
            self.add(Row(section, case, verdict=f"skipped: {self.time_left():.0f}s of the budget left, needs ~{needs_s:.0f}s"))
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            self.add(Row(section, case, verdict=f"ERROR {type(exc).__name__}: {str(exc)[:160]}"))
        finally:
            gc.collect()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def table(self) -> str:
        head = ["section", "case", "chatserve", "reference", "baseline", "verdict"]
        cells = [head] + [[r.section, r.case, r.chatserve, r.reference, r.baseline, r.verdict] for r in self.rows]
        return markdown_table(cells, numeric=False)


@dataclass
class Ctx:
    """What every check needs: the device, the kernels, the report; `smoke` shrinks every size."""

    device: Any  # torch.device
    smoke: bool
    report: Report
    tk: Any  # chatserve.kernels.triton_attention
    ref_ops: Any  # chatserve.kernels.reference

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def size(self, real: int, smoke: int) -> int:
        return smoke if self.smoke else real

    def bench_us(self, fn: Callable[[], Any]) -> float:
        """Median microseconds per call (CUDA events through triton's do_bench; wall clock in a smoke run)."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return 1000.0 * do_bench(fn, warmup=20, rep=80, return_mode="median")
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[1]


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


# ------------------------------------------------------------------------------------------------
# kernels: correctness at realistic sizes
# ------------------------------------------------------------------------------------------------


def check_outputs(ctx: Ctx, case: str, dtype_name: str, out, ref, exact) -> None:
    import torch

    unwritten = int(torch.isnan(out).sum())
    diff = (out.double() - ref.double()).abs()
    atol, rtol = TOL[dtype_name]
    within = bool((diff <= atol + rtol * ref.double().abs()).all())
    err = (out.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    ok = unwritten == 0 and within and err <= 2 * ref_err + EXACT_SLACK[dtype_name]
    verdict = "ok" if ok else f"FAIL (unwritten={unwritten}, within tol={within})"
    ctx.report.add(Row("kernels", case, f"{err:.2e}", f"{ref_err:.2e}", f"{diff.max().item():.2e}", verdict))


def kernel_decode_case(ctx: Ctx, shape, dtype_name: str, lens: list[int], num_splits: int | None, seed: int) -> None:
    import torch

    name, heads, kv_heads, head_dim, block_size = shape
    dtype = dtype_of(dtype_name)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, ctx.device)
    tables = cache.padded_tables([cache.table_for(n) for n in lens])
    context_lens = torch.tensor(lens, dtype=torch.int64, device=ctx.device)
    q = torch.randn(len(lens), heads + kv_heads, head_dim, device=ctx.device).to(dtype)[:, :heads]  # strided, as in the model
    scale = head_dim**-0.5
    ref = ctx.ref_ops.paged_decode_attention(q, cache.k, cache.v, tables, context_lens, scale)
    exact = ctx.ref_ops.paged_decode_attention(q.double(), cache.k.double(), cache.v.double(), tables, context_lens, scale)
    kp, vp = cache.poisoned()
    out = torch.full_like(q, float("nan"))
    ctx.tk.paged_decode_attention(q, kp, vp, tables, context_lens, scale, max_len=max(lens), out=out, num_splits=num_splits)
    ctx.sync()
    splits = "auto" if num_splits is None else num_splits
    case = f"decode {name} {dtype_name} bs{block_size} B={len(lens)} ctx<={max(lens)} splits={splits}"
    check_outputs(ctx, case, dtype_name, out, ref, exact)


def kernel_extend_case(ctx: Ctx, shape, dtype_name: str, specs: list[tuple[int, int]], seed: int) -> None:
    import torch

    name, heads, kv_heads, head_dim, block_size = shape
    dtype = dtype_of(dtype_name)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [p + n for p, n in specs]
    cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, ctx.device)
    tables = cache.padded_tables([cache.table_for(n) for n in lens])
    qsl = torch.tensor([0, *itertools.accumulate(n for _, n in specs)], dtype=torch.int64, device=ctx.device)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=ctx.device)
    total = int(qsl[-1])
    q = torch.randn(total, heads + kv_heads, head_dim, device=ctx.device).to(dtype)[:, :heads]
    scale = head_dim**-0.5
    ref = ctx.ref_ops.paged_extend_attention(q, cache.k, cache.v, tables, qsl, seq_lens, scale)
    exact = ctx.ref_ops.paged_extend_attention(q.double(), cache.k.double(), cache.v.double(), tables, qsl, seq_lens, scale)
    kp, vp = cache.poisoned()
    out = torch.full_like(q, float("nan"))
    ctx.tk.paged_extend_attention(q, kp, vp, tables, qsl, seq_lens, scale, max_query_len=max(n for _, n in specs), out=out)
    ctx.sync()
    case = f"extend {name} {dtype_name} bs{block_size} B={len(specs)} new={total} prefix<={max(p for p, _ in specs)}"
    check_outputs(ctx, case, dtype_name, out, ref, exact)


def kernel_store_case(ctx: Ctx, dtype_name: str, seed: int) -> None:
    import torch

    dtype = dtype_of(dtype_name)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = ctx.size(512, 8), 16, 2, 64
    tokens = ctx.size(3000, 100)
    padding = ctx.size(50, 5)
    slots = torch.randperm(num_blocks * block_size, device=ctx.device, generator=gen)[:tokens]
    slots[torch.randperm(tokens, device=ctx.device, generator=gen)[:padding]] = -1
    fused = torch.randn(tokens, 3 * kv_heads, head_dim, device=ctx.device, generator=gen).to(dtype)
    key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=ctx.device)
    vc = kc.clone()
    kr, vr = kc.clone(), vc.clone()
    ctx.tk.store_kv_cache(key, value, kc, vc, slots)
    ctx.ref_ops.store_kv_cache(key, value, kr, vr, slots)
    ctx.sync()
    same = torch.equal(kc.isnan(), kr.isnan()) and torch.equal(vc.isnan(), vr.isnan())
    same = same and torch.equal(kc.nan_to_num(), kr.nan_to_num()) and torch.equal(vc.nan_to_num(), vr.nan_to_num())
    ctx.report.add(Row("kernels", f"store_kv_cache {dtype_name} T={tokens} ({padding} slots of -1)",
                       "exact" if same else "differs", "", "", "ok" if same else "FAIL"))


def section_kernels(ctx: Ctx) -> None:
    report = ctx.report
    # (name, query heads, KV heads, head_dim, block size)
    qwen = ("qwen2.5-0.5b 14q/2kv d64", 14, 2, 64, 16)
    others = [
        ("llama-8b 32q/8kv d128", 32, 8, 128, 16),
        ("mha 16q/16kv d64", 16, 16, 64, 32),
        ("gqa3 12q/4kv d128", 12, 4, 128, 32),
        ("gqa4 8q/2kv d80", 8, 2, 80, 16),
    ]
    rng = random.Random(20240601)
    longest = ctx.size(4096, 80)
    ragged_decode = [1, 15, 16, 17, longest] + [rng.randint(1, longest) for _ in range(ctx.size(59, 3))]
    prefix, new = ctx.size(2048, 40), ctx.size(512, 20)
    ragged_extend = [(0, new), (prefix, 1), (prefix // 2, new // 2), (16, 16), (rng.randint(1, prefix), rng.randint(1, new)),
                     (0, 1), (rng.randint(1, prefix), rng.randint(1, new)), (longest - 1 - new, new)]
    for dtype_name in ("bfloat16", "float16", "float32"):
        report.guarded("kernels", f"decode qwen {dtype_name}", lambda d=dtype_name: kernel_decode_case(
            ctx, qwen, d, ragged_decode, None, 1), needs_s=10)
        report.guarded("kernels", f"decode qwen {dtype_name} B=1", lambda d=dtype_name: kernel_decode_case(
            ctx, qwen, d, [ctx.size(4000, 70)], None, 2), needs_s=10)
        report.guarded("kernels", f"extend qwen {dtype_name}", lambda d=dtype_name: kernel_extend_case(
            ctx, qwen, d, ragged_extend, 3), needs_s=10)
        report.guarded("kernels", f"store {dtype_name}", lambda d=dtype_name: kernel_store_case(ctx, d, 4), needs_s=5)
    report.guarded("kernels", "decode qwen bf16 splits=1", lambda: kernel_decode_case(
        ctx, qwen, "bfloat16", ragged_decode[:16], 1, 5), needs_s=10)
    report.guarded("kernels", "decode qwen bf16 splits=7", lambda: kernel_decode_case(
        ctx, qwen, "bfloat16", ragged_decode[:16], 7, 5), needs_s=10)
    for shape in others if not ctx.smoke else others[-1:]:
        report.guarded("kernels", f"decode {shape[0]}", lambda s=shape: kernel_decode_case(
            ctx, s, "bfloat16", ragged_decode[:32], None, 6), needs_s=10)
        report.guarded("kernels", f"extend {shape[0]}", lambda s=shape: kernel_extend_case(
            ctx, s, "bfloat16", ragged_extend, 7), needs_s=10)


# ------------------------------------------------------------------------------------------------
# timings
# ------------------------------------------------------------------------------------------------


def timing_decode(ctx: Ctx, batch: int, ctx_len: int) -> None:
    import torch
    import torch.nn.functional as F

    heads, kv_heads, head_dim, block_size = 14, 2, 64, 16
    dtype = torch.bfloat16
    rng = random.Random(batch * 7919 + ctx_len)
    lens = [ctx_len] * batch
    cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, ctx.device)
    tables = cache.padded_tables([cache.table_for(n) for n in lens])
    context_lens = torch.tensor(lens, dtype=torch.int64, device=ctx.device)
    q = torch.randn(batch, heads, head_dim, device=ctx.device, dtype=dtype)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    tk, ref_ops = ctx.tk, ctx.ref_ops
    t_triton = ctx.bench_us(lambda: tk.paged_decode_attention(q, cache.k, cache.v, tables, context_lens, scale, max_len=ctx_len, out=out))
    t_ref = ctx.bench_us(lambda: ref_ops.paged_decode_attention(q, cache.k, cache.v, tables, context_lens, scale, max_len=ctx_len))
    rep = heads // kv_heads
    kd, vd = cache.dense(ref_ops, tables, ctx_len, rep)  # [B, H, L, D]
    qd = q.unsqueeze(2)
    t_sdpa = ctx.bench_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
    ctx.report.add(Row("timings", f"decode bf16 14q/2kv d64 bs16 B={batch} ctx={ctx_len}", f"{t_triton:.1f}", f"{t_ref:.1f}",
                       f"{t_sdpa:.1f}", f"{t_ref / t_triton:.1f}x vs ref, {t_sdpa / t_triton:.2f}x vs SDPA"))


def timing_extend(ctx: Ctx, batch: int, prefix: int, new: int) -> None:
    import torch

    heads, kv_heads, head_dim, block_size = 14, 2, 64, 16
    dtype = torch.bfloat16
    rng = random.Random(batch * 31 + prefix + new)
    lens = [prefix + new] * batch
    cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, ctx.device)
    tables = cache.padded_tables([cache.table_for(n) for n in lens])
    qsl = torch.arange(0, (batch + 1) * new, new, dtype=torch.int64, device=ctx.device)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=ctx.device)
    q = torch.randn(batch * new, heads, head_dim, device=ctx.device, dtype=dtype)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    tk, ref_ops = ctx.tk, ctx.ref_ops
    t_triton = ctx.bench_us(
        lambda: tk.paged_extend_attention(q, cache.k, cache.v, tables, qsl, seq_lens, scale, max_query_len=new, out=out))
    t_ref = ctx.bench_us(lambda: ref_ops.paged_extend_attention(q, cache.k, cache.v, tables, qsl, seq_lens, scale))
    rep = heads // kv_heads
    total = prefix + new
    kd, vd = cache.dense(ref_ops, tables, total, rep)
    qd = q.view(batch, new, heads, head_dim).transpose(1, 2).contiguous()
    sdpa, note = sdpa_extend(qd, kd, vd, prefix=prefix, scale=scale)
    t_sdpa = ctx.bench_us(sdpa)
    ctx.report.add(Row("timings", f"extend bf16 14q/2kv d64 bs16 B={batch} prefix={prefix} new={new}", f"{t_triton:.1f}",
                       f"{t_ref:.1f}", f"{t_sdpa:.1f} ({note})", f"{t_ref / t_triton:.1f}x vs ref, {t_sdpa / t_triton:.2f}x vs SDPA"))


def timing_store(ctx: Ctx, tokens: int) -> None:
    import torch

    kv_heads, head_dim, block_size = 2, 64, 16
    num_blocks = tokens // block_size + 16
    kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * block_size, device=ctx.device)[:tokens]
    key = torch.randn(tokens, kv_heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    t_triton = ctx.bench_us(lambda: ctx.tk.store_kv_cache(key, value, kc, vc, slots))
    t_ref = ctx.bench_us(lambda: ctx.ref_ops.store_kv_cache(key, value, kc, vc, slots))
    ctx.report.add(Row("timings", f"store_kv_cache bf16 2kv d64 T={tokens}", f"{t_triton:.1f}", f"{t_ref:.1f}", "",
                       f"{t_ref / t_triton:.1f}x vs ref"))


def section_timings(ctx: Ctx) -> None:
    decode_cases = ((1, 4096), (64, 1024), (64, 4096), (256, 2048)) if not ctx.smoke else ((1, 64), (3, 40))
    extend_cases = ((1, 0, 2048), (4, 2048, 512), (16, 1024, 128)) if not ctx.smoke else ((1, 0, 24), (2, 20, 8))
    for batch, length in decode_cases:
        ctx.report.guarded("timings", f"decode B={batch} ctx={length}", lambda b=batch, n=length: timing_decode(ctx, b, n), needs_s=15)
    for batch, prefix, new in extend_cases:
        ctx.report.guarded("timings", f"extend B={batch} prefix={prefix} new={new}",
                           lambda b=batch, p=prefix, n=new: timing_extend(ctx, b, p, n), needs_s=15)
    ctx.report.guarded("timings", "store", lambda: timing_store(ctx, ctx.size(4096, 64)), needs_s=5)


# ------------------------------------------------------------------------------------------------
# engine throughput on a random-weight model with Qwen2.5-0.5B's shapes
# ------------------------------------------------------------------------------------------------


def build_model_folder(ctx: Ctx, folder: Path, seed: int):
    """Random Qwen2-architecture weights (bf16) saved with a synthetic word-level tokenizer; returns the model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shapes = TINY_MODEL if ctx.smoke else QWEN_05B
    vocab_size = shapes["vocab_size"]
    # NOTE: a tokenizer whose every id decodes to a word: no download, and any id the random
    # model picks detokenizes. id 0 is the end token (unused: generation runs with ignore_eos).
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(folder)

    config = transformers.Qwen2Config(**shapes, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(ctx.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # older transformers
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def chatserve_throughput(ctx: Ctx, folder: Path, backend: str, prompts: list[list[int]], output_len: int,
                         concurrencies: list[int]) -> tuple[dict[int, float], dict[int, list[int]]]:
    """Output tokens/s per concurrency, and the first prompt's greedy tokens per concurrency."""
    import torch

    from chatserve import LLM, SamplingParams

    prompt_len = len(prompts[0])
    llm = LLM(
        str(folder), dtype="bfloat16", device=str(ctx.device), attention_backend=backend,
        max_model_len=prompt_len + output_len + 32, kv_cache_memory_gb=16.0 if not ctx.smoke else 0.05,
        max_num_seqs=max(concurrencies), max_num_batched_tokens=16384, max_prefill_tokens_while_decoding=16384,
        enable_prefix_caching=False, cpu_kernels=False,  # on a --smoke run: no 30 s C++ build, and "torch" stays torch
    )
    chosen = llm.engine_info().attention_backend
    if chosen != backend:
        raise RuntimeError(f"asked for attention_backend={backend!r}, the engine chose {chosen!r}")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # warm-up: compiles the kernel variants the measured runs use
        warm = SamplingParams(temperature=0.0, max_tokens=ctx.size(8, 2), ignore_eos=True)
        for c in concurrencies:
            llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:c]], warm)
        rates: dict[int, float] = {}
        tokens: dict[int, list[int]] = {}
        for c in concurrencies:
            ctx.sync()
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:c]], params)
            ctx.sync()
            dt = time.perf_counter() - t0
            rates[c] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
            tokens[c] = list(outs[0].outputs[0].token_ids)
        return rates, tokens
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def hf_throughput(ctx: Ctx, model, prompts: list[list[int]], output_len: int,
                  concurrencies: list[int]) -> tuple[dict[int, float], dict[int, list[int]]]:
    import torch

    rates: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    with torch.inference_mode():
        for c in concurrencies:
            ids = torch.tensor(prompts[:c], device=ctx.device)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
            model.generate(ids, max_new_tokens=ctx.size(8, 2), min_new_tokens=ctx.size(8, 2), **kwargs)  # warm-up
            ctx.sync()
            t0 = time.perf_counter()
            # min_new_tokens = max_new_tokens: every row generates exactly output_len tokens
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            ctx.sync()
            dt = time.perf_counter() - t0
            new = out[:, ids.shape[1]:]
            rates[c] = new.numel() / dt
            tokens[c] = new[0].tolist()
    return rates, tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def section_engine(ctx: Ctx, args: argparse.Namespace) -> None:
    report = ctx.report
    concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
    prompt_len = ctx.size(args.prompt_len, 24)
    output_len = ctx.size(args.output_len, 6)
    vocab = (TINY_MODEL if ctx.smoke else QWEN_05B)["vocab_size"]
    rng = random.Random(99)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(max(concurrencies))]
    results: dict[str, tuple[dict[int, float], dict[int, list[int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="chatserve-gpu-check-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        model = build_model_folder(ctx, folder, seed=0)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        report.add(Row("engine", "random Qwen2-architecture model built + saved", f"{time.perf_counter() - t0:.1f} s", "", "",
                       f"{params_m:.0f}M params, bf16{' (tiny: --smoke)' if ctx.smoke else ', Qwen2.5-0.5B shapes'}"))

        def run_hf() -> None:
            results["hf"] = hf_throughput(ctx, model, prompts, output_len, concurrencies)  # noqa: F821 - runs before the del

        if not args.skip_hf:  # transformers first; its copy is freed before our engines load theirs
            report.guarded("engine", "transformers generate", run_hf, needs_s=40)
        del model, run_hf
        gc.collect()

        def run_ours(backend: str) -> None:
            results[backend] = chatserve_throughput(ctx, folder, backend, prompts, output_len, concurrencies)

        report.guarded("engine", "chatserve (triton attention)", lambda: run_ours("triton"), needs_s=60)
        if not args.skip_torch_engine:
            report.guarded("engine", "chatserve (torch reference attention)", lambda: run_ours("torch"), needs_s=60)

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f} tok/s"

    for c in concurrencies:
        ours = results.get("triton", ({}, {}))[0].get(c)
        ref = results.get("torch", ({}, {}))[0].get(c)
        hf = results.get("hf", ({}, {}))[0].get(c)
        ratio = f"{ours / hf:.2f}x vs transformers" if ours and hf else ""
        case = f"throughput c={c} prompt={prompt_len} out={output_len} (greedy, ignore_eos)"
        report.add(Row("engine", case, fmt(ours), fmt(ref), fmt(hf), ratio))
    # informational: greedy agreement on the first prompt (bf16 on random weights diverges eventually)
    first = concurrencies[0]
    ours_tokens = results.get("triton", ({}, {}))[1].get(first)
    for other in ("torch", "hf"):
        other_tokens = results.get(other, ({}, {}))[1].get(first)
        if ours_tokens and other_tokens:
            n = common_prefix(ours_tokens, other_tokens)
            report.add(Row("engine", f"greedy agreement triton vs {other} (c={first})", f"{n}/{len(ours_tokens)} leading tokens",
                           "", "", "info (bf16)"))


# ------------------------------------------------------------------------------------------------
# invariance: does a request's result depend on what else runs beside it? (issue 20)
# ------------------------------------------------------------------------------------------------

INVARIANCE_SHAPE = ("qwen2.5-0.5b 14q/2kv d64", 14, 2, 64, 16)  # (name, query heads, KV heads, head_dim, block size)
SCENARIOS = {
    1: "each alone, empty cache",
    2: "each again, from the prefix cache",
    3: "all in one batch",
    4: "one batch mixed with 2 long prompts prefilled in chunks",
    5: "all in one batch, other chunk sizes",
}
# (1) vs (2) vs (3) is what the CPU path proves in CI (tests/engine/test_determinism.py): these mismatches are marked
STRICT_SCENARIOS = (2, 3)


def bitwise(a, b) -> tuple[str, str]:
    """('bitwise equal' | 'differs', 'max |diff| ...') of two tensors of the same shape."""
    import torch

    if torch.equal(a, b):
        return "bitwise equal", "max |diff| 0"
    return "differs", f"max |diff| {(a.double() - b.double()).abs().max().item():.2e}"


def attention_row_invariance(ctx: Ctx, dtype_name: str) -> None:
    """One sequence's attention rows computed alone, inside bigger batches and over cached keys.

    Decode: the split count is chosen for the whole launch (choose_num_splits: batch size and the
    longest context), and a row's keys are cut at ctx_len / num_splits, so a long neighbour can
    change how a short row is reduced. Extend: every tile walks its keys in BLOCK_N steps from
    position 0 whatever the chunk or the batch, so its rows are expected to keep their bits.
    """
    import torch

    name, heads, kv_heads, head_dim, block_size = INVARIANCE_SHAPE
    dtype = dtype_of(dtype_name)
    rng = random.Random(2020)
    torch.manual_seed(2020)
    # the interpreter splits at 256 keys (not 1,024) with a target of 4 programs: sizes that move the split count there too
    length, longest, chunk = ctx.size(700, 300), ctx.size(4096, 600), ctx.size(64, 8)
    same_len = [length + rng.randint(-16, 16) for _ in range(ctx.size(7, 3))]
    short = [rng.randint(chunk + 1, length) for _ in range(ctx.size(6, 2))]
    lens = [length, *same_len, *short, longest]
    cache = PagedCache(blocks_needed(lens, block_size), block_size, kv_heads, head_dim, dtype, rng, ctx.device)
    tables = cache.padded_tables([cache.table_for(n) for n in lens])
    scale = head_dim**-0.5
    tk = ctx.tk

    def dec(rows: list[int], q):
        context = torch.tensor([lens[i] for i in rows], dtype=torch.int64, device=ctx.device)
        max_len = max(lens[i] for i in rows)
        splits = tk.choose_num_splits(len(rows), kv_heads, max_len, q.device)
        return tk.paged_decode_attention(q, cache.k, cache.v, tables[rows], context, scale, max_len=max_len), splits

    def ext(specs: list[tuple[int, int, Any]]):
        """specs: (row in tables, prefix, queries of the new tokens); returns the packed output."""
        rows = [r for r, _, _ in specs]
        qsl = torch.tensor([0, *itertools.accumulate(q.shape[0] for _, _, q in specs)], dtype=torch.int64, device=ctx.device)
        seq_lens = torch.tensor([p + q.shape[0] for _, p, q in specs], dtype=torch.int64, device=ctx.device)
        q = torch.cat([q for _, _, q in specs])
        return tk.paged_extend_attention(q, cache.k, cache.v, tables[rows], qsl, seq_lens, scale,
                                         max_query_len=max(q.shape[0] for _, _, q in specs))

    def add(case: str, a, b, note: str) -> None:
        ctx.sync()
        equal, diff = bitwise(a, b)
        ctx.report.add(Row("invariance", f"attention {dtype_name} {case}", equal, diff, note, "info"))

    # decode: row 0 (context `length`) alone, beside rows of about its length, beside those and a long context
    qd = torch.randn(len(lens), heads, head_dim, device=ctx.device).to(dtype)
    alone, s1 = dec([0], qd[:1])
    same_rows = list(range(1 + len(same_len)))
    in_same, s2 = dec(same_rows, qd[same_rows])
    in_all, s3 = dec(list(range(len(lens))), qd)
    add(f"decode row (ctx {length}) alone vs in B={len(same_rows)} of similar contexts", alone[0], in_same[0],
        f"splits {s1} vs {s2}")
    add(f"decode row (ctx {length}) alone vs in B={len(lens)} with a ctx {longest}", alone[0], in_all[0], f"splits {s1} vs {s3}")

    # extend: the sequence's last `chunk` tokens in one whole prefill, as a chunk over its cached prefix, the same
    # chunk beside other sequences' chunks, and its last token as a decode
    qe = torch.randn(length, heads, head_dim, device=ctx.device).to(dtype)
    whole = ext([(0, 0, qe)])[length - chunk:]
    over_cache = ext([(0, length - chunk, qe[length - chunk:])])
    news = [min(n, lens[i]) for i, n in zip(range(1 + len(same_len), len(lens) - 1), itertools.cycle((chunk, 1, 3 * chunk)))]
    others = [(i, lens[i] - n, torch.randn(n, heads, head_dim, device=ctx.device).to(dtype))
              for i, n in zip(range(1 + len(same_len), len(lens) - 1), news)]
    mixed = ext([others[0], (0, length - chunk, qe[length - chunk:]), *others[1:]])
    start = others[0][2].shape[0]
    last_as_decode, s4 = dec([0], qe[-1:])
    add(f"extend last {chunk} rows of a {length}-token prefill vs the same rows over {length - chunk} cached keys",
        whole, over_cache, "BLOCK_N key steps from 0 in both")
    add(f"extend chunk over cached keys alone vs in a ragged batch of {len(others) + 1}", over_cache,
        mixed[start:start + chunk], "same chunk, other sequences beside it")
    add(f"last prompt row: extend (prefill) vs decode kernel over the same {length} keys", whole[-1:], last_as_decode,
        f"decode splits {s4}; tiles of {heads // kv_heads} heads x tokens vs 16 heads")


def matmul_row_invariance(ctx: Ctx, dtype_name: str) -> None:
    """Row 0 of x @ W^T alone vs inside M rows: cuBLAS picks its kernel (tiles, split-K) by M, so the
    engine's linear layers on CUDA may give a row other bits in a bigger batch. Reported, not asserted."""
    import torch
    import torch.nn.functional as F

    dtype = dtype_of(dtype_name)
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    k, n = ctx.size(896, 64), ctx.size(4864, 96)  # Qwen2.5-0.5B's MLP up projection
    ms = ctx.size((2, 8, 64, 512, 2048), (2, 8, 64))
    w = (torch.randn(n, k, device=ctx.device, generator=gen) / k**0.5).to(dtype)
    x = torch.randn(max(ms), k, device=ctx.device, generator=gen).to(dtype)
    lin_alone, mm_alone = F.linear(x[:1], w), torch.matmul(x[:1], w.t())
    note = ""
    if ctx.device.type == "cuda":
        note = (f"tf32 {torch.backends.cuda.matmul.allow_tf32}, reduced-precision bf16 reduction "
                f"{torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
    for m in ms:
        lin, mm = F.linear(x[:m], w)[:1], torch.matmul(x[:m], w.t())[:1]
        ctx.sync()
        lin_eq, lin_diff = bitwise(lin_alone, lin)
        mm_eq, mm_diff = bitwise(mm_alone, mm)
        ctx.report.add(Row("invariance", f"matmul {dtype_name} [M x {k}] @ [{k} x {n}]: row 0 alone vs in M={m}",
                           f"F.linear {lin_eq} ({lin_diff})", f"torch.matmul {mm_eq} ({mm_diff})", note, "info"))


LAYOUT_COUNTERS = ("num_steps", "num_prefill_chunks_continued", "num_mixed_steps")


def layout_note(before: dict[str, Any], after: dict[str, Any]) -> str:
    """How the steps between two `llm.engine.stats()` snapshots were laid out: prefill chunks that
    continue a prompt and steps that ran decodes beside prefill chunks (the proof that scenario (4)
    chunked anything). Read from the engine's public counters, not by wrapping its attention backend."""
    steps, continued, mixed = (after[k] - before[k] for k in LAYOUT_COUNTERS)
    return f"{steps} steps, {continued} chunks continuing a prompt, {mixed} steps with decodes + chunks"


def invariance_llm(ctx: Ctx, folder: Path, dtype_name: str, max_model_len: int, num_seqs: int, batched: int,
                   while_decoding: int):
    """The engine of the invariance runs: Triton attention, the prefix cache on, the given chunk sizes."""
    from chatserve import LLM

    llm = LLM(
        str(folder), dtype=dtype_name, device=str(ctx.device), attention_backend="triton", max_model_len=max_model_len,
        kv_cache_memory_gb=4.0 if not ctx.smoke else 0.05, max_num_seqs=num_seqs, max_num_batched_tokens=batched,
        max_prefill_tokens_while_decoding=while_decoding, enable_prefix_caching=True, cpu_kernels=False,
    )
    chosen = llm.engine_info().attention_backend
    if chosen != "triton":
        raise RuntimeError(f"asked for attention_backend='triton', the engine chose {chosen!r}")
    return llm


def release_memory() -> None:
    """Collect what the caller just dropped (an engine, a model) before the next one loads."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def agreement(base: list[list[Any]], other: list[list[Any]]) -> tuple[int, str]:
    """(replies identical to the base's, where the earliest divergence is); lists of token ids or of logprobs."""
    same = sum(a == b for a, b in zip(base, other, strict=True))
    diverged = [(common_prefix(a, b), i) for i, (a, b) in enumerate(zip(base, other)) if a != b]
    if not diverged:
        return same, "none differ"
    pos, i = min(diverged)
    return same, f"first at token {pos} (prompt {i})"


def engine_invariance(ctx: Ctx, folder: Path, dtype_name: str, prompts: list[list[int]], longs: list[list[int]],
                      output_len: int) -> None:
    """Scenarios (1)-(5) of tests/engine/test_determinism.py on the Triton path, greedy; one row each."""
    from chatserve import SamplingParams

    # NOTE: logprobs=0 returns each chosen token's logprob: equal floats are equal bits, so a run whose tokens
    # still agree but whose numbers moved shows it (random weights keep a wide argmax margin for a while)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=0)
    max_model_len = max(len(p) for p in prompts + longs) + output_len + 32
    batched, while_decoding = ctx.size(2048, 64), ctx.size(96, 16)
    other_batched, other_while_decoding = ctx.size(64, 16), ctx.size(32, 8)
    runs: dict[int, list[tuple[list[int], list[float]]]] = {}  # scenario -> per prompt (token ids, their logprobs)
    notes: dict[int, str] = {}

    def reply(out) -> tuple[list[int], list[float]]:
        c = out.outputs[0]
        return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)]

    def tokens(outs) -> list[tuple[list[int], list[float]]]:
        return [reply(o) for o in outs]

    num_seqs = len(prompts) + len(longs)  # (4) admits every request at once
    llm = invariance_llm(ctx, folder, dtype_name, max_model_len, num_seqs, batched, while_decoding)
    try:
        runs[1], runs[2], hits = [], [], 0
        for p in prompts:
            llm.engine.reset_prefix_cache()
            first, again = (llm.generate([{"prompt_token_ids": p}], params)[0] for _ in range(2))
            if first.num_cached_tokens:
                raise RuntimeError(f"(1) found {first.num_cached_tokens} cached tokens after reset_prefix_cache()")
            runs[1].append(reply(first))
            runs[2].append(reply(again))
            hits += again.num_cached_tokens
        notes[1] = f"{len({tuple(t) for t, _ in runs[1]})} distinct replies; max_num_batched_tokens={batched}"
        notes[2] = f"{hits}/{sum(len(p) for p in prompts)} prompt tokens from the cache"
        llm.engine.reset_prefix_cache()
        runs[3] = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        notes[3] = f"B={len(prompts)}, empty cache"
        llm.engine.reset_prefix_cache()
        before = llm.engine.stats()
        long_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in longs + prompts], [long_params] * len(longs) + [params] * len(prompts))
        runs[4] = tokens(outs[len(longs):])  # the long prompts asked for no logprobs
        notes[4] = f"{len(longs)} x {len(longs[0])} tokens first; " + layout_note(before, llm.engine.stats())
    finally:
        del llm
        release_memory()
    llm = invariance_llm(ctx, folder, dtype_name, max_model_len, num_seqs, other_batched, other_while_decoding)
    try:
        runs[5] = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        notes[5] = f"max_num_batched_tokens={other_batched} (was {batched}), {other_while_decoding} while decoding (was {while_decoding})"
    finally:
        del llm
        release_memory()

    for k, label in SCENARIOS.items():
        case = f"engine {dtype_name} ({k}) {label}"
        if k == 1:
            ctx.report.add(Row("invariance", case, f"{len(prompts)} prompts x {output_len} tokens", "", notes[1], "the baseline"))
            continue
        same, where = agreement([t for t, _ in runs[1]], [t for t, _ in runs[k]])
        same_lp, where_lp = agreement([lp for _, lp in runs[1]], [lp for _, lp in runs[k]])
        n = len(prompts)
        bits = "" if same_lp == n else "; logprobs differ"
        if k in STRICT_SCENARIOS:
            verdict = f"ok (identical{bits})" if same == n else "MISMATCH vs (1)"
        else:
            verdict = f"identical{bits} (info)" if same == n else "differs (info)"
        ctx.report.add(Row("invariance", case, f"{same}/{n} token-identical to (1), {same_lp}/{n} logprob-identical",
                           f"tokens: {where}; logprobs: {where_lp}", notes[k], verdict))


def section_invariance(ctx: Ctx, args: argparse.Namespace) -> None:
    report = ctx.report
    for dtype_name in ("bfloat16", "float32"):
        report.guarded("invariance", f"attention rows {dtype_name}", lambda d=dtype_name: attention_row_invariance(ctx, d), needs_s=10)
        report.guarded("invariance", f"matmul rows {dtype_name}", lambda d=dtype_name: matmul_row_invariance(ctx, d), needs_s=5)
    vocab = (TINY_MODEL if ctx.smoke else QWEN_05B)["vocab_size"]
    rng = random.Random(20)
    # a shared "system prompt" so the prefix cache and the batch's shared blocks come into play
    shared = [rng.randrange(1, vocab) for _ in range(ctx.size(160, 16))]
    prompts = [shared + [rng.randrange(1, vocab) for _ in range(rng.randint(*ctx.size((8, 120), (3, 12))))]
               for _ in range(args.invariance_prompts)]
    longs = [[rng.randrange(1, vocab) for _ in range(ctx.size(3000, 90))] for _ in range(2)]
    output_len = ctx.size(args.invariance_tokens, min(args.invariance_tokens, 8))
    with tempfile.TemporaryDirectory(prefix="chatserve-gpu-invariance-") as tmp:
        folder = Path(tmp)
        def build() -> None:  # the transformers copy is dropped on return (the guard collects it); engines load the folder
            build_model_folder(ctx, folder, seed=1)

        report.guarded("invariance", "random model", build, needs_s=20)
        if not (folder / "config.json").exists():
            return
        for dtype_name in ("bfloat16", "float32"):
            report.guarded("invariance", f"engine {dtype_name}", lambda d=dtype_name: engine_invariance(
                ctx, folder, d, prompts, longs, output_len), needs_s=ctx.size(90, 30))


# ------------------------------------------------------------------------------------------------


def section_env(ctx: Ctx) -> None:
    import torch
    import triton

    report = ctx.report
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        report.add(Row("env", "gpu", f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"))
    else:
        report.add(Row("env", "device", "CPU, Triton interpreter (--smoke: checks this script only)"))
    report.add(Row("env", "versions", f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
                                      f"python {platform.python_version()}"))
    try:
        import transformers

        report.add(Row("env", "transformers", transformers.__version__))
    except ImportError:
        report.add(Row("env", "transformers", "not installed"))


def exit_status(report: Report, *, strict_invariance: bool) -> int:
    """1 when a check failed or a part raised; invariance MISMATCH rows count only when strict."""
    return 1 if report.failed or (strict_invariance and report.mismatches) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    p.add_argument("--prompt-len", type=int, default=512, help="engine prompt length in tokens (default 512)")
    p.add_argument("--output-len", type=int, default=128, help="engine output tokens per request (default 128)")
    p.add_argument("--concurrency", default="1,64", help="engine concurrencies (default 1,64)")
    p.add_argument("--skip-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--skip-torch-engine", action="store_true", help="skip chatserve with the torch reference attention")
    p.add_argument("--invariance-prompts", type=int, default=8, help="invariance: prompts per scenario (default 8)")
    p.add_argument("--invariance-tokens", type=int, default=64, help="invariance: greedy tokens per prompt (default 64; "
                   "--smoke: at most 8)")
    p.add_argument("--strict-invariance", action="store_true", help="exit 1 when (2) or (3) of the invariance "
                   "section differs from (1) (default: a MISMATCH row, reported, exit status unchanged)")
    p.add_argument("--budget-s", type=float, default=420.0, help="time budget in seconds (default 420); parts that "
                   "would pass it are skipped")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="dry run on the CPU with Triton's interpreter and tiny sizes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        print(f"gpu_check: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.invariance_prompts < 1 or args.invariance_tokens < 1:
        print("gpu_check: --invariance-prompts and --invariance-tokens must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # NOTE: decided before the kernels module is imported (triton reads it at decoration time)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.pop("TRITON_INTERPRET", None):
        print("gpu_check: ignoring TRITON_INTERPRET (this check compiles the kernels for the GPU)", file=sys.stderr)

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device is visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "This script checks the Triton kernels and the engine on an NVIDIA GPU: run it on a machine with one "
            "and a CUDA build of torch (or pass --smoke for a CPU dry run of the script itself). Nothing was run.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_check: triton is not installed: pip install triton (CUDA builds of torch bring it)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))  # a checkout without `pip install -e .` still works
    from chatserve.kernels import reference as ref_ops
    from chatserve.kernels import triton_attention as tk

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 references stay float32
    device = torch.device("cpu" if args.smoke else "cuda")
    report = Report(args.budget_s)
    ctx = Ctx(device=device, smoke=args.smoke, report=report, tk=tk, ref_ops=ref_ops)
    print(f"gpu_check: sections {sorted(sections)} on {device}, budget {args.budget_s:.0f}s", flush=True)
    report.guarded("env", "environment", lambda: section_env(ctx))
    if "kernels" in sections:
        section_kernels(ctx)
    if "timings" in sections:
        section_timings(ctx)
    if "engine" in sections:
        report.guarded("engine", "engine section", lambda: section_engine(ctx, args), needs_s=90)
    if "invariance" in sections:
        report.guarded("invariance", "invariance section", lambda: section_invariance(ctx, args), needs_s=30)
    summary = "FAILED (see rows marked FAIL/ERROR)" if report.failed else "all checks ok"
    if report.mismatches:
        summary += f"; {report.mismatches} invariance MISMATCH row(s)"
    report.rows.append(Row("env", "gpu_check wall time", f"{report.elapsed():.0f} s", "", "", summary))

    print("\n" + LEGEND + "\n")
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in report.rows], indent=1))
    return exit_status(report, strict_invariance=args.strict_invariance)


if __name__ == "__main__":
    sys.exit(main())
