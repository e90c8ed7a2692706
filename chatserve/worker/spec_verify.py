"""The worker's half of speculative verification: one sampler row per verified position.

A sequence verifying k drafts gets k + 1 rows of logits; row j is the model's distribution after
the last real token and drafts[:j]. For the sampler each row must look exactly like the plain
decode step it stands for:

- its "output so far" is the output plus drafts[:j] (penalties, min_tokens);
- its grammar mask is the matcher's after drafts[:j] (`DraftWalk` advances one shared matcher as
  the rows are filled, in order, and rolls it back afterwards);
- its random number is the one plain decoding would draw there: a seeded generator draws one per
  row in order, and afterwards is set back to the draws of the rows actually used
  (`GeneratorRewind`), so the next step draws what the next plain step would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from chatserve.core.scheduler import ScheduledSeq
from chatserve.spec_decode.acceptance import accept_drafts


@dataclass
class SampledSeq:
    """What one sequence got from a step: the tokens it keeps (one for a plain step; accepted
    drafts plus one for a verification) and their logprobs."""

    scheduled: ScheduledSeq
    token_ids: list[int]
    logprobs: list[Any]
    num_accepted_drafts: int = 0

    @property
    def seq(self) -> Any:
        return self.scheduled.seq


class DraftWalk:
    """One sequence's grammar matcher walked through its drafts as the sampler fills the rows."""

    def __init__(self, matcher: Any, drafts: list[int]) -> None:
        self.matcher = matcher
        self.drafts = drafts
        self.advanced = 0

    def row(self, j: int) -> _WalkRow:
        return _WalkRow(self, j)

    def advance_to(self, j: int) -> None:
        while self.advanced < j:
            token = self.drafts[self.advanced]
            if not self.matcher.accept(token):
                raise RuntimeError(f"draft token {token} was checked against the grammar but is rejected now")
            self.advanced += 1

    def rewind(self) -> None:
        self.matcher.rollback(self.advanced)
        self.advanced = 0


@dataclass
class _WalkRow:
    walk: DraftWalk
    j: int

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.walk.advance_to(self.j)
        self.walk.matcher.fill_bitmask(bitmask, row)


@dataclass
class SamplerRows:
    """The sampler's per-row inputs for a step's sampled sequences, verified drafts expanded."""

    params: list[Any] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    generators: list[Any] = field(default_factory=list)
    grammars: list[Any] = field(default_factory=list)
    walks: list[DraftWalk] = field(default_factory=list)
    rewinds: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)  # seq_id -> (g, state)

    @classmethod
    def build(cls, sampled: list[ScheduledSeq], needs_draws: Any) -> SamplerRows:
        rows = cls()
        for s in sampled:
            seq = s.seq
            drafts = s.draft_token_ids
            walk = DraftWalk(seq.grammar, drafts) if drafts and seq.grammar is not None else None
            if walk is not None:
                rows.walks.append(walk)
            if drafts and seq.generator is not None and needs_draws(seq.params):
                rows.rewinds[seq.seq_id] = (seq.generator, seq.generator.get_state())
            output = seq.output_token_ids
            for j in range(len(drafts) + 1):
                rows.params.append(seq.params)
                rows.prompts.append(seq.prompt_token_ids)
                rows.outputs.append(output + drafts[:j] if j else output)
                rows.generators.append(seq.generator)
                rows.grammars.append(walk.row(j) if walk is not None else seq.grammar)
        return rows

    def rewind_grammars(self) -> None:
        for walk in self.walks:
            walk.rewind()


def split_rows(sampled: list[ScheduledSeq], token_ids: list[int], logprobs: list[Any], rows: SamplerRows) -> list[SampledSeq]:
    """Each sequence's kept tokens from the expanded rows; seeded generators set back to the draws used."""
    out: list[SampledSeq] = []
    i = 0
    for s in sampled:
        k = len(s.draft_token_ids)
        tokens = token_ids[i : i + k + 1]
        lps = logprobs[i : i + k + 1]
        i += k + 1
        if not k:
            out.append(SampledSeq(s, tokens, lps))
            continue
        accepted = accept_drafts(s.draft_token_ids, tokens)
        rewind = rows.rewinds.get(s.seq.seq_id)
        if rewind is not None:
            generator, state = rewind
            generator.set_state(state)
            for _ in range(accepted + 1):  # the same one-number draws the sampler made, row by row
                torch.rand(1, device=generator.device, generator=generator)
        out.append(SampledSeq(s, tokens[: accepted + 1], lps[: accepted + 1], accepted))
    return out
