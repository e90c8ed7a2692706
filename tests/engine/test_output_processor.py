"""The output processor and the scheduler's `update_from_output` alone: hand-built sequences, a
character tokenizer, no model.

What they pin down: a stop string split across tokens ends the sequence and is cut from the text;
logprobs are kept per token with their decoded text; a request's finish is reported once (deltas
stop after it); a speculative verification keeps the KV of its accepted drafts only and tells the
drafter; a sequence that ends leaves the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatserve.config import SchedulerConfig
from chatserve.core.block_manager import BlockManager
from chatserve.core.scheduler import ScheduledSeq, Scheduler
from chatserve.core.sequence import Sequence, SequenceStatus
from chatserve.engine.detokenizer import IncrementalDetokenizer
from chatserve.engine.output_processor import OutputProcessor
from chatserve.engine.request import Request
from chatserve.outputs import RequestStats
from chatserve.sampling_params import SamplingParams

EOS = 0


class CharTokenizer:
    """Token id i is the character chr(i) (0 is the end token, decoded as "")."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: object) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@dataclass
class Lp:
    """A sampled token's logprob record, as the sampler makes it (worker/sampler.py)."""

    token_id: int
    logprob: float
    rank: int = 1
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sampled:
    """worker.spec_verify.SampledSeq's shape (core.scheduler.SampledTokens)."""

    scheduled: ScheduledSeq
    token_ids: list[int]
    logprobs: list[Any]
    num_accepted_drafts: int = 0


def make_request(processor: OutputProcessor, request_id: str, prompt: str, **params: Any) -> Request:
    sp = SamplingParams(temperature=0.0, **params)
    prompt_ids = ids(prompt)
    req = Request(request_id, prompt, prompt_ids, sp, RequestStats())
    req.seqs.append(Sequence(
        seq_id=len(processor.requests), request_id=request_id, index=0, prompt_token_ids=prompt_ids, params=sp,
        arrival_order=0, stats=req.stats, logprobs=[] if sp.logprobs is not None else None,
        detokenizer=IncrementalDetokenizer(CharTokenizer(), prompt_ids, stop=sp.stop or ()),
    ))
    processor.requests[request_id] = req
    return req


def feed(processor: OutputProcessor, seq: Sequence, text: str) -> list:
    """One step per token (decoding), each token's output as a delta."""
    outs = []
    for token in ids(text):
        processor.append_tokens(seq, [token], [None])
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED  # (the scheduler's finish)
        outs += processor.process([seq])
        if seq.is_finished:
            break
    return outs


def test_a_stop_string_split_across_tokens_ends_the_sequence_and_is_cut():
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=100)
    req = make_request(processor, "r", "hi", stop=["END"], output_kind="delta")
    outs = feed(processor, req.seqs[0], "abcENDxyz")
    seq = req.seqs[0]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "END")
    assert seq.output_token_ids == ids("abcEND")  # nothing sampled after the stop is appended
    assert "".join(o.outputs[0].text for o in outs) == "abc"
    # the finish is reported once: one output says finished, and the request's record is gone
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert "r" not in processor.requests
    assert processor.num_generated_tokens == 6


def test_a_near_miss_of_the_stop_string_is_held_back_then_released():
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=100)
    req = make_request(processor, "r", "hi", stop=["END"], max_tokens=4, output_kind="delta")
    outs = feed(processor, req.seqs[0], "aENx")
    # "EN" could start "END": held back (the deltas carry its tokens, no text) until "x" shows it does not
    assert [o.outputs[0].text for o in outs] == ["a", "", "", "ENx"]
    assert [o.outputs[0].token_ids for o in outs] == [[t] for t in ids("aENx")]
    assert outs[-1].outputs[0].finish_reason == "length"


def test_logprobs_are_kept_per_token_with_their_decoded_text():
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=100)
    req = make_request(processor, "r", "hi", logprobs=1, max_tokens=2)
    seq = req.seqs[0]
    a, b = ord("a"), ord("b")
    processor.append_tokens(seq, [a], [Lp(a, -0.5, rank=1, top=[(a, -0.5)])])
    processor.append_tokens(seq, [b], [Lp(b, -2.0, rank=2, top=[(a, -0.25)])])
    assert seq.finish_reason == "length"
    assert seq.cumulative_logprob == -2.5
    first, second = seq.logprobs
    assert first[a].logprob == -0.5 and first[a].decoded_token == "a"
    assert second[b].rank == 2 and second[a].rank == 1 and second[a].decoded_token == "a"
    seq.status = SequenceStatus.FINISHED
    (out,) = processor.process([seq])
    assert out.outputs[0].cumulative_logprob == -2.5 and len(out.outputs[0].logprobs) == 2


def test_an_end_token_stops_before_its_text_and_min_tokens_holds_it_back():
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=100)
    req = make_request(processor, "r", "hi", min_tokens=2)
    seq = req.seqs[0]
    kept = processor.append_tokens(seq, [EOS, ord("a"), EOS, ord("z")], [None] * 4)
    assert kept == 3  # the first end token came before min_tokens; the second ends it; "z" is never appended
    assert seq.finish_reason == "stop" and seq.output_token_ids == [EOS, ord("a"), EOS]


def test_update_from_output_keeps_accepted_drafts_and_finishes_ended_sequences():
    blocks = BlockManager(16, 4, enable_prefix_caching=True)
    recorded: list[tuple[int, int]] = []
    finished: list[int] = []

    class Drafter:
        def propose(self, seq, budget, num_decoding):
            return []

        def record(self, seq, num_drafts, num_accepted):
            recorded.append((num_drafts, num_accepted))

        def finish(self, seq):
            finished.append(seq.seq_id)

    scheduler = Scheduler(SchedulerConfig(4, 64, 1000, 64), blocks, drafter=Drafter())
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=1000)
    a = make_request(processor, "a", "abcdef", max_tokens=10).seqs[0]
    b = make_request(processor, "b", "ghijkl", max_tokens=1).seqs[0]
    for seq in (a, b):
        scheduler.add(seq)
    batch = scheduler.schedule()  # both prompts whole
    assert [s.num_new_tokens for s in batch.scheduled] == [6, 6]
    sampled = [Sampled(batch.scheduled[0], [ord("x")], [None]), Sampled(batch.scheduled[1], [ord("y")], [None])]
    updated = scheduler.update_from_output(batch, sampled, processor.append_tokens)
    assert updated == [a, b]
    assert a.num_computed_tokens == 6 and a.status is SequenceStatus.RUNNING
    assert scheduler.num_prefill_tokens_computed == 12
    assert b.finish_reason == "length" and b.is_finished and b not in scheduler.running and finished == [b.seq_id]
    assert blocks.cache.peek_prefix(ids("abcdef")) == 4  # a's first full block went to the prefix cache

    # a verification of 3 drafts: blocks for all of them, 2 accepted plus the token after them
    if not blocks.allocate(a, 4):
        raise AssertionError("no room for the verification")
    verify = ScheduledSeq(a, 4, [ord("1"), ord("2"), ord("3")])
    from chatserve.core.scheduler import SchedulerOutput

    batch = SchedulerOutput([verify])
    updated = scheduler.update_from_output(batch, [Sampled(verify, ids("12z"), [None] * 3, num_accepted_drafts=2)],
                                           processor.append_tokens)
    assert updated == [a] and a.output_token_ids == ids("x12z")
    # the last real token and the 2 kept drafts have their KV; "z" (just sampled) has none yet
    assert a.num_computed_tokens == 6 + 1 + 2 == a.num_tokens - 1
    assert recorded == [(3, 2)]
    assert len(a.block_table) == -(-a.num_computed_tokens // 4)  # the rejected draft's block went free
    blocks.check_integrity([a])


def test_a_verification_cut_by_a_stop_keeps_only_the_tokens_before_it():
    blocks = BlockManager(16, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(4, 64, 1000, 64), blocks)
    processor = OutputProcessor(CharTokenizer(), frozenset({EOS}), max_model_len=1000)
    c = make_request(processor, "c", "abcdef", max_tokens=2).seqs[0]
    scheduler.add(c)
    batch = scheduler.schedule()
    scheduler.update_from_output(batch, [Sampled(batch.scheduled[0], [ord("x")], [None])], processor.append_tokens)
    assert blocks.allocate(c, 4)
    from chatserve.core.scheduler import SchedulerOutput

    verify = ScheduledSeq(c, 4, ids("123"))
    computed = []
    real_finish = scheduler.finish
    scheduler.finish = lambda seq: (computed.append(seq.num_computed_tokens), real_finish(seq))  # type: ignore[method-assign]
    scheduler.update_from_output(SchedulerOutput([verify]), [Sampled(verify, ids("12z"), [None] * 3, 2)],
                                 processor.append_tokens)
    # max_tokens=2 ends it at the first draft: the last real token and that draft count, nothing after
    assert c.output_token_ids == ids("x1") and c.finish_reason == "length"
    assert computed == [6 + 1 + 1] and c.is_finished and not scheduler.running
    blocks.check_integrity([])
