"""Batched next-token sampling where every row carries its own ``SamplingParams``.

Order of operations (vLLM / Hugging Face):

1. logprobs are taken from the RAW distribution (``log_softmax`` of the model's
   logits), as vLLM reports them by default: before the grammar mask, penalties
   and temperature;
2. the grammar mask (structured outputs): on rows with a grammar matcher, every
   token the grammar cannot take next gets ``-inf`` (one batched bitmask; other
   rows are not touched, so they stay bit-identical);
3. the request's token rules (vLLM's logits processors): ``allowed_token_ids``
   (every other token ``-inf``), ``bad_words`` (a word's last token ``-inf``
   when the output ends in the tokens before it), ``logit_bias`` (added to the
   logit); each on its own row only;
4. penalties: repetition (HF style, over prompt + output), then frequency and
   presence (OpenAI style, over output only);
5. ``min_tokens``: stop tokens (and EOS unless ``ignore_eos``) are masked while
   a request is still short of its minimum (not on grammar rows: there the
   grammar decides when the output may end, and masking its only allowed token
   would leave nothing to sample);
6. greedy rows take the argmax of the penalised logits;
7. other rows: temperature, top-k, top-p, min-p, then one draw per row.

Excluded tokens get a logit of ``-inf`` and therefore a probability of exactly
0; sampling inverts the CDF, which is flat over such tokens, so an excluded
token is never picked.

Reproducibility: a row with a ``torch.Generator`` draws its one uniform per
step from it and nothing else does, and every stage computes a row from that
row alone in an order that does not depend on the batch (greedy ties go to the
lowest token id), so a seeded request gets the same token whatever else is in
the batch and wherever its row is (tests/worker/test_row_invariance.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatserve.sampling_params import SamplingParams
from chatserve.structured.bitmask import BitmaskFiller, fill_and_apply_bitmask_

# NOTE: temperatures below this are sampled greedily: dividing logits by ~0
# overflows to inf, and softmax then computes inf - inf = NaN.
_MIN_TEMPERATURE = 1e-5
# How many of the most likely tokens top-p looks among before falling back to a full sort.
_TOP_P_CANDIDATES = 256
# Shifted logits below this are treated as probability 0 (see _relative_weights).
_EXP_FLOOR = -80.0


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability under the raw model distribution, and its top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token of the raw distribution
    top: list[tuple[int, float]]  # top-N (token_id, logprob), N = params.logprobs, sorted by logprob descending


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None when that request did not ask for logprobs


@dataclass(frozen=True)
class SamplingTensors:
    """One batch's per-row parameters as ``[B]`` tensors, so each stage is one op over the batch.

    The ``do_*`` flags let a stage be skipped entirely when no row needs it: the
    common batch (all default params) must not pay for a sort over the vocabulary.
    """

    temperatures: torch.Tensor  # [B] float32; 1.0 on greedy rows (never used there)
    top_ks: torch.Tensor  # [B] int64; 0 = disabled
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    greedy: list[bool]
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_repetition: bool
    do_frequency_presence: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        greedy = [row_is_greedy(p) for p in params]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # Greedy rows never reach the filtering stages, so they do not switch them on.
        sampled = [p for p, g in zip(params, greedy) if not g]
        return cls(
            temperatures=f32([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_ps=f32([p.top_p for p in params]),
            min_ps=f32([p.min_p for p in params]),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            presence_penalties=f32([p.presence_penalty for p in params]),
            greedy=greedy,
            do_top_k=any(p.top_k > 0 for p in sampled),
            do_top_p=any(p.top_p < 1.0 for p in sampled),
            do_min_p=any(p.min_p > 0.0 for p in sampled),
            do_repetition=any(p.repetition_penalty != 1.0 for p in params),
            do_frequency_presence=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The same parameters restricted to ``rows`` (the non-greedy subset)."""
        keep = rows.tolist()
        return SamplingTensors(
            temperatures=self.temperatures[rows],
            top_ks=self.top_ks[rows],
            top_ps=self.top_ps[rows],
            min_ps=self.min_ps[rows],
            repetition_penalties=self.repetition_penalties[rows],
            frequency_penalties=self.frequency_penalties[rows],
            presence_penalties=self.presence_penalties[rows],
            greedy=[self.greedy[i] for i in keep],
            do_top_k=self.do_top_k,
            do_top_p=self.do_top_p,
            do_min_p=self.do_min_p,
            do_repetition=self.do_repetition,
            do_frequency_presence=self.do_frequency_presence,
        )


