"""The C++ paged attention kernels and their backend: against the torch reference, and one row's
bits the same however the row is scheduled (issue 20): alone as a decode, inside a long prefill, in
a chunk over cached keys, in a cascade group sharing a prefix, with any block size.

Every test runs once per kernel tier this CPU runs (issue #30): csrc/tier_attention.cpp over
csrc/vec.h, built for that tier (kernels/tiers.py build_tier_family)."""

from __future__ import annotations

import subprocess
import sysconfig
from types import SimpleNamespace

import pytest
import torch

from chatserve.attention.base import BatchLayout, slots_of
from chatserve.attention.cpu_backend import CpuPagedAttentionBackend, group_sequences
from chatserve.kernels.build import COMMON_CFLAGS, CSRC, build_root, sources_hash
from chatserve.kernels.reference import paged_extend_attention
from chatserve.kernels.tiers import TIERS, build_tier_family, cpu_flags, supported_tiers, tier_source
from tests.conftest import PROCESS_ENGINE_ARGS

CAP = PROCESS_ENGINE_ARGS.max_cpu_tier  # this run's $CHATSERVE_MAX_CPU_TIER (EngineArgs.from_env)

TESTED = [t.name for t in supported_tiers(cap=CAP)]


@pytest.fixture(scope="module", params=TESTED or ["none"])
def kernels(request):
    """The attention kernels of one tier: paged_attention, store_kv_paged, store_kv (and tier)."""
    if request.param == "none":
        pytest.skip("no kernel tier on this CPU (needs AVX2 + FMA)")
    ext = build_tier_family("attention", TIERS[request.param])
    if ext is None:
        pytest.fail(f"the {request.param} attention kernel did not build (a tier this CPU runs)")
    return SimpleNamespace(tier=request.param, paged_attention=ext.paged_attention_bf16,
                           store_kv_paged=ext.store_kv_paged_bf16, store_kv=ext.store_kv_bf16)


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def paged(kernels, k_cache, v_cache):
    """Plain [blocks, block_size, KVH, D] caches rewritten in the kernel's layout (store_kv_paged of every slot)."""
    n, kvh, d = k_cache.shape[0] * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    k_out, v_out = torch.empty_like(k_cache), torch.empty_like(v_cache)
    kernels.store_kv_paged(k_cache.reshape(n, kvh, d), v_cache.reshape(n, kvh, d), k_out, v_out, torch.arange(n))
    return k_out, v_out


def attend(kernels, q, k_cache, v_cache, tables, seqs, groups=None, scale=0.125):
    """seqs: (start position, new tokens) per sequence, their rows packed in order in q; plain caches."""
    return attend_paged(kernels, q, *paged(kernels, k_cache, v_cache), tables, seqs, groups, scale)


def attend_paged(kernels, q, k_cache, v_cache, tables, seqs, groups=None, scale=0.125, window=0, softcap=0.0):
    """`attend` over caches already in the kernel's layout (bf16 or int8); window / soft-cap passed when set."""
    query_start = [0]
    for _, n in seqs:
        query_start.append(query_start[-1] + n)
    groups = groups or [[i] for i in range(len(seqs))]
    group_start = [0]
    for g in groups:
        group_start.append(group_start[-1] + len(g))
    width = max(len(t) for t in tables)
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    extra = (window, softcap) if window or softcap else ()
    return kernels.paged_attention(q, k_cache, v_cache, _i64(padded), _i64(query_start), _i64([s for s, _ in seqs]),
                                   _i64([i for g in groups for i in g]), _i64(group_start), scale, *extra)


def reference(q, k_cache, v_cache, tables, seqs, scale=0.125):
    query_start = [0]
    for _, n in seqs:
        query_start.append(query_start[-1] + n)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor([s + n for s, n in seqs])
    return paged_extend_attention(q.float(), k_cache.float(), v_cache.float(), padded, torch.tensor(query_start), seq_lens, scale)


