"""From the tokens sampled at each verified row to the tokens a sequence keeps.

Row j of a sequence's verification holds the model's distribution after the real last token and
drafts[:j]; the sampler draws from each row exactly what plain decoding would draw there (same
logits: the kernels are batch-invariant; same random number: a seeded generator is rewound to the
draws actually used). Drafts are kept while they equal what was sampled; the first row where they
differ, or the row after the last draft, gives one more token. So the kept tokens are, token for
token, what plain decoding produces, greedy or seeded.

For drafts that are single guesses (n-gram, suffix: a point mass), this sample-and-match is the
standard speculative rejection sampling: a draft d is kept with probability p(d) = min(1, p(d)/1),
and on rejection the token drawn is distributed as p without d, renormalised, which is the
residual (p - q)+. The target distribution is preserved exactly.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts match the sampled rows (``len(sampled) == len(drafts) + 1``); the
    kept tokens are ``sampled[: accepted + 1]``."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got {len(sampled)}")
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted
