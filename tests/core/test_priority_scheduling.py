"""Scheduling policies (--scheduling-policy fcfs|priority|lpm) and a request's priority.

The scheduler alone (hand-built sequences over a real BlockManager, stepped as the engine steps it:
tests/core/test_scheduler_unit.py's Driver) for the order of admission, lpm's starvation bound and the
order of preemption; the real engine over the scripted worker for a request's priority end to end
(a lower value admitted before waiting higher ones) and its refusal under another policy.
"""

from __future__ import annotations

import pytest

from chatserve.config import EngineArgs, SchedulerConfig
from chatserve.core.sequence import Sequence, SequenceStatus
from chatserve.engine.input_processor import PromptError
from chatserve.sampling_params import SamplingParams
from tests.core.test_scheduler_unit import Driver, tokens
from tests.helpers.fake_runner import scripted_engine


def policy_driver(policy: str, *, num_blocks: int = 64, max_num_seqs: int = 1, lpm_max_overtakes: int = 32,
                  block_size: int = 4) -> Driver:
    d = Driver(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=block_size)
    d.scheduler.config = SchedulerConfig(max_num_seqs, 64, 10_000, 8, policy=policy,  # type: ignore[arg-type]
                                         lpm_max_overtakes=lpm_max_overtakes)
    return d


def add(d: Driver, prompt: list[int], *, priority: int = 0, max_tokens: int = 2) -> Sequence:
    seq = d.add(prompt, max_tokens=max_tokens)
    seq.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority)
    return seq


def admission_order(d: Driver) -> list[int]:
    """Run to the end; the seq ids in the order they were first scheduled."""
    order: list[int] = []
    for _ in range(1000):
        if not d.scheduler.has_work():
            return order
        _, chunks = d.step()
        for c in chunks:
            if c.seq.seq_id not in order:
                order.append(c.seq.seq_id)
    raise AssertionError("work left")


# ---- priority ------------------------------------------------------------------------------------
def test_priority_admits_the_lowest_value_first_then_arrival_order() -> None:
    d = policy_driver("priority")
    seqs = [add(d, tokens(100 * i, 6), priority=p) for i, p in enumerate([3, 0, -2, 0, 7])]
    assert admission_order(d) == [seqs[i].seq_id for i in (2, 1, 3, 0, 4)]
    d.assert_idle()


def test_fcfs_ignores_no_priority_it_is_never_given_arrival_order_decides() -> None:
    d = policy_driver("fcfs")
    seqs = [add(d, tokens(100 * i, 6)) for i in range(4)]
    assert admission_order(d) == [s.seq_id for s in seqs]


def test_under_priority_the_running_sequence_of_the_lowest_priority_is_preempted_first() -> None:
    # 9 blocks of 4 tokens: three sequences of 8 prompt tokens run together, then outgrow the pool.
    d = policy_driver("priority", num_blocks=9, max_num_seqs=3)
    urgent = add(d, tokens(100, 8), priority=-1, max_tokens=12)
    background = add(d, tokens(200, 8), priority=5, max_tokens=12)  # arrived before `newest`
    newest = add(d, tokens(300, 8), priority=0, max_tokens=12)
    d.step()
    assert {s.status for s in (urgent, background, newest)} == {SequenceStatus.RUNNING}
    preempted: list[Sequence] = []
    for _ in range(40):
        out, _ = d.step()
        d.check()
        preempted += out.preempted
        if preempted:
            break
    assert preempted and preempted[0] is background, "the largest priority value gives way, not the newest"
    d.run()
    assert urgent.num_output_tokens == background.num_output_tokens == newest.num_output_tokens == 12
    d.assert_idle()


def test_under_fcfs_the_newest_running_sequence_is_preempted_whatever_its_priority() -> None:
    d = policy_driver("fcfs", num_blocks=9, max_num_seqs=3)
    seqs = [add(d, tokens(100 * (i + 1), 8), max_tokens=12) for i in range(3)]
    d.step()
    preempted: list[Sequence] = []
    for _ in range(40):
        out, _ = d.step()
        preempted += out.preempted
        if preempted:
            break
    assert preempted and preempted[0] is seqs[2]


