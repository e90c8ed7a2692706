"""Everything a decoder layer and the sampler do per row gives a row the same bits whatever else
is in the batch (issue 20) and however the work is split over threads (issue 51: 1 and 2 compute
threads, forced): the C++ norms, rotary and silu*up, Gemma's GeGLU, fp32-weight norm and final
soft-cap, the q/k-norm and partial-rotary rotations (each on every tier this CPU runs), the
embedding, and sampling (greedy ties, seeded draws with temperature, top-k, top-p, min-p). The torch
fallbacks of the norms, silu and rotary are checked across batches at 1 thread: they run only without
a kernel tier, where the engine makes no invariance claim (LayerOps.batch_invariant is False).
The matmul and attention have their own tests (test_cpu_attention.py and the matmul's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatserve.layers.activation import GeluTanhAndMul, SiluAndMul
from chatserve.layers.norm import RMSNorm
from chatserve.layers.rotary import QKRotary
from chatserve.sampling_params import SamplingParams
from chatserve.worker.sampler import Sampler, _logsumexp, make_generator
from tests.conftest import compute_threads

# row counts either side of the kernels' thread split (64 rows) and a prefill chunk
BATCHES = (1, 2, 7, 64, 65, 300)


def assert_rows_invariant(fn, rows: torch.Tensor, threads: tuple[int, ...] = (1, 2), batches: tuple[int, ...] = BATCHES) -> None:
    """fn over every batch of `batches` rows of `rows` (at several offsets), at each thread count of
    `threads`, against fn of each row alone at 1 thread."""
    with compute_threads(1):
        alone = torch.cat([fn(rows[i : i + 1]) for i in range(rows.shape[0])])
    for n in threads:
        with compute_threads(n):
            for m in batches:
                for start in {0, (rows.shape[0] - m) // 2, rows.shape[0] - m}:
                    out = fn(rows[start : start + m])
                    assert torch.equal(out, alone[start : start + m]), (n, m, start)


def _rows(n: int, d: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen) * 3).to(dtype)


def _norm(kernels, dtype, dim: int = 576) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5, kernels)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=torch.Generator().manual_seed(1)) + 0.5)
    return norm.to(dtype)


def _threads(with_kernels: bool) -> tuple[int, ...]:
    """The C++ kernels at 1 and 2 threads; their torch fallbacks (no kernel tier: no claim) at 1."""
    return (1, 2) if with_kernels else (1,)


@pytest.mark.parametrize("dim", [576, 100])  # 100: a partial vector at the tail on every tier
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_rms_norm_and_residual_add_are_row_invariant(kernels, with_kernels, dtype, dim):
    norm = _norm(kernels if with_kernels else None, dtype, dim)
    x = _rows(300, dim, dtype)
    residual = _rows(300, dim, dtype, seed=2)
    threads = _threads(with_kernels)
    with torch.inference_mode():
        assert_rows_invariant(norm, x, threads)
        # add_and_norm updates the residual in place on the C++ path: work on copies; pack both outputs
        rows = torch.cat([x, residual], dim=1)
        assert_rows_invariant(lambda r: torch.cat(norm.add_and_norm(r[:, :dim], r[:, dim:].clone()), dim=1), rows, threads)


@pytest.mark.parametrize("width", [1536, 72])  # 72: not a multiple of 16 (a torch fallback before issue 51)
@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_silu_mul_is_row_invariant(kernels, with_kernels, width):
    act = SiluAndMul(width, kernels if with_kernels else None)
    with torch.inference_mode():
        assert_rows_invariant(act, _rows(300, 2 * width), _threads(with_kernels))


def test_gemma_ops_are_row_and_thread_invariant(kernels):
    """Gemma's GeGLU (gelu_tanh(gate) * up), its 1 + w RMSNorm in fp32 (rows of hidden_size, and per
    head for Gemma 3's q/k norms) and the final soft-cap: C++ kernels on every tier, a row the same
    bits in any batch at 1 and 2 threads, and close to the torch ops they replace.

    The GeGLU shape is Gemma 2 2B's width plus a ragged tail, with odd batch sizes: there torch's gelu
    (the path before issue 51) fails this very check at 2 threads (an element at a thread's share's
    edge takes its scalar code instead of its vector code: another rounding; seen on a Zen 4 host)."""
    from chatserve.models.gemma import GemmaRMSNorm

    inter = 9216 + 40
    act = GeluTanhAndMul(inter, kernels)  # a partial vector at each row's tail
    x = _rows(300, 2 * inter)

    def gemma_norm(dim: int) -> GemmaRMSNorm:
        norm = GemmaRMSNorm(dim, 1e-6, kernels)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(3)) * 0.3)
        norm = norm.to(torch.bfloat16)
        norm.process_weights()
        return norm

    norm, head_norm = gemma_norm(2304 + 8), gemma_norm(40)
    h = _rows(300, 2304 + 8, seed=5)
    logits = torch.randn(70, 4099, generator=torch.Generator().manual_seed(6)) * 40

    def softcap(r: torch.Tensor) -> torch.Tensor:
        out = r.clone()
        kernels.softcap_(out, 30.0)
        return out

    with torch.inference_mode():
        assert_rows_invariant(act, x, batches=(1, 2, 7, 13, 33, 64, 65, 300))
        assert_rows_invariant(norm, h)
        assert_rows_invariant(lambda r: head_norm(r[:, :320].view(len(r), 8, 40)).reshape(len(r), -1), h)  # per head
        assert_rows_invariant(softcap, logits)
        torch.testing.assert_close(act(x[:4]).float(), F.gelu(x[:4, :inter].float(), approximate="tanh") * x[:4, inter:].float(),
                                   atol=0.05, rtol=0.02)
        h32 = h[:4].float()
        ref = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * norm._scale).to(torch.bfloat16)
        torch.testing.assert_close(norm(h[:4]).float(), ref.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(softcap(logits[:4]), torch.tanh(logits[:4] / 30.0) * 30.0, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_rotary_is_row_invariant(kernels, with_kernels):
    """q|k|v rows with each row's own cos/sin (its position): a row rotates the same in any batch."""
    heads, kv_heads, d = 9, 3, 64
    rotate = QKRotary(heads, kv_heads, d, qk_norm=None, kernels=kernels if with_kernels else None)
    n, width = 300, (heads + 2 * kv_heads) * d
    table = _rotary_table(n, width, d)

    with torch.inference_mode():
        assert_rows_invariant(_rotate_rows(rotate, width, d), table, _threads(with_kernels))


