"""The Triton paged-attention kernels, run by Triton's CPU interpreter, against the torch reference.

Every test draws fresh random inputs (the seed is in each failure message; set
CHATSERVE_TEST_SEED to replay one), poisons the outputs with NaN before the
kernel runs (an element it fails to write stays NaN), and poisons every KV
slot outside the sequences' contexts with NaN in the kernel's copy of the cache
(a kernel reading past a context length produces NaN). The reference gets the
same cache with finite values there, since it gathers whole blocks and masks.
"""

from __future__ import annotations

import itertools
import os
import random
import sys

import pytest
import torch

# NOTE: must be set before chatserve.kernels.triton_attention is first imported: triton
# decides at decoration time whether a kernel is compiled or interpreted, and reads the
# variable again at launch. It stays set for the rest of this process (only triton reads it).
if "chatserve.kernels.triton_attention" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from chatserve.kernels import reference  # noqa: E402
from chatserve.kernels import triton_attention as tk  # noqa: E402

if not tk.is_interpreted():
    pytest.skip("Triton kernels were imported compiled (TRITON_INTERPRET unset at first import)", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of the Triton output against the reference in the same dtype. Measured worst cases
# over many random draws: fp32 7e-7, fp16 2e-3, bf16 1.6e-2 (two bf16 ulps near 1: both sides
# round their output once, the interpreter truncates where the GPU rounds to nearest).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2e-2)}
# Slack when comparing errors against float64 ground truth: the kernel may be at most 2x as far
# from the exact result as the reference is, plus this times max(1, |exact|) (about one ulp).
EXACT_SLACK = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
GQA = [1, 3, 4]  # query heads per KV head
HEAD_DIM = {1: 64, 3: 48, 4: 16}  # a non-power-of-two head dim, the smallest one tl.dot takes, Qwen's 64
NUM_KV_HEADS = 2
# (dtype, rep, block_size): every dtype with every GQA ratio, each dtype and each ratio with both
# block sizes (all pairs of values, 9 cases instead of the 18 of the whole product: under the
# interpreter each case costs seconds, and no kernel path depends on all three at once).
PAIRWISE = [(dtype, rep, (16, 32)[(i + j) % 2]) for i, dtype in enumerate(DTYPES) for j, rep in enumerate(GQA)]


def fresh_seed() -> int:
    env = os.environ.get("CHATSERVE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


class PagedCache:
    """A random K/V cache whose blocks are handed out in random order, so tables are never contiguous."""

    def __init__(self, gen: torch.Generator, rng: random.Random, num_blocks: int, block_size: int, dtype: torch.dtype, head_dim: int):
        shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
        self.block_size = block_size
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)

    def table_for(self, length: int) -> list[int]:
        nb = -(-length // self.block_size)
        table, self.free = self.free[:nb], self.free[nb:]
        for i in range(length):
            self.valid[table[i // self.block_size] * self.block_size + i % self.block_size] = True
        return table

    def padded_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Pad rows with a block no sequence owns: its slots are NaN for the kernel, which must not read them."""
        pad = self.free[0]
        width = max(len(t) for t in tables) + 1
        return torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int64)

    def poisoned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's copy: NaN in every slot outside the sequences' contexts."""
        k, v = self.k.clone(), self.v.clone()
        invalid = ~self.valid.view(k.shape[0], k.shape[1])
        k[invalid] = float("nan")
        v[invalid] = float("nan")
        return k, v


def check_close(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten element or a read past a context)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    # Element by element: at most twice the reference's worst error, plus the slack scaled by the
    # magnitude where it is above 1 (one truncation is one ulp, which grows with the value: at 4.3 a
    # bf16 ulp is 0.031, and the interpreter's truncated 4.28125 for 4.3079 is right, not a bug).
    err = (out.double() - exact).abs()
    ref_err = (ref.double() - exact).abs().max().item()
    allowed = 2 * ref_err + EXACT_SLACK[dtype] * exact.abs().clamp_min(1.0)
    worst = int((err - allowed).argmax())
    assert bool((err <= allowed).all()), (
        f"{what}: error vs float64 {err.flatten()[worst].item():.3g} at {exact.flatten()[worst].item():.4g} "
        f"(allowed {allowed.flatten()[worst].item():.3g}), reference's own worst {ref_err:.3g}")


def gqa_query(gen: torch.Generator, num_tokens: int, rep: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A query that is a strided view, as the model passes it (q split off a fused q/k tensor)."""
    qk = torch.randn(num_tokens, NUM_KV_HEADS * rep + NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    return qk[:, : NUM_KV_HEADS * rep]


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rep,block_size", PAIRWISE, ids=str)
def test_decode_matches_reference(dtype, rep, block_size):
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    head_dim = HEAD_DIM[rep]
    cache = PagedCache(gen, rng, 64, block_size, dtype, head_dim)
    # ragged: one key only, exactly one block, one past a block, and random lengths
    lens = [1, block_size, block_size + 1] + [rng.randint(2, 5 * block_size) for _ in range(rng.randint(1, 3))]
    rng.shuffle(lens)
    tables = [cache.table_for(n) for n in lens]
    block_tables = cache.padded_tables(tables)
    context_lens = torch.tensor(lens, dtype=torch.int64)
    q = gqa_query(gen, len(lens), rep, head_dim, dtype)
    scale = head_dim**-0.5
    ref = reference.paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, scale)
    exact = reference.paged_decode_attention(q.double(), cache.k.double(), cache.v.double(), block_tables, context_lens, scale)
    k_poisoned, v_poisoned = cache.poisoned()
    # 1 = one pass; 3 and 7 split the context (7 leaves the one-key sequence with empty splits)
    for num_splits in (1, 3, 7):
        out = torch.full_like(q, float("nan"))
        got = tk.paged_decode_attention(
            q, k_poisoned, v_poisoned, block_tables, context_lens, scale, max_len=max(lens), out=out, num_splits=num_splits
        )
        assert got is out
        check_close(out, ref, exact, dtype, f"decode seed={seed} lens={lens} splits={num_splits}")


def test_decode_default_splits_and_int32_tables():
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    cache = PagedCache(gen, rng, 48, 16, torch.float32, 32)
    lens = [rng.randint(1, 300), rng.randint(1, 300)]
    tables = [cache.table_for(n) for n in lens]
    block_tables = cache.padded_tables(tables).to(torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = gqa_query(gen, 2, 2, 32, torch.float32)
    ref = reference.paged_decode_attention(q, cache.k, cache.v, block_tables.long(), context_lens.long(), 0.2)
    exact = reference.paged_decode_attention(q.double(), cache.k.double(), cache.v.double(), block_tables.long(), context_lens.long(), 0.2)
    k_poisoned, v_poisoned = cache.poisoned()
    out = tk.paged_decode_attention(q, k_poisoned, v_poisoned, block_tables, context_lens, 0.2)  # no max_len, own output
    check_close(out, ref, exact, torch.float32, f"decode seed={seed} lens={lens}")


# ---------------------------------------------------------------------------------------------
# extend (prefill over a cached prefix)
# ---------------------------------------------------------------------------------------------


def ragged_extend_specs(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) per sequence: cold prefill, block-aligned and unaligned
    cache hits, a single new token, a sequence with no new tokens, and random ones."""
    specs = [
        (0, rng.randint(2, 40)),
        (2 * block_size, rng.randint(1, 30)),
        (rng.randint(1, 3 * block_size), 1),
        (rng.randint(1, 2 * block_size), 0),
        (rng.randint(1, 3 * block_size), rng.randint(17, 45)),  # several row tiles with GQA
    ]
    specs += [(rng.randint(0, 2 * block_size), rng.randint(1, 20)) for _ in range(rng.randint(0, 2))]
    rng.shuffle(specs)
    return specs


@pytest.mark.parametrize("dtype,rep,block_size", PAIRWISE, ids=str)
def test_extend_matches_reference(dtype, rep, block_size):
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    head_dim = HEAD_DIM[rep]
    cache = PagedCache(gen, rng, 96, block_size, dtype, head_dim)
    specs = ragged_extend_specs(rng, block_size)
    tables = [cache.table_for(pre + new) for pre, new in specs]
    block_tables = cache.padded_tables(tables)
    query_start_loc = torch.tensor([0, *itertools.accumulate(new for _, new in specs)], dtype=torch.int64)
    seq_lens = torch.tensor([pre + new for pre, new in specs], dtype=torch.int64)
    q = gqa_query(gen, int(query_start_loc[-1]), rep, head_dim, dtype)
    scale = head_dim**-0.5
    ref = reference.paged_extend_attention(q, cache.k, cache.v, block_tables, query_start_loc, seq_lens, scale)
    exact = reference.paged_extend_attention(
        q.double(), cache.k.double(), cache.v.double(), block_tables, query_start_loc, seq_lens, scale
    )
    k_poisoned, v_poisoned = cache.poisoned()
    out = torch.full_like(q, float("nan"))
    max_query_len = max(new for _, new in specs)
    got = tk.paged_extend_attention(
        q, k_poisoned, v_poisoned, block_tables, query_start_loc, seq_lens, scale, max_query_len=max_query_len, out=out
    )
    assert got is out
    check_close(out, ref, exact, dtype, f"extend seed={seed} specs={specs}")


def test_extend_without_max_query_len_and_into_a_slice():
    """The engine writes decodes and extends into one output; the extend part is a row slice."""
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    cache = PagedCache(gen, rng, 32, 16, torch.float32, 32)
    specs = [(rng.randint(0, 40), rng.randint(1, 30)) for _ in range(3)]
    tables = [cache.table_for(pre + new) for pre, new in specs]
    block_tables = cache.padded_tables(tables)
    query_start_loc = torch.tensor([0, *itertools.accumulate(new for _, new in specs)])
    seq_lens = torch.tensor([pre + new for pre, new in specs])
    q = gqa_query(gen, int(query_start_loc[-1]), 3, 32, torch.float32)
    ref = reference.paged_extend_attention(q, cache.k, cache.v, block_tables, query_start_loc, seq_lens, 0.17)
    exact = reference.paged_extend_attention(q.double(), cache.k.double(), cache.v.double(), block_tables, query_start_loc, seq_lens, 0.17)
    k_poisoned, v_poisoned = cache.poisoned()
    full = torch.full((q.shape[0] + 5, q.shape[1], q.shape[2]), float("nan"))
    tk.paged_extend_attention(q, k_poisoned, v_poisoned, block_tables, query_start_loc, seq_lens, 0.17, out=full[5:])
    assert torch.isnan(full[:5]).all(), "wrote outside its slice"
    check_close(full[5:], ref, exact, torch.float32, f"extend seed={seed} specs={specs}")


# ---------------------------------------------------------------------------------------------
# KV store
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache_matches_reference_and_skips_padding(dtype, block_size):
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    num_blocks, head_dim = 6, 48
    num_tokens = rng.randint(5, 40)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    for i in rng.sample(range(num_tokens), rng.randint(1, 4)):
        slots[i] = -1  # padding: must not be stored anywhere
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # K and V as strided views of one fused projection, as the model passes them
    fused = torch.randn(num_tokens, 3 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    key, value = fused[:, NUM_KV_HEADS : 2 * NUM_KV_HEADS], fused[:, 2 * NUM_KV_HEADS :]
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    tk.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    reference.store_kv_cache(key, value, k_ref, v_ref, slot_mapping)
    what = f"store seed={seed} slots={slots}"
    assert torch.equal(k_cache.isnan(), k_ref.isnan()) and torch.equal(v_cache.isnan(), v_ref.isnan()), f"{what}: wrong slots written"
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    written = int((~k_cache.view(-1, NUM_KV_HEADS, head_dim).isnan().all(-1).all(-1)).sum())
    assert written == sum(s >= 0 for s in slots), what


def test_store_kv_cache_all_padding_writes_nothing():
    k_cache = torch.full((2, 16, NUM_KV_HEADS, 16), float("nan"))
    v_cache = k_cache.clone()
    key = torch.randn(3, NUM_KV_HEADS, 16)
    tk.store_kv_cache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (21, 2.5), (0, 1.5)])
def test_triton_kernels_window_softcap(window, softcap):
    """Sliding window and soft-cap (issue 33) against the reference: split decodes, and a chunk
    over cached keys whose first rows see none of the first key tiles."""
    from chatserve.kernels.reference import paged_masked_attention

    gen = torch.Generator().manual_seed(2)
    bs, kvh, d = 16, 2, 32
    k_cache = torch.randn(12, bs, kvh, d, generator=gen)
    v_cache = torch.randn(12, bs, kvh, d, generator=gen)
    tables = [[3, 7, 1, 9, 0], [2, 8, 4, 5, 6]]
    q_dec = torch.randn(2, 4, d, generator=gen)
    dec_pos = [70, 40]
    ref = paged_masked_attention(q_dec, k_cache, v_cache, tables, [0, 1, 2], dec_pos, 0.2, window=window, softcap=softcap)
    out = tk.paged_decode_attention(q_dec, k_cache, v_cache, torch.tensor(tables), torch.tensor([p + 1 for p in dec_pos]),
                                    0.2, num_splits=3, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    q_ext = torch.randn(30, 4, d, generator=gen)  # 30 new rows after 35 cached keys, and 9 from scratch
    qsl = [0, 21, 30]
    starts = [35, 0]
    ref = paged_masked_attention(q_ext, k_cache, v_cache, tables, qsl, starts, 0.2, window=window, softcap=softcap)
    out = tk.paged_extend_attention(q_ext, k_cache, v_cache, torch.tensor(tables), torch.tensor(qsl), torch.tensor([56, 9]),
                                    0.2, block_m=16, block_n=16, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