def _setup(heads, kv_heads, head_dim, block_size, seqs, seed, num_blocks=96):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for i, (start, n) in enumerate(seqs):
        count = -(-(start + n) // block_size)
        tables.append([perm[(i * 11 + j) % num_blocks] for j in range(count)])
    rows = sum(n for _, n in seqs)
    q = (torch.randn(rows, heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
    return q, k_cache, v_cache, tables


# ragged: decodes at block edges, a prefill from 0, chunks over cached keys, one long row
SEQS = [(0, 1), (15, 1), (16, 1), (0, 37), (40, 20), (100, 1), (3, 60), (0, 17), (250, 1)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 32), (16, 1, 64, 8), (6, 2, 96, 64), (2, 1, 256, 16), (3, 3, 64, 128),
    (6, 2, 32, 4),
])
def test_paged_attention_matches_reference_and_every_row_alone(kernels, heads, kv_heads, head_dim, block_size):
    """GQA of 1-16 query heads per KV head, head_dim 32-256, blocks smaller and larger than the
    kernel's 16-key tile: close to the fp32 reference, and each row computed alone (as the decode of
    its position) has exactly the bits it has inside its prefill or chunk."""
    q, k_cache, v_cache, tables = _setup(heads, kv_heads, head_dim, block_size, SEQS, seed=heads * 100 + head_dim)
    scale = head_dim**-0.5
    out = attend(kernels, q, k_cache, v_cache, tables, SEQS, scale=scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, SEQS, scale), atol=1.5e-2, rtol=1e-2)
    row = 0
    for i, (start, n) in enumerate(SEQS):
        for j in range(n):
            if n > 20 and j % 7:  # long chunks: a sample of their rows
                continue
            alone = attend(kernels, q[row + j : row + j + 1], k_cache, v_cache, [tables[i]], [(start + j, 1)], scale=scale)
            assert torch.equal(alone, out[row + j : row + j + 1]), (i, j)
        row += n