def _rotary_table(n: int, width: int, rot: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    angles = (torch.rand(n, 1, rot // 2, generator=gen) * 300).repeat(1, 1, 2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    return torch.cat([_rows(n, width), cos.view(n, rot), sin.view(n, rot)], dim=1)


def _rotate_rows(rotate: QKRotary, width: int, rot: int):
    def fn(r: torch.Tensor) -> torch.Tensor:
        qkv = r[:, :width].clone()  # the C++ pass rotates in place
        c, s = r[:, width : width + rot].unsqueeze(1), r[:, width + rot :].unsqueeze(1)
        q, k, v = rotate(qkv, c.contiguous(), s.contiguous())
        return torch.cat([q.reshape(len(r), -1), k.reshape(len(r), -1), v.reshape(len(r), -1)], dim=1)

    return fn


@pytest.mark.parametrize("case", ["qk-norm", "qk-norm-full", "partial", "head-dim-48"])
def test_rotary_kernel_paths_are_row_invariant_and_match_torch(kernels, case):
    """The kernel paths that were torch fallbacks before issue 51: per-head q/k norms (Qwen3, Gemma 3),
    whole-projection q/k norms with the clamp (OLMoE), a partial rotary (Phi-4-mini: 3/4 of each head)
    and a head size that is not a multiple of 32. Each row the same bits in any batch at 1 and 2
    threads, and close to the torch path (which rounds after each op)."""
    heads, kv_heads = 4, 2
    d = 48 if case == "head-dim-48" else 64
    rot = 48 if case == "partial" else d
    full = case == "qk-norm-full"
    norms = None
    if case.startswith("qk-norm"):
        q_dim, k_dim = (heads * d, kv_heads * d) if full else (d, d)
        norms = (_norm(kernels, torch.bfloat16, q_dim), _norm(kernels, torch.bfloat16, k_dim))
        torch_norms = (_norm(None, torch.bfloat16, q_dim), _norm(None, torch.bfloat16, k_dim))
    kwargs = dict(rotary_dim=0 if rot == d else rot, qk_norm_full=full, clip_qkv=6.0 if full else None)
    rotate = QKRotary(heads, kv_heads, d, qk_norm=norms, kernels=kernels, **kwargs)
    reference = QKRotary(heads, kv_heads, d, qk_norm=torch_norms if norms else None, kernels=None, **kwargs)
    assert rotate._kernel is not None and not rotate.kernel_fallbacks()
    width = (heads + 2 * kv_heads) * d
    table = _rotary_table(300, width, rot)
    with torch.inference_mode():
        assert_rows_invariant(_rotate_rows(rotate, width, rot), table)
        ours, theirs = _rotate_rows(rotate, width, rot)(table[:8]), _rotate_rows(reference, width, rot)(table[:8])
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.1, rtol=0.02)


def test_embedding_rows_are_exact():
    emb = torch.nn.Embedding(1000, 576).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert_rows_invariant(lambda r: emb(r[:, 0]), ids.unsqueeze(1))


# ---- sampling -------------------------------------------------------------------------------------

VOCAB = 49152


def sample(logits: torch.Tensor, params: list[SamplingParams], generators) -> list[int]:
    batch = logits.shape[0]
    return Sampler()(logits, params, [[1, 2, 3]] * batch, [[4]] * batch, generators).token_ids


def _logits(rows: int, seed: int) -> torch.Tensor:
    # bf16-rounded logits, as the model hands them over: ties are common
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4).to(torch.bfloat16).float()


def test_greedy_ties_go_to_the_lowest_token_on_every_sampler_path():
    """A row whose top logit is shared by three tokens picks the lowest id alone, in an all-greedy
    batch, beside penalised rows, and beside sampled rows (three different code paths)."""
    row = _logits(1, 0)[0]
    row[[30000, 7, 100]] = row.max() + 1.0
    others = _logits(5, 1)
    greedy = SamplingParams(temperature=0.0)
    companions = {
        "alone": [],
        "all greedy": [greedy] * 5,
        "penalised": [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 5,
        "sampled": [SamplingParams(temperature=0.8, seed=9)] * 5,
    }
    for name, extra in companions.items():
        for at in (0, len(extra)):  # first and last row
            params = list(extra)
            params.insert(at, greedy)
            logits = torch.cat([others[: at], row.unsqueeze(0), others[at : len(extra)]])
            gens = [make_generator(p.seed) for p in params]
            assert sample(logits, params, gens)[at] == 7, (name, at)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=1234),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1234),  # top-p alone: the whole vocabulary's sum
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234),
    SamplingParams(temperature=0.8, min_p=0.05, seed=1234),
], ids=["plain", "top-p", "top-k+top-p", "min-p"])
def test_seeded_sampling_does_not_depend_on_the_batch(params):
    """A seeded request's 16 draws, alone and in batches of 2-12 rows at several positions beside
    greedy, unseeded and differently filtered rows: the same tokens; its top-p normaliser the same
    bits alone as in a batch."""
    steps = _logits(16, 100)
    companions = _logits(12, 1000)

    def run(batch: int, at: int) -> list[int]:
        gen = make_generator(params.seed)
        others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.5),
                  SamplingParams(temperature=1.2, top_k=5, seed=7)]
        tokens = []
        for s, row in enumerate(steps):
            rows = companions[:batch].roll(s, dims=1)
            rows[at] = row
            plist = [others[i % len(others)] for i in range(batch)]
            plist[at] = params
            gens = [make_generator(p.seed) if p.seed is not None else None for p in plist]
            gens[at] = gen
            tokens.append(sample(rows, plist, gens)[at])
        return tokens

    alone = run(1, 0)
    for batch, at in ((2, 1), (5, 0), (5, 3), (12, 9)):
        assert run(batch, at) == alone, (batch, at)
    scaled = _logits(32, 3) / 0.8
    assert all(torch.equal(_logsumexp(scaled[i : i + 1]), _logsumexp(scaled)[i : i + 1]) for i in range(0, 32, 5))


def test_lone_row_sum_matches_the_batch_sum_order():
    """The sampler's row sums: a lone row (which torch would split across threads) gets the bits
    it gets in a batch."""
    x = _logits(8, 6).exp()
    full = _logsumexp(x.log())
    for i in range(8):
        assert torch.equal(_logsumexp(x[i : i + 1].log()), full[i : i + 1])
