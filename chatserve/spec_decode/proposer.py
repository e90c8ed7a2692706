"""How many tokens each decoding sequence drafts this step, and the counters of what was accepted.

Drafting is not free: verifying k drafts is a forward pass over 1 + k rows, so a sequence whose
guesses keep failing pays for rows nobody uses. The proposer adapts per sequence, as llama.cpp's
and SGLang's adaptive drafts do:

- after a verification that took every draft, the next may draft twice as many (up to
  ``num_speculative_tokens``: a copy that has started tends to go on, and a slow ramp-up costs a
  step per missing draft); after a partial one, ``accepted + 1``;
- after a verification that took nothing, the draft length halves, and from the third miss in a row
  the sequence stops drafting for 2, 4, ... 32 steps (free text: back to plain decode speed, with
  a probe now and then in case it starts to copy);
- no drafts at all while ``disable_by_batch_size`` or more sequences decode (the step is then
  compute-bound and rejected rows cost real work).

Drafts are also cut where they cannot be used: past ``max_tokens``, past the model's length, past
the step's token budget, and at the first token a sequence's grammar rejects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatserve.spec_decode.config import SpeculativeConfig
from chatserve.spec_decode.drafter import Drafter

MAX_BACKOFF_STEPS = 32


@dataclass
class SpecDecodeStats:
    """Engine-wide counters in vLLM's names (``spec_decode_num_drafts`` ...)."""

    num_drafts: int = 0  # verifications that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification step produced on average (accepted drafts + the one sampled)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass
class _SeqState:
    k: int  # the next draft length to ask for
    misses: int = 0  # verifications in a row that accepted nothing
    skip: int = 0  # steps left without drafting


class SpecProposer:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int) -> None:
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        assert config.num_speculative_tokens is not None  # resolved by SpeculativeConfig
        self.max_drafts: int = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_drafts)
        self._states: dict[int, _SeqState] = {}

    def propose(self, seq: Any, budget: int, num_decoding: int) -> list[int]:
        """The drafts ``seq`` (a decoding ``core.Sequence``) verifies this step; ``budget`` is how many
        draft tokens the step still has room for, ``num_decoding`` how many sequences decode."""
        cfg = self.config
        if not seq.params.speculative_decoding:
            return []
        if seq.reasoning is not None and not seq.reasoning.in_answer:
            # no drafts while a sequence reasons: its budget is counted token by token (a verified run
            # of drafts could pass it) and the answer's grammar starts at the end marker (drafts that
            # cross it would be verified against no grammar)
            return []
        if cfg.disable_by_batch_size is not None and num_decoding >= cfg.disable_by_batch_size:
            return []
        state = self._states.setdefault(seq.seq_id, _SeqState(self.max_drafts))
        if state.skip > 0:
            state.skip -= 1
            return []
        k = min(state.k, budget, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            # the verification yields up to k + 1 tokens; a draft past max_tokens is never used
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        drafts = self.drafter.propose(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k)
        if drafts and seq.grammar is not None:
            drafts = drafts[: _grammar_prefix(seq.grammar, drafts)]
        return drafts

    def record(self, seq: Any, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` drafts accepted the first ``num_accepted``."""
        if num_drafts == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1
        seq.stats.num_spec_draft_tokens += num_drafts
        seq.stats.num_spec_accepted_tokens += num_accepted
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        if num_accepted == num_drafts:
            state.k = min(self.max_drafts, 2 * max(state.k, num_drafts))
            state.misses = 0
        elif num_accepted > 0:
            state.k = num_accepted + 1
            state.misses = 0
        else:
            state.k = max(1, state.k // 2)
            state.misses += 1
            if state.misses >= 3:
                state.skip = min(MAX_BACKOFF_STEPS, 2 ** (state.misses - 2))

    def finish(self, seq: Any) -> None:
        """``seq`` has ended or was aborted: drop its state here and in the drafter."""
        self._states.pop(seq.seq_id, None)
        self.drafter.finish(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)

    @property
    def num_tracked(self) -> int:
        return len(self._states)


def _grammar_prefix(grammar: Any, drafts: list[int]) -> int:
    """How many of ``drafts`` the grammar takes in a row (the matcher is left where it was).

    A draft that ends the grammar (its stop token, or the last character of a regex) is cut too: the
    row after it would need a mask from a matcher that has terminated, and the verification's plain
    step decides that token just as well.
    """
    walked = taken = 0
    for token in drafts:
        if not grammar.accept(token):
            break
        walked += 1
        if grammar.is_terminated:
            break
        taken = walked
    if walked:
        grammar.rollback(walked)
    return taken


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> SpecProposer:
    """The proposer of ``config.method`` (one drafter file per method)."""
    drafter: Drafter
    if config.method == "suffix":
        from chatserve.spec_decode.suffix import SuffixDrafter

        drafter = SuffixDrafter(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=float(config.suffix_decoding_max_spec_factor),
            min_token_prob=float(config.suffix_decoding_min_token_prob),
        )
    else:
        from chatserve.spec_decode.ngram import NgramDrafter

        drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    return SpecProposer(config, drafter, max_model_len)