# ---- lpm -----------------------------------------------------------------------------------------
def warm(d: Driver, prompt: list[int]) -> None:
    """Run one request with `prompt` to its end, so its blocks stay in the prefix cache."""
    add(d, prompt, max_tokens=1)
    d.run()


def test_lpm_admits_the_longest_cached_prefix_first_then_arrival_order() -> None:
    d = policy_driver("lpm")
    shared = tokens(500, 16)
    warm(d, shared + [1])
    cold = add(d, tokens(900, 17))  # arrives first, nothing cached
    short_hit = add(d, shared[:8] + tokens(700, 9))  # 8 tokens cached
    long_hit = add(d, shared + [2])  # 16 tokens cached
    long_hit_later = add(d, shared + [3])
    assert admission_order(d) == [long_hit.seq_id, long_hit_later.seq_id, short_hit.seq_id, cold.seq_id]


def test_lpm_fcfs_order_when_nothing_is_cached() -> None:
    d = policy_driver("lpm")
    seqs = [add(d, tokens(100 * (i + 1), 9)) for i in range(4)]
    assert admission_order(d) == [s.seq_id for s in seqs]


def test_lpm_starvation_bound_a_request_overtaken_that_many_times_goes_next() -> None:
    bound = 3
    d = policy_driver("lpm", lpm_max_overtakes=bound)
    shared = tokens(500, 16)
    warm(d, shared + [1])
    cold = add(d, tokens(900, 17))
    hits = [add(d, shared + [10 + i]) for i in range(6)]
    order = admission_order(d)
    # every hit overtakes the cold request until it has been overtaken `bound` times; then it goes next
    assert order[: bound + 1] == [h.seq_id for h in hits[:bound]] + [cold.seq_id]
    assert order[bound + 1:] == [h.seq_id for h in hits[bound:]]
    d.assert_idle()


def test_without_the_bound_the_cold_request_waits_for_every_hit() -> None:
    """The contrast that makes the bound's test meaningful: with a large bound it comes last."""
    d = policy_driver("lpm", lpm_max_overtakes=100)
    shared = tokens(500, 16)
    warm(d, shared + [1])
    cold = add(d, tokens(900, 17))
    hits = [add(d, shared + [10 + i]) for i in range(6)]
    assert admission_order(d) == [h.seq_id for h in hits] + [cold.seq_id]


# ---- the engine: priority end to end ---------------------------------------------------------------
def test_engine_admits_a_lower_priority_value_before_waiting_higher_ones(smollm_tokenizer) -> None:
    engine = scripted_engine(smollm_tokenizer, reply="Hi there", max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("first", "one", SamplingParams(max_tokens=3))
    engine.step()  # "first" is running (one sequence at a time)
    for rid, priority in (("late", 4), ("normal", 0), ("urgent", -5)):
        engine.add_request(rid, rid, SamplingParams(max_tokens=3, priority=priority))
    started: list[str] = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id not in started:
                started.append(out.request_id)
    assert started == ["first", "urgent", "normal", "late"]


def test_engine_refuses_a_priority_it_would_not_serve(smollm_tokenizer) -> None:
    engine = scripted_engine(smollm_tokenizer, reply="Hi")
    with pytest.raises(PromptError, match="--scheduling-policy priority") as err:
        engine.add_request("r", "Hi", SamplingParams(priority=2))
    assert err.value.param == "priority"
    engine.add_request("ok", "Hi", SamplingParams(priority=0))  # the default is served everywhere


def test_scheduling_policy_is_checked_and_reaches_the_scheduler(smollm_tokenizer) -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, lpm"):
        EngineArgs(scheduling_policy="sjf")  # type: ignore[arg-type]
    engine = scripted_engine(smollm_tokenizer, scheduling_policy="lpm")
    assert engine.scheduler.config.policy == "lpm"
