"""Continuous batching: which sequences compute how many tokens this step.

Plain Python (no torch). Every step, running sequences go first (decodes and
unfinished prefill chunks, oldest first), then waiting sequences are admitted
while the token budget, the sequence cap and free KV blocks allow. Prompts
longer than the leftover budget are prefilled in chunks across steps. When
blocks run out, unlocked cached blocks are evicted first; then a running
sequence is preempted by recompute (its computed prefix stays in the prefix
cache, so resuming it is cheap): the newest, or under the priority policy the
one of the lowest priority (the largest value), newest among equals.

Which waiting sequence is admitted next is the scheduling policy
(``SchedulerConfig.policy``, ``--scheduling-policy``):

- ``fcfs``: arrival order (a preempted sequence goes back to the front);
- ``priority``: vLLM's: the lowest ``SamplingParams.priority`` first, arrival
  order among equals;
- ``lpm``: SGLang's longest-prefix-match: the waiting sequence with the most
  tokens already in the prefix cache first, arrival order among equals. Its
  starvation bound: each time a sequence is admitted, every waiting sequence
  that arrived before it counts one overtake; one overtaken
  ``lpm_max_overtakes`` times (32) is admitted before anything that arrived
  after it, so no request waits behind more than that many later cache hits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from chatserve.cache.prefix_cache import MissExplanation
from chatserve.config import SchedulerConfig
from chatserve.core.block_manager import BlockManager
from chatserve.core.sequence import Sequence, SequenceStatus


class Drafter(Protocol):
    """Speculative decoding's bookkeeping (spec_decode.SpecProposer), handed in so that core does
    not import it: drafts to verify, what a verification accepted, a sequence's end."""

    def propose(self, seq: Sequence, budget: int, num_decoding: int) -> list[int]: ...

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None: ...

    def finish(self, seq: Sequence) -> None: ...


class SampledTokens(Protocol):
    """What one sequence got from a forward pass (worker.spec_verify.SampledSeq): the tokens it keeps
    (one; for a verification the accepted drafts plus one) and their logprobs."""

    scheduled: ScheduledSeq
    token_ids: list[int]
    logprobs: list[Any]
    num_accepted_drafts: int


