"""The scheduler and block manager alone, with hand-built sequences: no tokenizer, no model.

Each step is driven the way `LLMEngine.step` drives it (schedule -> the runner's copies ->
advance `num_computed_tokens` -> `publish` -> append one fake sampled token to every sequence
whose chunk completed its tokens -> finish at `max_tokens`), so these tests pin down the
scheduling decisions themselves: the token budget, chunked prefill, the prefill limit while
others decode, admission by free blocks after prefix matching, preemption by recompute and
aborts. They run in milliseconds, so the random workload at the end can afford many steps.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from chatserve.config import SchedulerConfig
from chatserve.core.block_manager import BlockManager
from chatserve.core.scheduler import Scheduler, SchedulerOutput
from chatserve.core.sequence import Sequence, SequenceStatus
from chatserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Chunk:
    """What one step did to one sequence, recorded before the step advanced it."""

    seq: Sequence
    num_new_tokens: int
    completes_prompt: bool
    is_decode: bool


class Driver:
    """The engine's step protocol over a real Scheduler and BlockManager, with fake sampling.

    The sampled token is a function of the sequence and its length, so runs are deterministic
    and different sequences diverge after their shared prompts.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_prefill_tokens_while_decoding: int = 8,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, 10_000, max_prefill_tokens_while_decoding)
        self.config = config
        self.scheduler = Scheduler(config, self.blocks)
        self.live: list[Sequence] = []
        self._ids = itertools.count()

    def add(self, prompt: list[int], max_tokens: int = 4) -> Sequence:
        seq_id = next(self._ids)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_token_ids=list(prompt),
                       params=params, arrival_order=seq_id)
        self.scheduler.add(seq)
        self.live.append(seq)
        return seq

    def step(self) -> tuple[SchedulerOutput, list[Chunk]]:
        out = self.scheduler.schedule()
        # NOTE: completes_prompt reads num_computed_tokens, so record it before advancing (the
        # model runner decides which sequences to sample before the engine advances them).
        chunks = [Chunk(s.seq, s.num_new_tokens, s.completes_prompt, s.is_decode) for s in out.scheduled]
        self.blocks.finish_copies(self.blocks.take_pending_copies())  # the runner "copies" them
        for c in chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            self.blocks.publish(c.seq)
        for c in chunks:
            if c.completes_prompt:
                seq = c.seq
                seq.token_ids.append(1000 + (seq.seq_id * 7919 + seq.num_tokens) % 5000)
                if seq.num_output_tokens >= (seq.params.max_tokens or 0):
                    self.finish(seq)
        return out, chunks

    def finish(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: the scheduler frees it wherever it is."""
        self.scheduler.finish(seq)
        self.live.remove(seq)

    def run(self, max_steps: int = 1000) -> int:
        for n in range(max_steps):
            if not self.scheduler.has_work():
                return n
            self.step()
            self.check()
        raise AssertionError(f"work left after {max_steps} steps")

    def check(self) -> None:
        self.blocks.check_integrity([s for s in self.live if s.block_table])

    def assert_idle(self) -> None:
        """DESIGN.md: after every request finished or was aborted, free + evictable == total, no lock."""
        stats = self.blocks.cache.stats()
        assert stats.locked == 0, stats
        assert stats.free + stats.evictable == stats.total, stats
        self.blocks.check_integrity([])


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def scheduled(chunks: list[Chunk]) -> dict[int, int]:
    return {c.seq.seq_id: c.num_new_tokens for c in chunks}


# ---- the token budget and chunked prefill --------------------------------------------------------
def test_a_step_fills_the_token_budget_and_chunks_the_prompt_that_does_not_fit() -> None:
    d = Driver(num_blocks=64, max_num_batched_tokens=32, max_prefill_tokens_while_decoding=8)
    a, b, c = (d.add(tokens(100 * i, 20)) for i in (1, 2, 3))
    out, chunks = d.step()
    assert scheduled(chunks) == {a.seq_id: 20, b.seq_id: 12}  # c: no budget left
    assert out.num_batched_tokens == 32
    assert [ch.completes_prompt for ch in chunks] == [True, False]
    assert c.status is SequenceStatus.WAITING and not c.block_table
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 12

    # a decodes now, so prefills advance by at most 8 tokens each while it does
    out, chunks = d.step()
    assert scheduled(chunks) == {a.seq_id: 1, b.seq_id: 8, c.seq_id: 8}
    d.check()


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_sampled_once() -> None:
    d = Driver(num_blocks=64, max_num_batched_tokens=16)
    s = d.add(tokens(1, 50), max_tokens=3)
    sizes, completes = [], []
    while s.num_output_tokens == 0:
        _, chunks = d.step()
        sizes += [c.num_new_tokens for c in chunks]
        completes += [c.completes_prompt for c in chunks]
    assert sizes == [16, 16, 16, 2]
    assert completes == [False, False, False, True]  # no token is sampled mid-prompt
    assert s.num_computed_tokens == 50 and s.num_tokens == 51
    d.run()
    assert s.is_finished and s.num_output_tokens == 3
    d.assert_idle()


def test_prefill_is_capped_while_others_decode_and_every_decoder_steps_each_time() -> None:
    chunk = 8
    d = Driver(num_blocks=128, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=chunk)
    streams = [d.add(tokens(100 * i, 5), max_tokens=200) for i in (1, 2)]
    d.step()
    assert all(s.num_output_tokens == 1 for s in streams)
    long = d.add(tokens(1000, 100), max_tokens=1)
    steps = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in streams]
        _, chunks = d.step()
        steps += 1
        prefill = sum(c.num_new_tokens for c in chunks if not c.is_decode)
        assert prefill <= chunk, f"step {steps}: {prefill} prefill tokens while streams decode"
        assert [s.num_output_tokens for s in streams] == [n + 1 for n in before], f"step {steps}: a stream stalled"
        d.check()
    assert steps == 100 // chunk + 1  # 12 full chunks and the last 4 tokens

    # nobody decodes: the same prompt length goes whole within the budget
    alone = Driver(num_blocks=128, max_num_batched_tokens=128, max_prefill_tokens_while_decoding=chunk)
    s = alone.add(tokens(1000, 100), max_tokens=1)
    _, chunks = alone.step()
    assert scheduled(chunks) == {s.seq_id: 100}


def test_max_num_seqs_caps_the_running_set() -> None:
    d = Driver(num_blocks=64, max_num_seqs=2)
    seqs = [d.add(tokens(100 * i, 4)) for i in range(1, 5)]
    _, chunks = d.step()
    assert scheduled(chunks) == {seqs[0].seq_id: 4, seqs[1].seq_id: 4}
    assert len(d.scheduler.running) == 2 and list(d.scheduler.waiting) == seqs[2:]


# ---- admission: prefix matching, then free blocks ---------------------------------------------------
def test_admission_counts_only_the_blocks_missing_after_the_prefix_match() -> None:
    d = Driver(num_blocks=8, block_size=4)
    shared = tokens(1, 16)
    first = d.add(shared + [99], max_tokens=1)  # 17 tokens: 4 full blocks published
    d.run()
    assert first.is_finished and d.blocks.cache.stats().evictable == 4
    other = d.add(tokens(500, 6), max_tokens=50)  # takes 2 of the 4 free blocks and keeps decoding
    d.step()
    assert d.blocks.num_free_blocks == 2

    hit = d.add(shared + tokens(200, 8), max_tokens=2)  # 24 tokens: 4 blocks cached, 2 to allocate
    miss = d.add(tokens(300, 24), max_tokens=1)  # 6 blocks: only 2 are free and the cached 4 are locked
    _, chunks = d.step()
    assert scheduled(chunks) == {other.seq_id: 1, hit.seq_id: 8}
    assert hit.stats.num_cached_tokens == 16 and hit.block_table[:4] == first_blocks(d, shared)
    assert miss.status is SequenceStatus.WAITING and not miss.block_table and miss.cache_node is None
    assert d.blocks.cache.num_evicted_blocks == 0  # the hit's blocks were locked, not evicted
    assert d.blocks.prefix_hit_tokens == 16  # the refused miss was not counted as a query
    d.check()


def first_blocks(d: Driver, prefix: list[int]) -> list[int]:
    return d.blocks.cache.match_prefix(prefix).block_ids


def test_a_prompt_whose_prefix_is_being_computed_waits_for_it_then_copies_the_partial_block() -> None:
    d = Driver(num_blocks=32, block_size=4, max_num_batched_tokens=32)
    prompt = tokens(1, 20)
    a, b = d.add(prompt, max_tokens=3), d.add(prompt, max_tokens=3)
    _, chunks = d.step()
    assert scheduled(chunks) == {a.seq_id: 20}  # budget was left, but b would compute the same blocks
    assert b.status is SequenceStatus.WAITING and b.stats.first_scheduled_time is None  # not admitted

    _, chunks = d.step()
    # 4 whole blocks from the tree, 3 tokens of the 5th copied (tokens[:-1] is matched): 1 to compute
    assert scheduled(chunks) == {a.seq_id: 1, b.seq_id: 1}
    assert b.stats.num_cached_tokens == 19
    assert d.blocks.num_block_copies == 1
    d.run()
    d.assert_idle()


def test_admission_evicts_unlocked_cached_blocks_when_the_free_list_is_short() -> None:
    d = Driver(num_blocks=6, block_size=4)
    d.add(tokens(1, 20), max_tokens=1)
    d.run()
    assert d.blocks.cache.stats().evictable == 5 and d.blocks.num_free_blocks == 1
    s = d.add(tokens(900, 16), max_tokens=1)  # shares nothing: needs 4 blocks
    _, chunks = d.step()
    assert scheduled(chunks) == {s.seq_id: 16}
    assert d.blocks.cache.num_evicted_blocks == 3
    d.run()
    d.assert_idle()


# ---- preemption by recompute ------------------------------------------------------------------------
def test_the_newest_sequence_is_preempted_by_recompute_when_blocks_run_out() -> None:
    d = Driver(num_blocks=6, block_size=4)
    old, new = d.add(tokens(100, 8), max_tokens=12), d.add(tokens(200, 8), max_tokens=12)
    out, _ = d.step()
    assert not out.preempted
    preempted: SchedulerOutput | None = None
    for _ in range(20):
        out, chunks = d.step()
        d.check()
        if out.preempted:
            preempted = out
            break
    assert preempted is not None, "6 blocks cannot hold two sequences of 20 tokens"
    assert preempted.preempted == [new]
    assert old.seq_id in scheduled(chunks) and new.seq_id not in scheduled(chunks)
    assert new.status is SequenceStatus.WAITING and d.scheduler.waiting[0] is new
    assert not new.block_table and new.num_computed_tokens == 0 and new.cache_node is None
    assert new.num_output_tokens > 0, "recompute keeps the output; only its KV is dropped"
    assert new.stats.num_preemptions == 1 and d.scheduler.num_preemptions == 1
    kept = list(new.token_ids)

    d.run()
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert new.token_ids[: len(kept)] == kept  # resumed where it was, output intact
    d.assert_idle()


def test_no_waiting_sequence_is_admitted_in_a_step_that_preempts() -> None:
    """Memory is short in such a step: re-admitting (even the victim, whose freed blocks would
    fit its next chunk without prefix caching) would only thrash."""
    d = Driver(num_blocks=6, block_size=4, enable_prefix_caching=False)
    old, new = d.add(tokens(100, 8), max_tokens=12), d.add(tokens(200, 8), max_tokens=12)
    d.step()
    late = d.add(tokens(300, 2), max_tokens=1)
    for _ in range(30):
        out, chunks = d.step()
        if out.preempted:
            assert out.preempted == [new] and scheduled(chunks) == {old.seq_id: 1}
            assert list(d.scheduler.waiting) == [new, late] and d.blocks.num_free_blocks == 2
            break
    else:
        pytest.fail("no preemption happened")
    d.run()
    d.assert_idle()


# ---- aborts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_abort_mid_prefill_caches_the_computed_blocks_and_frees_the_rest(enable_prefix_caching: bool) -> None:
    d = Driver(num_blocks=16, block_size=4, max_num_batched_tokens=10, enable_prefix_caching=enable_prefix_caching)
    s = d.add(tokens(1, 30))
    d.step()
    assert s.num_computed_tokens == 10 and len(s.block_table) == 3  # 2 full blocks and a partial one
    d.finish(s)
    assert s.status is SequenceStatus.FINISHED and s not in d.scheduler.running
    assert not s.block_table and s.cache_node is None
    stats = d.blocks.cache.stats()
    assert stats.evictable == (2 if enable_prefix_caching else 0)
    assert stats.free == 16 - stats.evictable  # the partial block went back to the free list
    d.assert_idle()
    assert not d.scheduler.has_work() and d.scheduler.schedule().is_empty


def test_abort_of_a_waiting_or_preempted_sequence_removes_it_from_the_queue() -> None:
    d = Driver(num_blocks=16, max_num_seqs=1)
    running, waiting = d.add(tokens(1, 4), max_tokens=8), d.add(tokens(50, 4))
    d.step()
    d.finish(waiting)
    assert list(d.scheduler.waiting) == [] and waiting.is_finished
    d.run()
    assert running.num_output_tokens == 8
    d.assert_idle()


def test_abort_of_a_sequence_with_a_pending_copy_drops_the_pinned_source() -> None:
    d = Driver(num_blocks=16, block_size=4)
    d.add(tokens(1, 13), max_tokens=1)
    d.run()  # 3 full blocks cached: 1..4, 5..8, 9..12
    s = d.add(tokens(1, 10) + [77, 78], max_tokens=1)  # 2 blocks from the tree, then 9, 10 copied from the 3rd
    d.scheduler.schedule()  # admitted; the abort comes before the runner copies anything
    assert s.stats.num_cached_tokens == 10
    d.finish(s)
    d.assert_idle()  # a pin left on the source, or a copy left pending, fails the integrity check
    assert d.blocks.take_pending_copies() == []


# ---- the prefix cache is emptied only when nothing holds a block ------------------------------------
def test_reset_prefix_cache_refuses_while_a_sequence_holds_blocks() -> None:
    d = Driver(num_blocks=16, block_size=4)
    d.add(tokens(1, 12), max_tokens=1)
    d.run()  # 3 unlocked blocks in the tree
    s = d.add(tokens(500, 6), max_tokens=3)  # shares nothing: the cached blocks stay unlocked
    d.step()
    before = d.blocks.cache.stats()
    assert before.evictable == 3 and before.locked == 1
    assert not d.blocks.reset_prefix_cache()
    assert d.blocks.cache.stats() == before, "a refused reset must change nothing"
    d.run()
    assert s.is_finished and d.blocks.cache.stats().evictable > 3
    assert d.blocks.reset_prefix_cache()
    assert d.blocks.num_free_blocks == 16 and d.blocks.cache.stats().evictable == 0
    d.assert_idle()


# ---- a random workload --------------------------------------------------------------------------------
SEEDS = range(8)


def run_random_workload(seed: int) -> Driver:
    """Arrivals with shared prefixes, aborts anywhere, a pool small enough to evict and preempt.

    After every step the block accounting is exact and the step obeyed its limits; at the end
    every sequence finished (with all its tokens unless aborted) and every block is back in the
    free list or the tree.
    """
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    num_blocks = rng.randrange(12, 40)
    d = Driver(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randrange(2, 7),
               max_num_batched_tokens=rng.randrange(8, 48), max_prefill_tokens_while_decoding=rng.randrange(1, 12),
               enable_prefix_caching=seed % 4 != 3)
    prefixes = [tokens(1000 * (i + 1), rng.randrange(1, 3 * block_size)) for i in range(3)]
    budget, chunk = d.config.max_num_batched_tokens, d.config.max_prefill_tokens_while_decoding
    aborted: set[int] = set()
    all_seqs: list[Sequence] = []
    for step in range(300):
        if step < 200 and rng.random() < 0.4:
            shared = rng.choice(prefixes) if rng.random() < 0.7 else []
            prompt = shared + tokens(rng.randrange(10**5), rng.randrange(1, 20))
            max_tokens = rng.randrange(1, 12)
            if d.blocks.blocks_for(len(prompt) + max_tokens) <= num_blocks:  # the engine refuses the rest
                all_seqs.append(d.add(prompt, max_tokens))
        if d.live and rng.random() < 0.08:
            victim = rng.choice(d.live)
            aborted.add(victim.seq_id)
            d.finish(victim)
        decoding = any(s.num_uncomputed_tokens == 1 for s in d.scheduler.running)
        out, chunks = d.step()
        d.check()
        ids = [c.seq.seq_id for c in chunks]
        assert len(ids) == len(set(ids)), f"step {step}: a sequence was scheduled twice"
        assert out.num_batched_tokens <= budget, f"step {step}: over the token budget"
        assert len(d.scheduler.running) <= d.config.max_num_seqs
        if decoding:
            assert all(c.num_new_tokens <= chunk for c in chunks if not c.is_decode), f"step {step}: prefill over {chunk}"
        assert all(s.status is SequenceStatus.RUNNING and s.block_table for s in d.scheduler.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in d.scheduler.waiting)
    d.run(max_steps=3000)
    assert not d.live
    for s in all_seqs:
        assert s.is_finished
        if s.seq_id not in aborted:
            assert s.num_output_tokens == s.params.max_tokens, s
    d.assert_idle()
    return d


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_keeps_every_invariant(seed: int) -> None:
    run_random_workload(seed)


def test_the_random_workloads_preempt_evict_and_hit_the_cache() -> None:
    """Guards the test above: workloads too gentle to preempt, evict or share would check little."""
    runs = [run_random_workload(seed) for seed in SEEDS]
    assert sum(d.scheduler.num_preemptions for d in runs) > 0
    assert sum(d.blocks.cache.num_evicted_blocks for d in runs) > 0
    assert sum(d.blocks.prefix_hit_tokens for d in runs) > 0
    assert sum(d.blocks.num_block_copies for d in runs) > 0
