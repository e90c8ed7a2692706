"""Everything a decoder layer and the sampler do per row gives a row the same bits whatever else
is in the batch (issue 20): the C++ norms, rotary and silu*up and their torch fallbacks, the
embedding, and sampling (greedy ties, seeded draws with temperature, top-k, top-p, min-p).
The matmul and attention have their own tests (test_cpu_attention.py and the matmul's)."""

from __future__ import annotations

import pytest
import torch

from chatserve.layers.activation import SiluAndMul
from chatserve.layers.norm import RMSNorm
from chatserve.layers.rotary import QKRotary
from chatserve.sampling_params import SamplingParams
from chatserve.worker.sampler import Sampler, _logsumexp, make_generator

# row counts either side of the kernels' thread split (64 rows) and a prefill chunk
BATCHES = (1, 2, 7, 64, 65, 300)


def assert_rows_invariant(fn, rows: torch.Tensor) -> None:
    """fn over every batch of BATCHES rows of `rows` (at several offsets) against fn of each row alone."""
    alone = torch.cat([fn(rows[i : i + 1]) for i in range(rows.shape[0])])
    for m in BATCHES:
        for start in {0, (rows.shape[0] - m) // 2, rows.shape[0] - m}:
            out = fn(rows[start : start + m])
            assert torch.equal(out, alone[start : start + m]), (m, start)


def _rows(n: int, d: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen) * 3).to(dtype)


def _norm(kernels, dtype) -> RMSNorm:
    norm = RMSNorm(576, 1e-5, kernels)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=torch.Generator().manual_seed(1)) + 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_rms_norm_and_residual_add_are_row_invariant(kernels, with_kernels, dtype):
    norm = _norm(kernels if with_kernels else None, dtype)
    x = _rows(300, 576, dtype)
    residual = _rows(300, 576, dtype, seed=2)
    with torch.inference_mode():
        assert_rows_invariant(norm, x)
        # add_and_norm updates the residual in place on the C++ path: work on copies; pack both outputs
        rows = torch.cat([x, residual], dim=1)
        assert_rows_invariant(lambda r: torch.cat(norm.add_and_norm(r[:, :576], r[:, 576:].clone()), dim=1), rows)


@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_silu_mul_is_row_invariant(kernels, with_kernels):
    act = SiluAndMul(1536, kernels if with_kernels else None)
    with torch.inference_mode():
        assert_rows_invariant(act, _rows(300, 3072))


@pytest.mark.parametrize("with_kernels", [True, False], ids=["cpp", "torch"])
def test_rotary_is_row_invariant(kernels, with_kernels):
    """q|k|v rows with each row's own cos/sin (its position): a row rotates the same in any batch."""
    heads, kv_heads, d = 9, 3, 64
    rotate = QKRotary(heads, kv_heads, d, qk_norm=None, kernels=kernels if with_kernels else None)
    n, width = 300, (heads + 2 * kv_heads) * d
    gen = torch.Generator().manual_seed(4)
    angles = (torch.rand(n, 1, d // 2, generator=gen) * 300).repeat(1, 1, 2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    table = torch.cat([_rows(n, width), cos.view(n, d), sin.view(n, d)], dim=1)

    def fn(r: torch.Tensor) -> torch.Tensor:
        qkv = r[:, :width].clone()  # the C++ pass rotates in place
        c, s = r[:, width : width + d].unsqueeze(1), r[:, width + d :].unsqueeze(1)
        q, k, v = rotate(qkv, c.contiguous(), s.contiguous())
        return torch.cat([q.reshape(len(r), -1), k.reshape(len(r), -1), v.reshape(len(r), -1)], dim=1)

    with torch.inference_mode():
        assert_rows_invariant(fn, table)


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