def row_is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request RNG the engine keeps for a seeded request; ``None`` means "use the global RNG".

    Create it on the device the logits live on; a generator elsewhere still
    works (the draw is copied over) but costs a transfer per step.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _flat_keys(
    rows: list[int], token_lists: list[Sequence[int] | torch.Tensor], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``row * V + token`` for every token of ``token_lists[j]`` (row ``rows[j]``): indices into ``logits.view(-1)``.

    Penalties then touch only the positions a request has seen, instead of
    building and combining several ``[B, V]`` tensors per step. Rows may be
    given as tensors (an engine can keep one per request) to skip list conversion.
    """
    parts = [
        t.to(device=device, dtype=torch.long).flatten()
        if isinstance(t, torch.Tensor)
        else torch.tensor(t, dtype=torch.long, device=device)
        for t in token_lists
    ]
    lengths = torch.tensor([part.numel() for part in parts], dtype=torch.long, device=device)
    tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for a vocabulary of {vocab_size} logits")
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long, device=device), lengths)
    return row_ids * vocab_size + tokens


def apply_penalties(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    prompt_token_ids: Sequence[Sequence[int] | torch.Tensor],
    output_token_ids: Sequence[Sequence[int] | torch.Tensor],
) -> torch.Tensor:
    """Repetition penalty over prompt + output, then frequency/presence over output; returns a new tensor.

    Only rows whose penalty is active contribute indices, so other rows are left
    bit-for-bit unchanged.
    """
    if not (tensors.do_repetition or tensors.do_frequency_presence):
        return logits
    vocab = logits.shape[1]
    out = logits.clone()
    flat = out.view(-1)
    if tensors.do_repetition:
        rows = (tensors.repetition_penalties != 1.0).nonzero().flatten().tolist()
        keys = _flat_keys(
            rows * 2,
            [prompt_token_ids[i] for i in rows] + [output_token_ids[i] for i in rows],
            vocab,
            logits.device,
        ).unique()
        seen = flat[keys]
        penalty = tensors.repetition_penalties[keys // vocab]
        flat[keys] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if tensors.do_frequency_presence:
        active = (tensors.frequency_penalties != 0) | (tensors.presence_penalties != 0)
        rows = active.nonzero().flatten().tolist()
        keys = _flat_keys(rows, [output_token_ids[i] for i in rows], vocab, logits.device)
        # NOTE: index_add_ accumulates over duplicate keys, which is exactly the per-token count.
        flat.index_add_(0, keys, -tensors.frequency_penalties[keys // vocab])
        present = keys.unique()
        flat.index_add_(0, present, -tensors.presence_penalties[present // vocab])
    return out


def banned_by_bad_words(bad_words_token_ids: Sequence[Sequence[int]], output: Sequence[int] | torch.Tensor) -> list[int]:
    """vLLM's bad-words rule for one row: a word's last token is banned when the output so far ends in the
    word's other tokens (a one-token word is always banned)."""
    tail = output.tolist() if isinstance(output, torch.Tensor) else list(output)
    banned = []
    for word in bad_words_token_ids:
        before = len(word) - 1
        if before > len(tail):
            continue
        if before == 0 or tail[-before:] == list(word[:before]):
            banned.append(word[-1])
    return banned


def apply_token_rules(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int] | torch.Tensor]
) -> torch.Tensor:
    """allowed_token_ids, then bad_words, then logit_bias, on the rows that set them (a new tensor when
    any does). Each touches only its own row's entries, by index: no reduction over the batch, so a
    row's values do not depend on what else is in it."""
    rows = [i for i, p in enumerate(params) if p.has_token_rules]
    if not rows:
        return logits
    out = logits.clone()
    neg_inf = float("-inf")
    for i in rows:
        p = params[i]
        row = out[i]
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=out.device)
            kept = row[allowed].clone()
            row.fill_(neg_inf)
            row[allowed] = kept
        if p.bad_words_token_ids:
            banned = banned_by_bad_words(p.bad_words_token_ids, output_token_ids[i])
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=out.device)] = neg_inf
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=out.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
    return out


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int] | torch.Tensor],
    eos_token_ids: Sequence[int],
    exempt_rows: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Forbid stopping (stop tokens, and EOS unless ignore_eos) before a request has min_tokens outputs.

    ``exempt_rows`` (grammar rows) are left alone: their grammar decides when they may end.
    """
    rows: list[int] = []
    banned: list[Sequence[int] | torch.Tensor] = []
    vocab = logits.shape[1]
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) >= p.min_tokens or i in exempt_rows:
            continue
        ids = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids.extend(eos_token_ids)
        ids = [t for t in ids if t < vocab]
        if ids:
            rows.append(i)
            banned.append(ids)
    if not rows:
        return logits
    keys = _flat_keys(rows, banned, vocab, logits.device)
    logits = logits.clone()
    logits.view(-1)[keys] = float("-inf")
    return logits


def _top_k_top_p_thresholds(logits: torch.Tensor, tensors: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row logit threshold ``[B, 1]`` below which top-k then top-p exclude a token (-inf: keep all),
    and each row's largest logit ``[B, 1]`` (which min-p needs, and gets here for free).

    Both filters keep a prefix of the sorted distribution, so one threshold per
    row describes the result. A full sort of ``[B, V]`` is slow (tens of ms on
    a CPU), so the prefix is looked for among the top ``_TOP_P_CANDIDATES``
    (or top-k) tokens first; only rows whose nucleus reaches past them fall back
    to a full sort.
    """
    vocab = logits.shape[1]
    neg_inf = float("-inf")
    top_k_on = tensors.top_ks > 0
    top_p_on = tensors.top_ps < 1.0
    width = max(int(tensors.top_ks.max()) if tensors.do_top_k else 0, _TOP_P_CANDIDATES if tensors.do_top_p else 0)
    width = min(width, vocab)
    values = torch.topk(logits, width, dim=-1).values  # sorted descending
    positions = torch.arange(width, device=logits.device)
    kept_by_k = torch.where(top_k_on, tensors.top_ks.clamp(max=width), width)
    keep = positions.unsqueeze(0) < kept_by_k.unsqueeze(1)
    short_rows: list[int] = []
    if tensors.do_top_p:
        # top-p renormalises over what top-k kept; without top-k that is the whole vocabulary.
        probs = values.masked_fill(~keep, neg_inf).softmax(dim=-1)
        p_only = top_p_on & ~top_k_on
        if bool(p_only.any()):
            within_vocab = (values - _logsumexp(logits)).exp()
            probs = torch.where(p_only.unsqueeze(1), within_vocab, probs)
        cumulative = probs.cumsum(dim=-1)
        nucleus = (cumulative - probs) < tensors.top_ps.unsqueeze(1)
        nucleus[:, 0] = True
        keep &= nucleus | ~top_p_on.unsqueeze(1)
        # NOTE: a top-p-only row whose candidates hold less than top_p of the mass has its cut further out.
        short_rows = (p_only & (cumulative[:, -1] < tensors.top_ps)).nonzero().flatten().tolist()
    num_kept = keep.sum(dim=-1, keepdim=True)
    thresholds = values.gather(1, num_kept - 1)
    thresholds = thresholds.masked_fill(~(top_k_on | top_p_on).unsqueeze(1), neg_inf)
    if short_rows:
        rows = torch.tensor(short_rows, dtype=torch.long, device=logits.device)
        sorted_logits = logits[rows].sort(dim=-1, descending=True).values
        sorted_probs = sorted_logits.softmax(dim=-1)
        in_nucleus = (sorted_probs.cumsum(dim=-1) - sorted_probs) < tensors.top_ps[rows].unsqueeze(1)
        count = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1)
        thresholds[rows] = sorted_logits.gather(1, count - 1)
    return thresholds, values[:, :1]


