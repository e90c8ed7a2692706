from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from chatserve.sampling_params import SamplingParams
from chatserve.worker.sampler import (
    Sampler,
    SamplingTensors,
    apply_penalties,
    apply_top_k_top_p_min_p,
    greedy_tokens,
    make_generator,
)

# A crafted distribution over V=10 with well-separated cut points.
PROBS = [0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]
LOGITS = torch.tensor(PROBS).log()


def run(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    eos_token_ids: Sequence[int] = (),
):
    batch = logits.shape[0]
    return Sampler()(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(batch)],
        outputs if outputs is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch,
        eos_token_ids=eos_token_ids,
    )


def draw(params: SamplingParams, draws: int = 2000, logits: torch.Tensor = LOGITS) -> Counter[int]:
    """Many draws in one batched call: every row is the same distribution."""
    torch.manual_seed(1234)
    result = run(logits.expand(draws, -1), [params] * draws)
    return Counter(result.token_ids)


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    result = run(logits, [SamplingParams(temperature=0)] * 8)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 8


def test_greedy_tokens_match_torch_max_on_ties_nan_and_inf() -> None:
    """The numpy argmax of the greedy path returns torch.max(dim)'s indices: the first of tied maxima,
    a NaN as the largest, index 0 of a row of -inf, -0.0 and 0.0 as equals."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        logits = torch.randint(-3, 3, (1 + trial % 5, 200), generator=gen).float()  # many ties
        if trial % 7 == 0:
            logits[0, trial % 200] = float("nan")
        if trial % 11 == 0:
            logits[:, 5] = float("nan")
        if trial % 13 == 0:
            logits[-1] = float("-inf")
        if trial % 17 == 0:
            logits[0, :3] = float("-inf")
            logits[0, 3:] = torch.where(torch.arange(197) % 2 == 0, -0.0, 0.0)
        expected = logits.max(dim=-1).indices
        assert torch.equal(greedy_tokens(logits), expected), trial
        assert torch.equal(greedy_tokens(logits[:, ::2]), logits[:, ::2].max(dim=-1).indices), trial


def test_top_k_one_is_greedy_and_greedy_rows_ignore_sampled_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams()] * 2
    result = run(logits, params)
    expected = logits.argmax(dim=-1).tolist()
    for row in (0, 1, 3, 4):
        assert result.token_ids[row] == expected[row]


def test_low_dtype_logits_are_accepted_and_not_mutated() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, top_p=0.5, min_p=0.1, logprobs=2)] * 4
    run(logits, params, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4)
    assert torch.equal(logits, before)
    result = run(logits.to(torch.bfloat16), [SamplingParams(temperature=0)] * 4)
    assert result.token_ids == logits.to(torch.bfloat16).float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-3, 1e-8])
def test_very_low_temperature_behaves_like_greedy(temperature: float) -> None:
    counts = draw(SamplingParams(temperature=temperature), draws=500)
    assert counts == Counter({0: 500})


# --- filters on a crafted distribution ----------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(), set(range(10))),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.6), {0, 1, 2}),  # mass before token 3 is 0.65 >= 0.6
        (SamplingParams(top_p=0.01), {0}),  # the top token is always kept
        (SamplingParams(min_p=0.3), {0, 1, 2, 3}),  # keeps p >= 0.09
        (SamplingParams(top_k=5, top_p=0.85), {0, 1, 2, 3}),  # top-p renormalises over the top 5
        (SamplingParams(top_k=8, min_p=0.4), {0, 1, 2}),
        (SamplingParams(temperature=0.5, top_p=0.8), {0, 1, 2}),  # sharpened to (0.51, 0.23, 0.13, 0.06, ...)
    ],
    ids=["none", "top_k", "top_p", "tiny_top_p", "min_p", "top_k+top_p", "top_k+min_p", "temperature+top_p"],
)
def test_filters_never_pick_excluded_and_do_pick_every_allowed_token(
    params: SamplingParams, allowed: set[int]
) -> None:
    counts = draw(params)
    assert set(counts) == allowed


def test_masked_logits_are_never_picked() -> None:
    logits = torch.zeros(10)
    logits[::2] = float("-inf")
    counts = draw(SamplingParams(temperature=2.0), logits=logits)
    assert set(counts) == {1, 3, 5, 7, 9}


def test_sampling_follows_the_distribution() -> None:
    draws = 20000
    counts = draw(SamplingParams(), draws=draws)
    for token, prob in enumerate(PROBS):
        assert abs(counts[token] / draws - prob) < 0.015, (token, counts[token] / draws, prob)


def test_rows_of_one_batch_use_their_own_parameters() -> None:
    torch.manual_seed(5)
    draws = 1000
    params = [SamplingParams(top_k=2), SamplingParams(min_p=0.3), SamplingParams(temperature=0)]
    result = run(LOGITS.expand(3 * draws, -1), params * draws)
    per_kind = [set(result.token_ids[i::3]) for i in range(3)]
    assert per_kind == [{0, 1}, {0, 1, 2, 3}, {0}]


def _reference_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Straightforward single-row top-k / top-p / min-p with a full sort, as ground truth."""
    row = logits.clone()
    order = row.argsort(descending=True)
    if params.top_k > 0:
        row[order[params.top_k :]] = float("-inf")
    if params.top_p < 1.0:
        probs = row.softmax(-1)[order]
        before = probs.cumsum(-1) - probs
        drop = before >= params.top_p
        drop[0] = False
        row[order[drop]] = float("-inf")
    if params.min_p > 0:
        probs = row.softmax(-1)
        row[probs < params.min_p * probs.max()] = float("-inf")
    return row