# Appends a sequence's sampled tokens (with their logprobs) up to the first that ends it, setting
# seq.finish_reason then; returns how many it appended (the output processor's `append_tokens`).
TokenSink = Callable[[Sequence, list[int], list[Any]], int]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Speculative decoding: guesses of the tokens after the sequence's last one, verified this step.
    # The step computes the last token and these (num_new_tokens = 1 + len(drafts)); none of them is
    # in seq.token_ids until the verification keeps it.
    draft_token_ids: list[int] = field(default_factory=list)
    # NOTE: filled by the worker for a sequence that needs prompt logprobs: the entries of prompt positions
    # seq.num_computed_tokens + 1 onwards that this chunk's rows predict; kept by update_from_output.
    prompt_logprobs: list[Any] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + len(self.draft_token_ids)

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Rows of this chunk whose logits give a prompt token's logprobs (each row predicts the token
        after it): all but the prompt's last, for a sequence that still needs them; else 0."""
        if not self.seq.needs_prompt_logprobs or self.draft_token_ids:
            return 0
        start = self.seq.num_computed_tokens
        return max(0, min(self.num_new_tokens, self.seq.num_prompt_tokens - 1 - start))

    @property
    def num_logits(self) -> int:
        """Rows of logits this step needs for the sequence: one per verified draft plus one, 1 when
        the chunk completes the prompt, else 0; a chunk of a prompt that needs its prompt logprobs
        adds those rows (they come first: they are the chunk's leading rows)."""
        return (1 + len(self.draft_token_ids) if self.completes_prompt else 0) + self.num_prompt_logprob_rows

    @property
    def is_decode(self) -> bool:
        """The one definition of a decode: a single new token that ends the sequence.

        Everything else (a prompt chunk, the last token of a prompt whose rest came from the
        cache, a recompute after preemption) is an extend: prefill work for the stats, and the
        extend path of the attention (same arithmetic as a decode for one query token).
        """
        return self.num_new_tokens == 1 and self.completes_prompt and self.seq.num_output_tokens > 0

    @property
    def is_verify(self) -> bool:
        """A decode step with drafts: extend-shaped (1 + k query rows), decode work for the stats."""
        return bool(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues and every sequence's progress through them: which tokens
    each step computes (`schedule`), what a step's output changes (`update_from_output`: computed
    tokens, blocks published to the prefix cache, windowed blocks freed, drafts kept or trimmed) and
    a sequence's end (`finish`). Blocks come from the `BlockManager` it is handed."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, drafter: Drafter | None = None, *,
                 kv_free_window: int = 0) -> None:
        """``kv_free_window``: the attention window when every layer is windowed and the prefix cache is
        off (0: none); blocks every window has passed go back to the pool each step."""
        self.config = config
        self.blocks = block_manager
        # NOTE: drafts only ever use blocks that are free: a guess never evicts a cached block nor
        # preempts a sequence.
        self.drafter = drafter
        self.kv_free_window = kv_free_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefill_tokens_computed = 0
        # what each step mixed (stats): prefill chunks that continue a prompt (a cache hit or an earlier
        # chunk before them), steps that run decodes beside prefill chunks (chunked prefill at work)
        self.num_prefill_chunks_continued = 0
        self.num_mixed_steps = 0
        # lpm's starvation bound: seq_id -> how many later arrivals were admitted while it waited
        self._overtaken: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # NOTE: while anyone is decoding, each prefill advances by at most `chunk` tokens a step, so a
        # long prompt is spread over many steps instead of stalling the running streams; short
        # prompts (a burst of chat turns) still go whole.
        num_decoding = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        chunk = self.config.max_prefill_tokens_while_decoding if num_decoding else budget

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens == 1:
                n = 1
            else:
                n = min(seq.num_uncomputed_tokens, budget, chunk)
            while not self.blocks.allocate(seq, n):
                victim = self._pick_victim(scheduled_ids)
                if victim is None:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; the list shifted
            if self.blocks.num_new_blocks_needed(seq, n) > 0:
                break  # nothing left to preempt; try again next step
            drafts = self._drafts(seq, budget - n, num_decoding) if n == 1 and seq.num_uncomputed_tokens == 1 else []
            out.scheduled.append(ScheduledSeq(seq, n + len(drafts), drafts))
            scheduled_ids.add(seq.seq_id)
            budget -= n + len(drafts)
            i += 1

        # 2. admit waiting sequences (none while we are preempting: memory is short)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self._pop_next_waiting()
            # NOTE: a sequence that needs prompt logprobs computes its whole prompt (vLLM: it does not read
            # the prefix cache, though what it computes is published as usual).
            reads_cache = not seq.needs_prompt_logprobs
            cached = self.blocks.match_and_lock(seq, read_cache=reads_cache)
            if reads_cache and self._prefix_in_flight(seq, cached):
                # NOTE: a running sequence is computing the next block of this prompt right now;
                # wait for it to be published instead of computing the same prefix twice.
                self.blocks.release(seq, keep_in_cache=False)
                deferred.append(seq)
                continue
            if reads_cache:
                cached += self.blocks.reuse_partial_block(seq)
            first_admission = seq.stats.first_scheduled_time is None  # the request's first (of any of its n)
            why = None
            if first_admission:
                why = self.blocks.explain_miss(seq, cached) if reads_cache else MissExplanation("skipped", None, False)
            n = min(seq.num_uncomputed_tokens, budget, chunk)
            if not self.blocks.allocate(seq, n):
                self.blocks.release(seq, keep_in_cache=False)
                self.waiting.appendleft(seq)
                break
            self.blocks.record_admission(seq, cached)
            self._count_overtakes(seq)
            seq.status = SequenceStatus.RUNNING
            if why is not None:
                seq.stats.first_scheduled_time = time.monotonic()
                self.blocks.record_first_admission(seq, cached, why)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if out.scheduled:
            self._count_layout(out.scheduled)
        return out

    def _count_layout(self, scheduled: list[ScheduledSeq]) -> None:
        prefills = [s for s in scheduled if not s.is_decode and not s.is_verify]
        self.num_prefill_chunks_continued += sum(1 for s in prefills if s.seq.num_computed_tokens > 0)
        if prefills and len(prefills) < len(scheduled):
            self.num_mixed_steps += 1

    def update_from_output(self, batch: SchedulerOutput, sampled: Seq[SampledTokens], append: TokenSink) -> list[Sequence]:
        """Everything a finished forward pass changes: each scheduled chunk's tokens count as computed
        and newly full blocks go to the prefix cache; each sampled sequence gets its tokens
        (``append``, which stops at the first that ends it); a verification keeps the KV of its
        accepted drafts only; sequences that ended leave (``finish``). Returns the sequences that got
        tokens, in order."""
        window = self.kv_free_window
        for s in batch.scheduled:
            if s.is_verify:
                continue  # what it computed counts once the verification says which drafts stand
            if not s.is_decode:
                self.num_prefill_tokens_computed += s.num_new_tokens
            if s.prompt_logprobs:
                s.seq.record_prompt_logprobs(s.seq.num_computed_tokens + 1, s.prompt_logprobs)
            s.seq.num_computed_tokens += s.num_new_tokens
            self.blocks.publish(s.seq)  # returns at once unless a new full block was computed
            if window:  # down to a 16-key tile: the C++ kernel reads a window's first tile whole
                first = max(0, s.seq.num_computed_tokens - window + 1) // 16 * 16
                self.blocks.free_out_of_window(s.seq, first)
        updated: list[Sequence] = []
        for out in sampled:
            scheduled = out.scheduled
            seq = scheduled.seq
            computed_before = seq.num_computed_tokens
            kept = append(seq, out.token_ids, out.logprobs)
            if scheduled.draft_token_ids:
                # The step wrote KV for the last token and every draft; only the last token and the
                # kept drafts stand (a kept token is a draft unless it is the one sampled after them).
                seq.num_computed_tokens = computed_before + 1 + min(out.num_accepted_drafts, kept)
                if self.drafter is not None:
                    self.drafter.record(seq, len(scheduled.draft_token_ids), out.num_accepted_drafts)
                if seq.finish_reason is None:
                    self.blocks.trim(seq)  # blocks that held only rejected drafts go free
                    self.blocks.publish(seq)
            if seq.finish_reason is not None:
                self.finish(seq)
            updated.append(seq)
        return updated

    def _drafts(self, seq: Sequence, budget: int, num_decoding: int) -> list[int]:
        """The proposer's drafts for a decoding seq, cut to the free blocks (allocated here)."""
        if self.drafter is None or budget <= 0 or seq.num_output_tokens == 0:
            return []
        drafts = self.drafter.propose(seq, budget, num_decoding)
        if not drafts:
            return []
        bs = self.blocks.block_size
        free_slots = (len(seq.block_table) + self.blocks.num_free_blocks) * bs - seq.num_computed_tokens - 1
        drafts = drafts[: max(0, free_slots)]
        if drafts and not self.blocks.allocate_free_only(seq, 1 + len(drafts)):
            return []
        return drafts

    def _prefix_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """Is another running sequence computing the block that follows seq's cached prefix?

        That block is ``[num_cached, num_cached + block_size)`` of seq's tokens. Another sequence is
        computing it when its tokens agree that far, it has not finished that block yet, and it
        will (it has at least that many tokens); it publishes the block as soon as it is full.

        # NOTE: "not finished" is ``num_computed_tokens < end``, whatever the other sequence's
        # start was: one that began with a token-granular partial hit (a few tokens of a cached
        # template opening copied into its private block) is *inside* the block, not past it, and
        # is still the one computing it. Comparing with ``num_cached`` instead let every request
        # admitted beside such a one prefill the whole shared prefix again (issue 22).
        """
        if not self.blocks.cache_enabled:
            return False
        end = num_cached + self.blocks.block_size
        if end > seq.num_tokens - 1:
            return False  # no full uncached block to share
        head = seq.token_ids[:end]
        for other in self.running:
            # (another salt's block is never shared: waiting for it would only delay this one)
            if (other.num_computed_tokens < end <= other.num_tokens and other.cache_salt == seq.cache_salt
                    and other.token_ids[:end] == head):
                return True
        return False

    def _pop_next_waiting(self) -> Sequence:
        """Take the waiting sequence the policy admits next out of the queue."""
        policy = self.config.policy
        if policy == "fcfs" or len(self.waiting) == 1:
            return self.waiting.popleft()
        if policy == "priority":
            chosen = min(self.waiting, key=lambda s: (s.params.priority, s.arrival_order))
        else:
            chosen = self._longest_prefix_match()
        self.waiting.remove(chosen)
        return chosen

    def _longest_prefix_match(self) -> Sequence:
        """lpm: the oldest starving sequence (overtaken ``lpm_max_overtakes`` times) if any, else the one
        with the longest cached prefix (a peek: no lock, no LRU touch), the oldest among equals."""
        bound = self.config.lpm_max_overtakes
        starving = [s for s in self.waiting if self._overtaken.get(s.seq_id, 0) >= bound]
        if starving:
            return min(starving, key=lambda s: s.arrival_order)
        if not self.blocks.cache_enabled:
            return min(self.waiting, key=lambda s: s.arrival_order)

        def cached(s: Sequence) -> int:
            return self.blocks.cache.peek_prefix(s.token_ids[:-1], salt=s.cache_salt)

        return min(self.waiting, key=lambda s: (-cached(s), s.arrival_order))

    def _count_overtakes(self, admitted: Sequence) -> None:
        """lpm's bookkeeping at an admission: every waiting sequence that arrived before ``admitted`` was overtaken."""
        self._overtaken.pop(admitted.seq_id, None)
        if self.config.policy != "lpm":
            return
        for s in self.waiting:
            if s.arrival_order < admitted.arrival_order:
                self._overtaken[s.seq_id] = self._overtaken.get(s.seq_id, 0) + 1

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence | None:
        """The running sequence that gives way: the newest (the one that has waited least), or under the
        priority policy the one of the lowest priority (the largest value), the newest among equals."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda s: (s.params.priority, s.arrival_order))
        return candidates[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq, keep_in_cache=True)
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is, free its blocks and drop its drafter state."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.release(seq, keep_in_cache=True, lease=True)
        self._overtaken.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        if self.drafter is not None:
            self.drafter.finish(seq)