def _relative_weights(logits: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """``exp(logits - peak)`` with every weight below ``exp(_EXP_FLOOR)`` (and every -inf) exactly 0.

    NOTE: on x86 CPUs exp() of values under about -87 produces float32
    subnormals and runs ~50x slower (-inf is slow too); masked rows and low
    temperatures hit that on most of the vocabulary. Weights that small are
    below the float32 resolution of a row whose peak weight is 1, so dropping
    them changes nothing that can be sampled.
    """
    shifted = logits - peak
    negligible = shifted <= _EXP_FLOOR
    weights = shifted.clamp_min_(_EXP_FLOOR).exp_()
    return weights.masked_fill_(negligible, 0.0)


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp as ``[B, 1]``; torch.logsumexp is several times slower than this on CPU."""
    peak = logits.amax(dim=-1, keepdim=True)
    return peak + _row_sums(_relative_weights(logits, peak)).log()


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(dim=-1, keepdim=True)`` with a row's bits independent of the batch.

    NOTE: torch sums a lone row by splitting it across threads (another order of additions than
    the one-row-per-thread order of a batch), so a request's top-p cut could move by a rounding
    with what else is in the step. A lone row is summed as one of two identical rows instead.
    """
    if x.shape[0] == 1:
        return x.expand(2, -1).sum(dim=-1, keepdim=True)[:1]
    return x.sum(dim=-1, keepdim=True)


def apply_top_k_top_p_min_p(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude; row i uses row i of ``tensors``.

    top-p keeps the smallest prefix of the sorted distribution whose mass is
    >= top_p, and always the most likely token. min-p drops tokens whose
    probability is below ``min_p * max_prob``. Tokens tied with the last kept
    one are kept too (each cut is a threshold on the logit), and the three cuts
    become one threshold so the ``[B, V]`` logits are masked in a single pass.
    """
    if not (tensors.do_top_k or tensors.do_top_p or tensors.do_min_p):
        return logits
    if tensors.do_top_k or tensors.do_top_p:
        thresholds, peak = _top_k_top_p_thresholds(logits, tensors)
    else:
        thresholds = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)
        peak = logits.amax(dim=-1, keepdim=True)
    if tensors.do_min_p:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
        # The max survives top-k/top-p, so the peak of the raw row is the peak after them.
        thresholds = torch.maximum(thresholds, peak + tensors.min_ps.unsqueeze(1).log())
    return logits.masked_fill(logits < thresholds, float("-inf"))


def _draw_uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) float32 per row; row i comes from ``generators[i]`` alone, other rows from the global RNG."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(len(generators), device=device)
    uniforms = torch.empty(len(generators), device=device)
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), device=device)
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i] = torch.rand(1, device=g.device, generator=g).to(device)[0]
    return uniforms


def sample_from_logits(logits: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row with probability softmax(logits), by inverting the row's CDF at one uniform draw.

    One random number per row (rather than V, as the Gumbel / exponential race
    needs) is what makes seeded rows cheap: drawing 32 x 49152 exponentials
    costs ~30 ms on a CPU. A token with weight 0 (logit -inf) leaves the CDF
    flat, so ``searchsorted(..., right=True)`` (first index whose CDF exceeds
    the target) never lands on it; the guard below covers float rounding anyway.
    """
    weights = _relative_weights(logits, logits.amax(dim=-1, keepdim=True))  # the CDF's last entry is the total
    # NOTE: float32 on purpose: a float64 cumsum is ~20x slower on CPU, and the only cost is that
    # tokens below ~1e-7 of the row's total become unreachable, as in torch.multinomial.
    cdf = weights.cumsum(dim=-1)
    targets = _draw_uniforms(generators, logits.device) * cdf[:, -1]
    chosen = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    chosen = chosen.clamp_(max=logits.shape[1] - 1)
    # NOTE: excluded tokens must never be picked; if rounding ever lands on one, take the most likely token.
    landed_on_zero = weights.gather(1, chosen.unsqueeze(1)).squeeze(1) == 0
    if bool(landed_on_zero.any()):
        chosen = torch.where(landed_on_zero, logits.argmax(dim=-1), chosen)
    return chosen


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as int64 ``[B]``: the first of tied maxima, a NaN counted as the largest
    (what ``torch.max(dim).indices`` returns).

    NOTE: on the CPU numpy's argmax, which is SIMD-vectorised, takes ~4 us over a 49k-token row;
    torch's max(dim) (~70 us on one thread, 2-3x faster than its argmax) splits a lone row across
    threads and took 100-180 us on two. Once a decode step, that was ~2% of a SmolLM2 token.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def _gather_logprobs(
    raw_logits: torch.Tensor, rows: list[int], chosen: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Chosen-token logprob, its rank and the top-N of the raw distribution for ``rows``, with one host copy.

    Works on logits minus the row's logsumexp instead of a full ``log_softmax``:
    ranks and the top-N only need comparisons, so no ``[B, V]`` result is written.
    """
    index = torch.tensor(rows, dtype=torch.long, device=raw_logits.device)
    logits = raw_logits[index]
    normaliser = _logsumexp(logits)
    chosen_rows = chosen[index].unsqueeze(1)
    chosen_logits = logits.gather(1, chosen_rows)
    ranks = (logits > chosen_logits).sum(dim=-1) + 1
    chosen_logprobs = chosen_logits - normaliser
    max_top = max(num_top)
    if max_top > 0:
        top_logits, top_ids = logits.topk(max_top, dim=-1)
        top_values_list, top_ids_list = (top_logits - normaliser).tolist(), top_ids.tolist()
    else:
        top_values_list = top_ids_list = [[] for _ in rows]
    return [
        TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank, top=list(zip(ids[:n], values[:n])))
        for token_id, logprob, rank, ids, values, n in zip(
            chosen_rows.flatten().tolist(),
            chosen_logprobs.flatten().tolist(),
            ranks.tolist(),
            top_ids_list,
            top_values_list,
            num_top,
        )
    ]


# Rows of a chunk whose prompt logprobs are gathered at once: bounds the [rows, vocab] temporaries.
_PROMPT_LOGPROB_SLICE = 256


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """vLLM's prompt_logprobs for a prefill chunk: row i of ``logits`` (raw, float32) predicts
    ``next_token_ids[i]``, the prompt's next token; its logprob and rank, and the top ``num_top``.

    The same numerics as a sampled token's logprobs (`_gather_logprobs`), a slice of rows at a time:
    only ``[rows, num_top]`` selections are kept.
    """
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(next_token_ids)} prompt tokens")
    chosen = torch.tensor(list(next_token_ids), dtype=torch.long, device=logits.device)
    out: list[TokenLogprobs] = []
    for lo in range(0, len(next_token_ids), _PROMPT_LOGPROB_SLICE):
        hi = min(lo + _PROMPT_LOGPROB_SLICE, len(next_token_ids))
        out += _gather_logprobs(logits[lo:hi].float(), list(range(hi - lo)), chosen[lo:hi], [num_top] * (hi - lo))
    return out


class Sampler:
    """Picks one next token per row of a ``[B, V]`` logits batch; stateless, so one instance serves every step.

    ``prompt_token_ids`` / ``output_token_ids`` feed the penalties and
    ``min_tokens`` (rows may be lists or 1-D tensors); ``generators[i]`` is row
    i's RNG from :func:`make_generator` (``None``: global RNG); ``eos_token_ids``
    are masked, with the row's stop_token_ids, until ``min_tokens`` is reached;
    ``grammars[i]`` is row i's grammar matcher (structured outputs) or None.
    ``logits_writable``: the caller will not read ``logits`` again, so the grammar
    mask may be applied in place instead of on a ``[B, V]`` copy (the model
    runner's fresh logits); otherwise the caller's tensor is never modified.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int] | torch.Tensor],
        output_token_ids: Sequence[Sequence[int] | torch.Tensor],
        generators: Sequence[torch.Generator | None],
        *,
        eos_token_ids: Sequence[int] = (),
        grammars: Sequence[BitmaskFiller | None] | None = None,
        logits_writable: bool = False,
    ) -> SampleResult:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        for name, seq in (
            ("params", params),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
        ):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} entries but logits has {batch} rows")
        if grammars is not None and len(grammars) != batch:
            raise ValueError(f"grammars has {len(grammars)} entries but logits has {batch} rows")
        if batch == 0:
            return SampleResult(token_ids=[], logprobs=[])

        # NOTE: `.float()` returns the caller's tensor when it already is float32; every step
        # below is out of place, so the caller's logits are never modified.
        raw = logits.float()
        grammar_rows = frozenset(i for i, g in enumerate(grammars or ()) if g is not None)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs report the model's distribution before the mask: grammar rows that want them keep a copy.
        unmasked_rows = [i for i in logprob_rows if i in grammar_rows]
        unmasked = raw[unmasked_rows] if unmasked_rows else None  # (indexing copies)
        masked = raw
        if grammar_rows and grammars is not None:
            if raw is logits and not logits_writable:
                masked = raw.clone()
            fill_and_apply_bitmask_(masked, grammars)
        needs_min_tokens = any(
            len(out) < p.min_tokens and i not in grammar_rows for i, (p, out) in enumerate(zip(params, output_token_ids))
        )

        if (
            not logprob_rows
            and not needs_min_tokens
            and all(row_is_greedy(p) and not p.has_penalties and not p.has_token_rules for p in params)
        ):
            # Common case: one argmax over the batch, no parameter tensors built.
            return SampleResult(token_ids=greedy_tokens(masked).tolist(), logprobs=[None] * batch)

        tensors = SamplingTensors.from_params(params, device=raw.device)
        work = apply_token_rules(masked, params, output_token_ids)
        work = apply_penalties(work, tensors, prompt_token_ids, output_token_ids)
        if needs_min_tokens:
            work = apply_min_tokens(work, params, output_token_ids, eos_token_ids, exempt_rows=grammar_rows)

        if all(tensors.greedy):
            chosen = greedy_tokens(work)
        else:
            chosen = torch.empty(batch, dtype=torch.long, device=raw.device)
            greedy_rows = [i for i, g in enumerate(tensors.greedy) if g]
            sampled_rows = [i for i, g in enumerate(tensors.greedy) if not g]
            if greedy_rows:
                index = torch.tensor(greedy_rows, dtype=torch.long, device=raw.device)
                chosen[index] = work[index].argmax(dim=-1)
            index = torch.tensor(sampled_rows, dtype=torch.long, device=raw.device)
            subset = tensors.select(index)
            # When every row samples, skip the [B, V] gather and work on the batch itself.
            rows_logits = work if len(sampled_rows) == batch else work[index]
            rows_logits = rows_logits / subset.temperatures.unsqueeze(1)
            rows_logits = apply_top_k_top_p_min_p(rows_logits, subset)
            chosen[index] = sample_from_logits(rows_logits, [generators[i] for i in sampled_rows])

        token_ids = chosen.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * batch
        plain_rows = [i for i in logprob_rows if i not in grammar_rows]
        if plain_rows:
            # NOTE: `masked` equals `raw` on rows without a grammar (and is `raw` when there are none).
            gathered = _gather_logprobs(masked, plain_rows, chosen, [int(params[i].logprobs or 0) for i in plain_rows])
            for i, entry in zip(plain_rows, gathered):
                logprobs[i] = entry
        if unmasked is not None:
            index = torch.tensor(unmasked_rows, dtype=torch.long, device=raw.device)
            gathered = _gather_logprobs(
                unmasked, list(range(len(unmasked_rows))), chosen[index], [int(params[i].logprobs or 0) for i in unmasked_rows]
            )
            for i, entry in zip(unmasked_rows, gathered):
                logprobs[i] = entry
        return SampleResult(token_ids=token_ids, logprobs=logprobs)