@pytest.mark.parametrize("spread", [0.5, 4.0])  # flat rows take top-p's full-sort fallback
def test_filters_match_a_full_sort_reference(spread: float) -> None:
    generator = torch.Generator().manual_seed(3)
    vocab = 700
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=40),
        SamplingParams(top_k=7),
        SamplingParams(min_p=0.2),
        SamplingParams(),
        SamplingParams(top_k=600, top_p=0.95, min_p=0.01),
        SamplingParams(top_p=0.99),
    ]
    logits = torch.randn(len(params), vocab, generator=generator) * spread
    filtered = apply_top_k_top_p_min_p(logits, SamplingTensors.from_params(params))
    for i, p in enumerate(params):
        expected = _reference_filters(logits[i], p)
        assert torch.equal(filtered[i].isinf(), expected.isinf()), (p, (filtered[i].isinf() ^ expected.isinf()).sum())


# --- seeds --------------------------------------------------------------------------------------


def _seeded_sequence(seed: int, steps: int, row: int, batch: int, neighbour_seed: int | None) -> list[int]:
    torch.manual_seed(neighbour_seed if neighbour_seed is not None else 99)
    logits_gen = torch.Generator().manual_seed(11)  # same logits at every call of this helper
    params = [SamplingParams(top_p=0.95) if i != row else SamplingParams(seed=seed) for i in range(batch)]
    generators = [
        make_generator(seed) if i == row else make_generator(neighbour_seed if i % 2 else None) for i in range(batch)
    ]
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch, 1000, generator=logits_gen)
        logits[row] = torch.randn(1000, generator=torch.Generator().manual_seed(len(tokens)))
        tokens.append(run(logits, params, generators=generators).token_ids[row])
    return tokens


def test_same_seed_gives_same_sequence_regardless_of_batch_position_and_neighbours() -> None:
    reference = _seeded_sequence(seed=42, steps=12, row=0, batch=1, neighbour_seed=None)
    assert reference == _seeded_sequence(seed=42, steps=12, row=0, batch=1, neighbour_seed=None)
    assert reference == _seeded_sequence(seed=42, steps=12, row=3, batch=5, neighbour_seed=7)
    assert reference == _seeded_sequence(seed=42, steps=12, row=6, batch=8, neighbour_seed=None)
    assert reference != _seeded_sequence(seed=43, steps=12, row=0, batch=1, neighbour_seed=None)


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# --- penalties ----------------------------------------------------------------------------------


def _penalised(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    tensors = SamplingTensors.from_params([params])
    return apply_penalties(torch.tensor([logits]), tensors, [prompt], [output])[0].tolist()


def test_repetition_penalty_covers_prompt_and_output_once_per_token() -> None:
    logits = [2.0, -1.0, 3.0, 0.5, 4.0]
    params = SamplingParams(repetition_penalty=2.0)
    # token 0 twice in the prompt is penalised once; token 1 (output) is negative so it is multiplied.
    assert _penalised(logits, params, prompt=[0, 0, 3], output=[1]) == [1.0, -2.0, 3.0, 0.25, 4.0]


def test_frequency_and_presence_count_output_tokens_only() -> None:
    logits = [1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    result = _penalised(logits, params, prompt=[0, 0, 0], output=[3, 3, 1, 3])
    assert result == pytest.approx([1.0, 1.0 - 0.5 - 0.25, 1.0, 1.0 - 1.5 - 0.25])


def test_penalties_only_touch_their_own_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3, frequency_penalty=1.0), SamplingParams()]
    out = apply_penalties(logits, SamplingTensors.from_params(params), [[1, 2]] * 3, [[4, 4]] * 3)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    changed = (out[1] != logits[1]).nonzero().flatten().tolist()
    assert changed == [1, 2, 4]


def test_penalty_changes_the_greedy_choice_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2)]
    result = run(logits, params, prompts=[[0]])
    assert result.token_ids == [1]
    entry = result.logprobs[0]
    assert entry is not None
    raw = torch.log_softmax(logits[0], -1)
    assert entry.token_id == 1 and entry.rank == 2
    assert entry.logprob == pytest.approx(raw[1].item(), abs=1e-6)
    assert [t for t, _ in entry.top] == [0, 1]


def test_token_ids_outside_the_vocabulary_are_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        run(torch.zeros(1, 5), [SamplingParams(repetition_penalty=1.2)], prompts=[[7]])


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_n_and_correct_rank() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 200) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=20, frequency_penalty=1.0, logprobs=5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0, logprobs=20),
        SamplingParams(),
    ]
    result = run(logits, params, outputs=[[1, 2, 3]] * 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[3] is None
    for row, n in ((0, 5), (1, 0), (2, 20)):
        entry = result.logprobs[row]
        assert entry is not None
        token = result.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[row, token].item(), abs=1e-5)
        assert entry.rank == int((raw[row] > raw[row, token]).sum()) + 1
        assert len(entry.top) == n
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        expected = raw[row].topk(n) if n else None
        if expected is not None:
            assert [t for t, _ in entry.top] == expected.indices.tolist()
            assert values == pytest.approx(expected.values.tolist(), abs=1e-5)
    assert result.logprobs[2] is not None and result.logprobs[2].rank == 1


# --- min_tokens and input checks ----------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
    ]
    result = run(logits, params, outputs=[[3], [3], [3, 3]], eos_token_ids=[0])
    assert result.token_ids == [2, 0, 0]


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="generators"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()] * 2, [[], []], [[], []], [None])


def test_empty_batch() -> None:
    result = run(torch.zeros(0, 5), [])
    assert result.token_ids == [] and result.logprobs == []
