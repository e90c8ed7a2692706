"""A long prompt is prefilled in chunks while other streams keep decoding, one token every step.

This used to be a wall-clock test (no inter-token gap above 3x the median), which flaked on a
loaded machine. The guarantee behind it is a scheduling property, and that is what this checks,
step by step and deterministically: while streams decode, no step schedules more than
`max_prefill_tokens_while_decoding` prefill tokens, and every decoding stream is in every step.
A tiny random model keeps it fast; the property does not depend on the weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from chatserve import EngineArgs, LLMEngine, SamplingParams
from chatserve.core.scheduler import SchedulerOutput

CHUNK = 32
LONG_PROMPT = 450  # the tiny checkpoint's max_position_embeddings is 512


@dataclass(frozen=True)
class Scheduled:
    request_id: str
    num_new_tokens: int
    is_decode: bool


def record_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[Scheduled]]:
    """Wrap the engine's scheduler so every step's decisions are kept, read before the step runs
    (afterwards the engine has advanced the sequences, and finished ones are released)."""
    steps: list[list[Scheduled]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        steps.append([Scheduled(s.seq.request_id, s.num_new_tokens, s.is_decode) for s in out.scheduled])
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return steps


def test_long_prompt_is_chunked_and_no_decoding_stream_misses_a_step(tiny_checkpoint, monkeypatch) -> None:
    engine = LLMEngine(EngineArgs.from_env(model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=128,
                                           max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=CHUNK))
    steps = record_steps(engine, monkeypatch)
    rng = random.Random(0)
    stream_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, output_kind="delta")
    for rid in ("a", "b"):
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(20)]}, stream_params)
    engine.step()  # both prompts go whole: nobody was decoding yet
    assert [(s.request_id, s.num_new_tokens) for s in steps[0]] == [("a", 20), ("b", 20)]

    long_ids = [rng.randrange(1000, 40000) for _ in range(LONG_PROMPT)]
    engine.add_request("long", {"prompt_token_ids": long_ids}, SamplingParams(max_tokens=1))
    first = len(steps)
    long_done = False
    while not long_done:
        outputs = engine.step()
        step = steps[-1]
        n = len(steps) - first
        prefill = sum(s.num_new_tokens for s in step if not s.is_decode)
        assert prefill <= CHUNK, f"step {n}: {prefill} prefill tokens while streams decode"
        decodes = {s.request_id for s in step if s.is_decode}
        assert decodes == {"a", "b"}, f"step {n}: only {sorted(decodes)} decoded"
        new_tokens = {o.request_id: len(o.outputs[0].token_ids) for o in outputs if o.request_id in ("a", "b")}
        assert new_tokens == {"a": 1, "b": 1}, f"step {n}: the streams got {new_tokens}"
        long_done = any(o.request_id == "long" and o.finished for o in outputs)
        assert n < LONG_PROMPT, "the long prompt never finished"

    # every step advanced the long prompt by a whole chunk (it was spread, not starved)
    long_chunks = [s.num_new_tokens for step in steps[first:] for s in step if s.request_id == "long"]
    assert long_chunks == [CHUNK] * (LONG_PROMPT // CHUNK) + [LONG_PROMPT % CHUNK]

    for rid in ("a", "b"):
        engine.abort_request(rid)
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()
