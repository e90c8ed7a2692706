"""Structured outputs (issue 18, engine half): grammars compiled off the step, one matcher per
sequence, a batched bitmask on the constrained rows only.

Mechanisms, not timings: what was masked, what was scheduled while a compile was held up, what the
compile cache counted. Most tests run a tiny random Llama with the real SmolLM2 tokenizer (the
grammar alone guarantees well-formed output, so a random model shows the mechanism); one runs the
real model to show the kinds produce sensible text.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from typing import Any

import jsonschema
import pytest
import torch

from chatserve import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.structured import GrammarCompilerService, SequenceMatcher, StructuredOutputError
from chatserve.structured.bitmask import apply_bitmask_inplace, apply_bitmask_torch, apply_grammar_bitmask, expand_bitmask
from chatserve.worker.sampler import Sampler, make_generator

MAX_STEPS = 2000
# A schema a random model finishes: every value is bounded (whitespace runs are capped by the compiler).
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
}
CODE_REGEX = r"[a-z]{3}-[0-9]{2}"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def random_prompts(rng: random.Random, count: int, lo: int, hi: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]} for _ in range(count)]


def greedy(spec: StructuredOutputsParams | None, max_tokens: int = 120, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec, **kwargs)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_waiting_for_grammar == 0
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]


def drive(engine, limit: int = MAX_STEPS) -> dict[str, Any]:
    """Step until idle; the last output per request id."""
    finals: dict[str, Any] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            finals[out.request_id] = out
    raise AssertionError(f"engine still busy after {limit} steps: {engine.stats()}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer (built without loading the full model)."""
    from chatserve.models.loader import load_tokenizer, resolve_model
    from tests.conftest import write_tiny_checkpoint

    tokenizer = load_tokenizer(resolve_model(None))
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-structured"), "llama", tokenizer)


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(str(tiny), dtype="float32", num_threads=1)


# ---------------------------------------------------------------------------------------------
# params


def test_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsonn": {}})
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.clone().structured_outputs == params.structured_outputs
    # The cache key is canonical: key order and dict-vs-text do not matter.
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.cache_key() == b.cache_key() and a.kind == "json"


# ---------------------------------------------------------------------------------------------
# the real model: every kind, finished by the grammar


def test_every_kind_constrains_the_real_model(llm_default):
    person = "Describe a person called Ann, aged 31, as JSON with name and age."
    cases = {
        "json": (person, StructuredOutputsParams(json=PERSON_SCHEMA)),
        "regex": ("Write a product code.", StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}")),
        "choice": ("Is the sky blue?", StructuredOutputsParams(choice=["yes", "no", "maybe"])),
        "grammar": ("How old is Ann (31)?", StructuredOutputsParams(grammar='root ::= "Age: " [0-9]+ "."')),
        "json_object": ('Reply with the JSON object {"ok": true} and nothing else.', StructuredOutputsParams(json_object=True)),
    }
    convs = [[{"role": "user", "content": text}] for text, _ in cases.values()]
    outs = llm_default.chat(convs, [greedy(spec, max_tokens=200) for _, spec in cases.values()])
    got = {kind: out.outputs[0] for kind, out in zip(cases, outs)}
    for kind, out in got.items():
        assert out.finish_reason == "stop", (kind, out.text, out.finish_reason)
        assert out.error is None
    jsonschema.validate(json.loads(got["json"].text), PERSON_SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", got["regex"].text)
    assert got["choice"].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"Age: [0-9]+\.", got["grammar"].text)
    assert isinstance(json.loads(got["json_object"].text), dict)
    assert_idle(llm_default)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json: invalid JSON schema"),
        (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex: invalid regex"),
        (StructuredOutputsParams(grammar='root ::= "a" |'), "structured_outputs.grammar: invalid grammar"),
        # compiles, but no token can start it: refused up front, not an error at the first token (a 500 before)
        (StructuredOutputsParams(grammar="root ::= root"), "structured_outputs.grammar: invalid grammar: the grammar "
                                                           "admits no output"),
        (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
         "structured_outputs.structural_tag: invalid structural tag"),
    ],
)
def test_bad_spec_is_a_value_error_naming_the_field_and_the_engine_serves_on(tiny_llm, spec, field):
    with pytest.raises(StructuredOutputError) as info:
        tiny_llm.generate({"prompt_token_ids": [100, 200, 300]}, greedy(spec))
    assert isinstance(info.value, ValueError) and str(info.value).startswith(field), str(info.value)
    # Refused before anything was queued, and the next request runs.
    assert not tiny_llm.engine.has_unfinished_requests()
    out = tiny_llm.generate({"prompt_token_ids": [100, 200, 300]}, greedy(StructuredOutputsParams(regex=CODE_REGEX)))[0]
    assert re.fullmatch(CODE_REGEX, out.outputs[0].text)
    assert_idle(tiny_llm)