def test_a_prompt_gives_the_same_bits_in_one_piece_in_chunks_and_decoded(kernels):
    """A 300-token prompt attended in one call, in chunks of 1-128 tokens over its cached keys
    (the chunked prefill), and token by token: bit-identical rows."""
    n = 300
    q, k_cache, v_cache, tables = _setup(9, 3, 64, 16, [(0, n)], seed=7)
    whole = attend(kernels, q, k_cache, v_cache, tables, [(0, n)])
    for chunk in (1, 5, 16, 96, 128):
        parts = [attend(kernels, q[s : s + chunk], k_cache, v_cache, tables, [(s, min(chunk, n - s))]) for s in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk


def test_cascade_groups_give_the_bits_of_plain_attention(kernels):
    """Decoders and chunks sharing a 20-block cached prefix, read once per group: the same bits as
    each sequence attended on its own, and with the batch in any grouping or order."""
    gen = torch.Generator().manual_seed(3)
    block = 16
    k_cache = torch.randn(120, block, 3, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(120, block, 3, 64, generator=gen).to(torch.bfloat16)
    shared = list(range(20))
    seqs = [(320 + 3 * i, 1) for i in range(6)] + [(320, 40), (330, 7)]
    tables = [shared + list(range(20 + 4 * i, 24 + 4 * i)) for i in range(len(seqs))]
    q = torch.randn(sum(n for _, n in seqs), 9, 64, generator=gen).to(torch.bfloat16)
    plain = attend(kernels, q, k_cache, v_cache, tables, seqs)
    found = group_sequences(tables, [s for s, _ in seqs], block)
    assert found[0] == list(range(len(seqs)))  # all share the prefix: one group
    assert torch.equal(attend(kernels, q, k_cache, v_cache, tables, seqs, groups=found), plain)
    assert torch.equal(attend(kernels, q, k_cache, v_cache, tables, seqs, groups=[[7, 0, 5], [2, 1, 6, 3, 4]]), plain)
    torch.testing.assert_close(plain.float(), reference(q, k_cache, v_cache, tables, seqs), atol=1.5e-2, rtol=1e-2)


def test_backend_stores_kv_then_attends_with_a_row_independent_of_the_batch(kernels):
    """Through the backend (store K/V, then attend): a sequence's decode row in a batch of other
    decodes and prefill chunks equals the same row in a step of its own."""
    block = 16
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.zeros(64, block, 3, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    backend = CpuPagedAttentionBackend(kernels)
    # fill sequence A's first 70 positions (blocks 0-4) and B's 200 (blocks 10-22)
    ta, tb, tc = list(range(5)), list(range(10, 23)), list(range(30, 40))

    def step(layout, token_slots, q, k, v):
        meta = backend.prepare(layout, torch.device("cpu"))
        return backend.forward(q, k, v, k_cache, v_cache, torch.tensor(token_slots), meta, 0.125)

    def rand(t):
        return [torch.randn(t, h, 64, generator=gen).to(torch.bfloat16) for h in (9, 3, 3)]

    q, k, v = rand(70 + 200)
    step(BatchLayout([], [], [0, 0], [70, 200], [ta, tb], block), slots_of(ta, 0, 70, block) + slots_of(tb, 0, 200, block), q, k, v)
    qa, ka, va = rand(1)
    alone = step(BatchLayout([70], [ta], [], [], [], block), slots_of(ta, 70, 71, block), qa, ka, va)
    # the same decode (K/V rewritten with the same values) beside B's decode and C's 150-token prefill
    qb, kb, vb = rand(1)
    qc, kc, vc = rand(150)
    layout = BatchLayout([200, 70], [tb, ta], [0], [150], [tc], block)
    slots = slots_of(tb, 200, 201, block) + slots_of(ta, 70, 71, block) + slots_of(tc, 0, 150, block)
    mixed = step(layout, slots, torch.cat([qb, qa, qc]), torch.cat([kb, ka, kc]), torch.cat([vb, va, vc]))
    assert torch.equal(mixed[1:2], alone)


def test_store_kv_paged_reads_strided_rows_skips_and_refuses_bad_slots(kernels):
    """K/V views out of a fused projection, -1 slots skipped: the slots written are exactly the
    ones a plain-layout store writes, once both are read back through attention."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, (9 + 3 + 3) * 64, generator=gen).to(torch.bfloat16)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64), qkv[:, 12 * 64 :].view(7, 3, 64)
    slots = torch.tensor([0, 79, -1, 17, 40, -1, 33])
    plain_k, plain_v = torch.zeros(5, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(5, 16, 3, 64, dtype=torch.bfloat16)
    kernels.store_kv(k, v, plain_k, plain_v, slots)
    k_cache, v_cache = torch.zeros_like(plain_k), torch.zeros_like(plain_v)
    kernels.store_kv_paged(k, v, k_cache, v_cache, slots)
    assert torch.equal(paged(kernels, plain_k, plain_v)[0], k_cache) and torch.equal(paged(kernels, plain_k, plain_v)[1], v_cache)
    for bad in (80, -2):
        with pytest.raises(RuntimeError, match="outside the KV pool"):
            kernels.store_kv_paged(k[:1], v[:1], k_cache, v_cache, torch.tensor([bad]))


def test_paged_attention_refuses_bad_input(kernels):
    k_cache = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        attend(kernels, q, k_cache, k_cache, [[7]], [(4, 1)])
    with pytest.raises(RuntimeError, match="context length"):
        attend(kernels, q, k_cache, k_cache, [[1]], [(16, 1)])
    with pytest.raises(RuntimeError, match="head_dim"):
        attend(kernels, torch.zeros(1, 2, 48, dtype=torch.bfloat16), torch.zeros(4, 16, 1, 48, dtype=torch.bfloat16),
               torch.zeros(4, 16, 1, 48, dtype=torch.bfloat16), [[1]], [(0, 1)])
    with pytest.raises(RuntimeError, match="seq_order"):
        attend(kernels, torch.zeros(2, 2, 64, dtype=torch.bfloat16), k_cache, k_cache, [[1], [2]], [(0, 1), (0, 1)],
               groups=[[0, 0]])
    with pytest.raises(RuntimeError, match="query_start"):
        kernels.paged_attention(q, k_cache, k_cache, _i64([[1]]), _i64([0, 2]), _i64([0]), _i64([0]), _i64([0, 1]), 0.1)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_every_block_size_gives_the_bits_of_a_cold_prefill_cached_or_decoded(kernels, block_size):
    """A 150-token prompt at one block size: its rows attended cold in one call, as a 50-token chunk
    over a 100-token cached prefix, its last row as a decode, and the prompt in a batch beside a
    decode and another prompt: bit-identical rows, close to the fp32 reference. And the same keys
    and values stored at block size 16 give the same bits (tiles are 16 keys whatever the block)."""
    seqs = [(0, 150)]
    q, k_cache, v_cache, tables = _setup(9, 3, 64, block_size, seqs, seed=block_size)
    cold = attend(kernels, q, k_cache, v_cache, tables, seqs)
    torch.testing.assert_close(cold.float(), reference(q, k_cache, v_cache, tables, seqs), atol=1.5e-2, rtol=1e-2)
    assert torch.equal(attend(kernels, q[100:], k_cache, v_cache, tables, [(100, 50)]), cold[100:])
    assert torch.equal(attend(kernels, q[149:], k_cache, v_cache, tables, [(149, 1)]), cold[149:])
    others = torch.randn(1 + 30, 9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    batch = attend(kernels, torch.cat([others[:1], q, others[1:]]), k_cache, v_cache,
                   [tables[0][::-1], tables[0], tables[0][1:] + tables[0][:1]], [(70, 1), (0, 150), (3, 30)])
    assert torch.equal(batch[1:151], cold)
    # the same K/V sequence in blocks of 16 (block i of 16 keys at block i of a fresh cache)
    keys = torch.cat([k_cache[b] for b in tables[0]])[:150]
    values = torch.cat([v_cache[b] for b in tables[0]])[:150]
    k16, v16 = torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16)
    k16.view(160, 3, 64)[:150], v16.view(160, 3, 64)[:150] = keys, values
    assert torch.equal(attend(kernels, q, k16, v16, [list(range(10))], seqs), cold)


def test_the_avx512_instantiation_of_the_tiered_kernel_compiles():
    """csrc/tier_attention.cpp compiles for the AVX512-VNNI tier on any x86 host, even where that
    tier cannot run (there the kernel tests above cover it); the object is cached per source hash."""
    tier = TIERS["avx512_vnni"]
    if set(tier.cpu_flags) <= cpu_flags():
        pytest.skip("this CPU runs the AVX512-VNNI tier: the kernel tests build and run it")
    from torch.utils.cpp_extension import include_paths

    source, headers = tier_source("attention"), [CSRC / "vec.h"]
    # the check is that it compiles (templates instantiated, intrinsics' targets checked): -O0, 38 s against 67 s at -O3
    flags = [*(f for f in COMMON_CFLAGS if not f.startswith("-O")), "-O0", *tier.cflags]
    obj = build_root() / f"compile_check_attention_{tier.name}_{sources_hash([source, *headers], flags)}.o"
    if obj.exists():
        return
    obj.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in (str(CSRC), *include_paths(), sysconfig.get_paths()["include"])]
    cmd = ["c++", "-std=c++20", "-fPIC", *flags, *includes, "-DTORCH_EXTENSION_NAME=compile_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-c", str(source), "-o", f"{obj}.tmp"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    (obj.parent / f"{obj.name}.tmp").rename(obj)
