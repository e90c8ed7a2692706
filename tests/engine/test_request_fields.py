"""vLLM's request controls: logit_bias, allowed_token_ids, bad_words (the sampler, per row),
truncate_prompt_tokens (the input processor), each changing the reply as vLLM's does and each
batch-invariant (a row gets the same logits and token alone or beside other rows, whatever they set).

The sampler alone on random logits first (exact, fast), then the default model through `LLM`: each
field alone against the same request in a batch with others (the engine's own batch invariance).
The HTTP fields (chat and completions) are in tests/server/openai/test_request_fields_http.py.
"""

from __future__ import annotations

import pytest
import torch

from chatserve.engine.input_processor import PromptError
from chatserve.sampling_params import SamplingParams
from chatserve.worker.sampler import Sampler, apply_token_rules, banned_by_bad_words, make_generator

VOCAB = 64


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[int]:
    """One step's tokens; a seeded row draws from its own generator (as the engine gives it)."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    generators = [make_generator(p.seed) for p in params]
    return Sampler()(logits, params, [[1, 2]] * len(params), outputs, generators).token_ids


def with_bad_words(params: SamplingParams, ids: list[list[int]]) -> SamplingParams:
    params.bad_words_token_ids = ids  # what InputProcessor.check_params fills from the tokenizer
    return params


# ---- what each rule does (vLLM's semantics) --------------------------------------------------------
def test_logit_bias_adds_to_the_logit_and_minus_100_bans() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 3.0
    assert sample(logits, [SamplingParams(temperature=0)]) == [5]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={9: 4.0})]) == [9]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={5: -100})])[0] != 5
    # a sampled row: a token biased +100 is (for all float32 purposes) the only one left
    draws = {sample(torch.randn(1, VOCAB), [SamplingParams(temperature=1.0, logit_bias={17: 100})])[0] for _ in range(20)}
    assert draws == {17}


def test_logit_bias_is_checked_as_openai_ranges_it() -> None:
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 100.5})
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"-3": 1.0})
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # JSON keys are strings


def test_allowed_token_ids_keeps_only_those() -> None:
    logits = torch.randn(1, VOCAB)
    allowed = [3, 40, 41]
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert sample(logits, [SamplingParams(temperature=0, allowed_token_ids=allowed)]) == [best]
    draws = {sample(logits, [SamplingParams(temperature=1.5, allowed_token_ids=allowed)])[0] for _ in range(40)}
    assert draws <= set(allowed) and len(draws) > 1


def test_bad_words_bans_a_words_last_token_only_after_its_other_tokens() -> None:
    words = [[7], [10, 11, 12]]
    assert banned_by_bad_words(words, []) == [7]  # one token: always banned
    assert banned_by_bad_words(words, [3, 10]) == [7]  # [10, 11] not yet generated: 12 stays allowed
    assert banned_by_bad_words(words, [3, 10, 11]) == [7, 12]
    assert banned_by_bad_words(words, [10, 11, 4]) == [7]
    logits = torch.zeros(1, VOCAB)
    logits[0, 12] = 5.0
    logits[0, 7] = 9.0
    params = with_bad_words(SamplingParams(temperature=0), words)
    assert sample(logits, [params], [[10]]) == [12]
    assert sample(logits, [params], [[10, 11]]) == [0]  # 7 and 12 banned: the first of the tied zeros


def test_bad_words_are_tokenised_with_and_without_a_leading_space(smollm_tokenizer) -> None:
    from chatserve.engine.input_processor import InputProcessor

    processor = InputProcessor(smollm_tokenizer, vocab_size=len(smollm_tokenizer), max_model_len=64,
                               max_model_len_note="", num_kv_blocks=64, block_size=16)
    ids = processor.bad_words_token_ids(["Paris"])
    assert smollm_tokenizer.encode("Paris", add_special_tokens=False) in ids
    assert smollm_tokenizer.encode(" Paris", add_special_tokens=False) in ids
    assert len(ids) == 2


def test_ids_outside_the_vocabulary_are_refused_naming_the_field(smollm_tokenizer) -> None:
    from chatserve.engine.input_processor import InputProcessor

    processor = InputProcessor(smollm_tokenizer, vocab_size=100, max_model_len=64, max_model_len_note="",
                               num_kv_blocks=64, block_size=16)
    for name, params in (("logit_bias", SamplingParams(logit_bias={100: 1.0})),
                         ("allowed_token_ids", SamplingParams(allowed_token_ids=[5, 250]))):
        with pytest.raises(PromptError, match="outside the vocabulary") as err:
            processor.check_params(params)
        assert err.value.param == name


def test_truncate_prompt_tokens_keeps_the_last_tokens(smollm_tokenizer) -> None:
    from chatserve.engine.input_processor import InputProcessor

    processor = InputProcessor(smollm_tokenizer, vocab_size=len(smollm_tokenizer), max_model_len=8,
                               max_model_len_note="", num_kv_blocks=64, block_size=16)
    ids = list(range(100, 120))
    assert processor.process({"prompt_token_ids": ids}, truncate_prompt_tokens=5).prompt_token_ids == ids[-5:]
    assert processor.process({"prompt_token_ids": ids}, truncate_prompt_tokens=-1).prompt_token_ids == ids[-7:]
    assert processor.process({"prompt_token_ids": ids[:3]}, truncate_prompt_tokens=5).prompt_token_ids == ids[:3]
    with pytest.raises(PromptError):  # without truncation the prompt does not fit
        processor.process({"prompt_token_ids": ids})


# ---- batch invariance: the sampler ------------------------------------------------------------------
RULES = {
    "logit_bias": lambda: SamplingParams(temperature=0.9, seed=3, logit_bias={1: 2.5, 7: -100, 30: 1.25}),
    "allowed_token_ids": lambda: SamplingParams(temperature=0.9, seed=3, allowed_token_ids=[2, 9, 33, 60]),
    "bad_words": lambda: with_bad_words(SamplingParams(temperature=0.9, seed=3), [[4], [20, 21], [50, 51, 52]]),
    "greedy logit_bias": lambda: SamplingParams(temperature=0, logit_bias={11: 5.0}),
}
NEIGHBOURS = [
    lambda: SamplingParams(temperature=0),
    lambda: SamplingParams(temperature=1.0, top_k=5, seed=8, repetition_penalty=1.3),
    lambda: SamplingParams(temperature=0.7, logit_bias={3: 50.0}),
    lambda: SamplingParams(temperature=1.2, allowed_token_ids=[1, 2, 3]),
    lambda: with_bad_words(SamplingParams(temperature=0.5, top_p=0.8, seed=1), [[9]]),
]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_gives_a_row_the_same_logits_and_token_alone_or_batched(rule: str) -> None:
    torch.manual_seed(0)
    row = torch.randn(1, VOCAB) * 3
    output = [20, 50, 51]  # the bad words' prefixes, generated
    alone_logits = apply_token_rules(row, [RULES[rule]()], [output])
    alone_token = sample(row, [RULES[rule]()], [output])
    changed = not torch.equal(alone_logits, row)
    assert changed, f"{rule} changed nothing: the test would prove nothing"
    for position in (0, 2, 5):
        others = torch.randn(5, VOCAB) * 3
        batch = torch.cat([others[:position], row, others[position:]])
        params = [f() for f in NEIGHBOURS]
        params.insert(position, RULES[rule]())
        outputs: list[list[int]] = [[1, 2, 3] for _ in NEIGHBOURS]
        outputs.insert(position, output)
        batched_logits = apply_token_rules(batch, params, outputs)
        assert torch.equal(batched_logits[position], alone_logits[0]), (rule, position)
        assert sample(batch, params, outputs)[position] == alone_token[0], (rule, position)


# ---- the default model: alone or batched, the same tokens ----------------------------------------
PROMPT = "The capital of France is"


def engine_cases(tokenizer) -> dict[str, SamplingParams]:
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    return {
        "logit_bias": SamplingParams(temperature=0, max_tokens=6, logit_bias={paris[0]: -100}),
        "allowed_token_ids": SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=sorted(
            set(tokenizer.encode(" a big city in Europe, called Lyon", add_special_tokens=False)))),
        "bad_words": SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"]),
        "seeded logit_bias": SamplingParams(temperature=0.8, seed=5, max_tokens=6, logit_bias={paris[0]: -100}),
    }


def test_each_field_changes_the_default_models_reply_and_is_batch_invariant(llm_default) -> None:
    tokenizer = llm_default.engine.tokenizer
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    (plain,) = llm_default.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))
    assert plain.outputs[0].token_ids[: len(paris)] == paris, "the default model names Paris: the fields must change that"
    cases = engine_cases(tokenizer)
    alone = {name: llm_default.generate(PROMPT, p.clone())[0].outputs[0].token_ids for name, p in cases.items()}
    for name, ids in alone.items():
        assert paris[0] not in ids[:1], (name, tokenizer.decode(ids))
    allowed = set(cases["allowed_token_ids"].allowed_token_ids or [])
    assert set(alone["allowed_token_ids"]) <= allowed
    # the same requests in one batch, among other prompts (different lengths, chunked beside each other)
    others = ["Once upon a time", "def fibonacci(n):", "List three colours:"]
    prompts = others + [PROMPT] * len(cases)
    params = [SamplingParams(temperature=0, max_tokens=6)] * len(others) + [p.clone() for p in cases.values()]
    batched = llm_default.generate(prompts, params)[len(others):]
    assert {n: o.outputs[0].token_ids for n, o in zip(cases, batched)} == alone


def test_truncate_prompt_tokens_on_the_engine_keeps_the_prompts_tail(llm_default) -> None:
    tokenizer = llm_default.engine.tokenizer
    long_prompt = "Ignore this preamble about the weather. " * 4 + PROMPT
    tail = tokenizer.encode(long_prompt)[-5:]
    (out,) = llm_default.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=5))
    assert out.prompt_token_ids == tail
    (direct,) = llm_default.generate({"prompt_token_ids": tail}, SamplingParams(temperature=0, max_tokens=4))
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