def test_a_compile_error_in_the_engine_ends_only_that_request(tiny_llm):
    """Bypassing the up-front check (as a caller of add_request may): finish_reason "error" with a
    message on the output, the request next to it unaffected, nothing leaked."""
    engine = tiny_llm.engine
    engine.add_request("bad", {"prompt_token_ids": [100, 101, 102]}, greedy(StructuredOutputsParams(regex="[z-a]")))
    engine.add_request("good", {"prompt_token_ids": [100, 101, 102]}, greedy(None, max_tokens=5, ignore_eos=True))
    finals = drive(engine)
    bad, good = finals["bad"].outputs[0], finals["good"].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error is not None and bad.error.startswith("structured_outputs.regex: invalid regex"), bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 5 and good.error is None
    assert_idle(tiny_llm)


def test_structural_tag_for_tool_calls_accepts_text_then_a_schema_call(tiny_llm):
    """The documented tool_choice="auto" shape: free text, then <tool_call> with arguments that follow the schema."""
    calls_schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }, "required": ["name", "arguments"]}, "minItems": 1}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": calls_schema}, "end": "</tool_call>"}],
        "stop_after_first": True}}
    compiled = tiny_llm.engine.structured.compile(StructuredOutputsParams(structural_tag=tag))
    tokenizer = tiny_llm.get_tokenizer()

    def accepts(text: str) -> bool:
        matcher = SequenceMatcher(compiled)
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts('Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    assert accepts("Just text, no call at all.")
    assert not accepts('<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>')
    assert not accepts('<tool_call>[{"name": "get_weather", "arguments": {"town": "Oslo"}}]</tool_call>')


# ---------------------------------------------------------------------------------------------
# cache and waiting for the grammar


def test_second_compile_of_the_same_spec_is_a_cache_hit(tiny_llm):
    compiler = tiny_llm.engine.structured
    spec = StructuredOutputsParams(regex=r"cache-test-[0-9]{4}")
    before = compiler.stats()
    first = compiler.compile(spec)
    mid = compiler.stats()
    second = compiler.compile(StructuredOutputsParams(regex=r"cache-test-[0-9]{4}"))
    after = compiler.stats()
    assert (mid.misses - before.misses, mid.hits - before.hits) == (1, 0)
    assert (after.misses - mid.misses, after.hits - mid.hits) == (0, 1)
    assert second is first
    # Failures are cached too: a bad schema sent in a loop is refused without recompiling.
    bad = StructuredOutputsParams(regex="(unclosed-cache-test")
    for _ in range(3):
        with pytest.raises(StructuredOutputError):
            compiler.compile(bad)
    assert compiler.stats().misses - after.misses == 1


def test_a_request_waiting_for_its_grammar_does_not_hold_up_others(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    release = threading.Event()
    entered = threading.Event()
    real = engine.structured._compile_uncached

    def slow_compile(spec):
        entered.set()
        assert release.wait(timeout=60), "the test never released the compile"
        return real(spec)

    monkeypatch.setattr(engine.structured, "_compile_uncached", slow_compile)
    spec = StructuredOutputsParams(regex=r"held-[0-9]{2}")
    engine.add_request("held", {"prompt_token_ids": [100, 200, 300, 400]}, greedy(spec))
    engine.add_request("free", {"prompt_token_ids": [500, 600, 700]}, greedy(None, max_tokens=8, ignore_eos=True))
    assert entered.wait(timeout=30)
    steps_before = engine.num_steps
    finals: dict[str, Any] = {}
    try:
        for _ in range(100):
            if "free" in finals and finals["free"].finished:
                break
            for out in engine.step():
                finals[out.request_id] = out
        # "free" ran to the end while "held" was still compiling: 8 model steps, none waited for it.
        assert finals["free"].outputs[0].finish_reason == "length"
        assert len(finals["free"].outputs[0].token_ids) == 8
        assert engine.num_steps - steps_before >= 8
        assert "held" not in finals and engine.num_waiting_for_grammar == 1
        assert engine.describe_request("held") == {"status": "waiting", "num_blocks": 0}
        assert engine.stats()["num_waiting_for_grammar"] == 1
    finally:
        release.set()
    finals.update(drive(engine))
    held = finals["held"].outputs[0]
    assert held.finish_reason == "stop" and re.fullmatch(r"held-[0-9]{2}", held.text)
    assert_idle(tiny_llm)


def test_abort_while_waiting_for_the_grammar(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    release = threading.Event()
    real = engine.structured._compile_uncached
    monkeypatch.setattr(engine.structured, "_compile_uncached", lambda spec: (release.wait(60), real(spec))[1])
    engine.add_request("gone", {"prompt_token_ids": [100, 200]}, greedy(StructuredOutputsParams(regex="gone-[0-9]")))
    out = engine.abort_request("gone")
    release.set()
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.num_waiting_for_grammar == 0
    assert drive(engine) == {}
    assert_idle(tiny_llm)


# ---------------------------------------------------------------------------------------------
# batches: mixed rows, preemption, n > 1


def _spec_for(kind: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=BOUNDED_SCHEMA) if kind == "json" else StructuredOutputsParams(regex=CODE_REGEX)


def _check_constrained(out, kind: str) -> None:
    o = out.outputs[0]
    assert o.finish_reason == "stop", (o.text, o.finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(o.text), BOUNDED_SCHEMA)
    else:
        assert re.fullmatch(CODE_REGEX, o.text), o.text


def test_mixed_batch_unconstrained_rows_are_identical_to_running_alone(tiny_llm):
    rng = random.Random(18)
    plain_prompts = random_prompts(rng, 8, 4, 40)
    grammar_prompts = random_prompts(rng, 8, 4, 40)
    plain = greedy(None, max_tokens=12, ignore_eos=True)
    kinds = ["json", "regex"] * 4
    specs = [_spec_for(k) for k in kinds]

    alone = [tiny_llm.generate(p, plain)[0].outputs[0].token_ids for p in plain_prompts]
    # Interleaved, so constrained and unconstrained rows sit next to each other in every step.
    prompts = [p for pair in zip(plain_prompts, grammar_prompts) for p in pair]
    params = [q for pair in zip([plain] * 8, [greedy(s) for s in specs]) for q in pair]
    outs = tiny_llm.generate(prompts, params)
    for i in range(8):
        assert outs[2 * i].outputs[0].token_ids == alone[i], f"unconstrained row {i} changed next to grammar rows"
        _check_constrained(outs[2 * i + 1], kinds[i])
    assert_idle(tiny_llm)


def test_preemption_by_recompute_mid_constrained_generation(tiny):
    rng = random.Random(7)
    prompts = random_prompts(rng, 12, 20, 40)
    kinds = ["json", "regex"] * 6
    params = [greedy(_spec_for(k), max_tokens=200) for k in kinds]
    small = LLM(str(tiny), dtype="float32", num_threads=1, num_kv_blocks=10, block_size=16)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0, "the workload must force preemption"
    for out, kind in zip(outs, kinds):
        _check_constrained(out, kind)
    assert_idle(small)
    # The same greedy outputs as without preemption: the matchers were neither rewound nor advanced twice.
    big = LLM(str(tiny), dtype="float32", num_threads=1, num_kv_blocks=512, block_size=16)
    refs = big.generate(prompts, params)
    assert big.engine.scheduler.num_preemptions == 0
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]


def test_n_children_each_get_their_own_matcher(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{6}"))
    req = engine.add_request("kids", {"prompt_token_ids": [100, 200, 300]}, params)
    finals: dict[str, Any] = {}
    for _ in range(3):
        for out in engine.step():
            finals[out.request_id] = out
    matchers = [s.grammar for s in req.seqs]
    assert all(isinstance(m, SequenceMatcher) for m in matchers) and len({id(m) for m in matchers}) == 3
    finals.update(drive(engine))
    texts = [o.text for o in finals["kids"].outputs]
    assert len(texts) == 3 and all(re.fullmatch(r"[a-z]{6}", t) for t in texts), texts
    assert len(set(texts)) > 1, "seeded children should differ (they sample independently)"
    assert_idle(tiny_llm)


def test_grammar_end_finishes_with_stop_even_when_eos_is_ignored(tiny_llm):
    out = tiny_llm.generate({"prompt_token_ids": [100, 200]}, greedy(StructuredOutputsParams(choice=["alpha", "beta"]), ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("alpha", "beta")
    assert len(out.outputs[0].token_ids) < 10
    assert_idle(tiny_llm)


def test_logprobs_report_the_model_distribution_before_the_mask(tiny_llm):
    prompt = {"prompt_token_ids": [100, 200, 300, 400]}
    raw = tiny_llm.generate(prompt, greedy(None, max_tokens=1, logprobs=5))[0].outputs[0]
    constrained = tiny_llm.generate(prompt, greedy(StructuredOutputsParams(choice=["zebra crossing"]), logprobs=5))[0].outputs[0]
    assert raw.logprobs is not None and constrained.logprobs is not None
    first_raw, first_constrained = raw.logprobs[0], constrained.logprobs[0]
    # The top-5 of the first step are the model's own (the same prompt gives the same distribution) ...
    top_raw = {t: lp.logprob for t, lp in first_raw.items() if lp.rank is not None and lp.rank <= 5}
    for token, logprob in top_raw.items():
        assert first_constrained[token].logprob == pytest.approx(logprob, abs=1e-5)
    # ... although the grammar forced a token that is not the model's favourite.
    chosen = constrained.token_ids[0]
    assert chosen != raw.token_ids[0] and first_constrained[chosen].rank > 1


# ---------------------------------------------------------------------------------------------
# the sampler and the bitmask


class _AllowOnly:
    """A fake matcher allowing a fixed token set (bit t of word t // 32)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            word, bit = divmod(t, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def test_sampler_masks_only_grammar_rows_and_leaves_the_others_bit_identical():
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=20, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=3, logprobs=3),
        SamplingParams(temperature=1.0, seed=4, min_tokens=5),
    ]
    allowed = {1: [5, 31, 32, 999], 3: [7, 8], 4: [63, 64]}
    grammars = [_AllowOnly(allowed[i]) if i in allowed else None for i in range(6)]
    prompts = [[1, 2, 3]] * 6
    outputs = [[4, 5]] * 6

    def run(with_grammars: bool):
        gens = [make_generator(p.seed) for p in params]
        return Sampler()(logits, params, prompts, outputs, gens, eos_token_ids=[0], grammars=grammars if with_grammars else None)

    masked, plain = run(True), run(False)
    for i in range(6):
        if i in allowed:
            assert masked.token_ids[i] in allowed[i]
        else:
            assert masked.token_ids[i] == plain.token_ids[i]
            assert masked.logprobs[i] == plain.logprobs[i]
    # Logprobs of a grammar row come from the unmasked logits.
    lp = masked.logprobs[4]
    assert lp is not None
    expected = torch.log_softmax(logits[4], dim=-1)
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-5)
    assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()
    # The caller's logits are untouched ...
    assert torch.isfinite(logits).all()
    # ... unless it lets the sampler mask them in place (the model runner does): same tokens and logprobs.
    scratch = logits.clone()
    gens = [make_generator(p.seed) for p in params]
    in_place = Sampler()(scratch, params, prompts, outputs, gens, eos_token_ids=[0], grammars=grammars, logits_writable=True)
    assert in_place.token_ids == masked.token_ids and in_place.logprobs == masked.logprobs
    assert not torch.isfinite(scratch[1]).all() and torch.equal(scratch[0], logits[0])


def test_xgrammar_kernel_and_torch_fallback_agree_and_mask_the_padding(smollm_tokenizer):
    """A model whose lm_head has more rows than the tokenizer has tokens: the padding ids are never allowed."""
    padded = len(smollm_tokenizer) + 40
    service = GrammarCompilerService(smollm_tokenizer, padded, [smollm_tokenizer.eos_token_id])
    compiled = service.compile(StructuredOutputsParams(json_object=True))
    matchers = [SequenceMatcher(compiled), None, SequenceMatcher(compiled)]
    assert matchers[2] is not None and matchers[2].accept(smollm_tokenizer.encode("{", add_special_tokens=False)[0])
    logits = torch.randn(3, padded)
    out = apply_grammar_bitmask(logits, matchers)
    assert torch.equal(out[1], logits[1])
    assert not torch.isfinite(out[0, len(smollm_tokenizer):]).any() and not torch.isfinite(out[2, len(smollm_tokenizer):]).any()
    assert 0 < int(torch.isfinite(out[0]).sum()) < len(smollm_tokenizer)
    # Same result from the torch expansion (used on CUDA and for non-float32 logits).
    bitmask = torch.full((3, (padded + 31) // 32), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_bitmask(bitmask, i)
    by_kernel, by_torch = logits.clone(), logits.clone()
    apply_bitmask_inplace(by_kernel, bitmask, [0, 2])
    apply_bitmask_torch(by_torch, bitmask, [0, 2])
    assert torch.equal(by_kernel, by_torch) and torch.equal(by_kernel, out)
    assert expand_bitmask(bitmask[:1], 8).shape == (1, 8)
    service.shutdown()


# ---------------------------------------------------------------------------------------------
# the async engine


def test_async_engine_checks_up_front_and_wakes_when_a_slow_grammar_is_ready(tiny, monkeypatch):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(model=str(tiny), dtype="float32", num_threads=1))
    real = engine.engine.structured._compile_uncached
    compiled_specs: list[str] = []

    def slow_compile(spec):
        threading.Event().wait(0.5)  # long enough for the loop to go idle waiting for a wakeup
        compiled_specs.append(spec.kind)
        return real(spec)

    monkeypatch.setattr(engine.engine.structured, "_compile_uncached", slow_compile)

    async def main() -> None:
        with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid JSON schema"):
            await engine.check_structured_outputs(greedy(StructuredOutputsParams(json={"type": "objectx"})))
        params = greedy(StructuredOutputsParams(json=BOUNDED_SCHEMA))
        outs = [o async for o in engine.generate({"prompt_token_ids": [100, 200, 300]}, params)]
        final = outs[-1].outputs[0]
        assert final.finish_reason == "stop"
        jsonschema.validate(json.loads(final.text), BOUNDED_SCHEMA)
        await engine.check_integrity()
        assert engine.stats()["num_live_requests"] == 0
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert compiled_specs == ["json", "json"]
