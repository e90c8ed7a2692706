"""Reasoning through the real engine: the split in deltas and in the final output, the enforced
budget, the answer's grammar starting after the end marker, batch invariance.

The output is forced into the reasoning-then-answer shape, so every check is on exact text: the
scripted worker (tests/helpers/fake_runner.py) says a fixed reply under the real SmolLM2 tokenizer
(its ``<think>`` and ``</think>`` are three tokens each, so the markers arrive split across tokens),
and on a real forward pass (a tiny random Qwen3-shaped model, and the default model) a regex
grammar forces the shape and the split is checked against the regex's own groups.
"""

from __future__ import annotations

import json

import pytest

from chatserve import LLM
from chatserve.reasoning import ReasoningConfig
from chatserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.reasoning import THINK_REGEX, THINK_SHAPE, qwen3_thinking_template, reasoning_reply, scripted_reasoning_engine
from tests.helpers.tiny_families import with_chat_template

REASONING = "the user greets me so i greet back"
ANSWER = "Hello there, friend."


def run(engine, prompt, params_list, ids=None):
    """Add each request, step to the end; per request: (concatenated deltas or last output, final output)."""
    ids = ids or [f"r{i}" for i in range(len(params_list))]
    for rid, params in zip(ids, params_list):
        engine.add_request(rid, prompt, params)
    seen: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.outputs[0])
    return [seen[rid] for rid in ids]


def joined(outputs):
    return "".join(o.reasoning or "" for o in outputs), "".join(o.text for o in outputs)


# ---- the scripted worker: exact replies under the real tokenizer ---------------------------------------------
@pytest.mark.parametrize("opens", [False, True])
def test_split_in_deltas_and_final(smollm_tokenizer, opens):
    engine = scripted_reasoning_engine(smollm_tokenizer, reasoning=REASONING, answer=ANSWER, opens=opens)
    config = ReasoningConfig("qwen3", starts_in_reasoning=not opens)
    delta, final = run(engine, "hi", [
        SamplingParams(temperature=0, max_tokens=64, output_kind="delta", reasoning=config),
        SamplingParams(temperature=0, max_tokens=64, output_kind="final_only", reasoning=config),
    ])
    assert joined(delta) == (REASONING, ANSWER)
    # no delta carries a marker or a piece of one, in either field
    for out in delta:
        for piece in (out.text, out.reasoning or ""):
            assert "<" not in piece and ">" not in piece
    last = final[-1]
    assert (last.reasoning, last.text) == (REASONING, ANSWER)
    # tokens up to and including the end marker's
    tokens = smollm_tokenizer.encode(reasoning_reply(REASONING, ANSWER, opens=opens), add_special_tokens=False)
    marker_end = len(smollm_tokenizer.encode(reasoning_reply(REASONING, "", opens=opens).rstrip("\n"),
                                             add_special_tokens=False))
    assert last.num_reasoning_tokens == marker_end
    assert last.token_ids[:-1] == tokens  # (then the end token)
    assert delta[-1].num_reasoning_tokens == marker_end


def test_no_reasoning_parser_leaves_the_text_whole(smollm_tokenizer):
    engine = scripted_reasoning_engine(smollm_tokenizer, reasoning=REASONING, answer=ANSWER)
    [outs] = run(engine, "hi", [SamplingParams(temperature=0, max_tokens=64)])
    assert outs[-1].text == reasoning_reply(REASONING, ANSWER) and outs[-1].reasoning is None
    assert outs[-1].num_reasoning_tokens == 0


def test_no_end_marker_before_max_tokens_is_all_reasoning(smollm_tokenizer):
    engine = scripted_reasoning_engine(smollm_tokenizer, reasoning=REASONING, answer=ANSWER)
    [outs] = run(engine, "hi", [SamplingParams(temperature=0, max_tokens=5, output_kind="delta",
                                               reasoning=ReasoningConfig("qwen3", starts_in_reasoning=True))])
    reasoning, text = joined(outs)
    assert text == "" and outs[-1].finish_reason == "length"
    assert reasoning == smollm_tokenizer.decode(smollm_tokenizer.encode(REASONING, add_special_tokens=False)[:5])
    assert outs[-1].num_reasoning_tokens == 5


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_budget_forces_the_end_marker(smollm_tokenizer, budget):
    engine = scripted_reasoning_engine(smollm_tokenizer, reasoning=REASONING, answer=ANSWER)
    marker = smollm_tokenizer.encode("</think>", add_special_tokens=False)
    [outs] = run(engine, "hi", [SamplingParams(temperature=0, max_tokens=64,
                                               reasoning=ReasoningConfig("qwen3", budget, starts_in_reasoning=True))])
    last = outs[-1]
    script = smollm_tokenizer.encode(reasoning_reply(REASONING, ANSWER), add_special_tokens=False)
    # the model's first `budget` tokens, then the marker's, whatever the model wanted to say there
    assert last.token_ids[: budget + len(marker)] == script[:budget] + marker
    assert last.num_reasoning_tokens == budget + len(marker)
    assert last.reasoning == smollm_tokenizer.decode(script[:budget])
    # after the forced marker, what the model says is the answer (here: the rest of its script)
    assert last.text == smollm_tokenizer.decode(last.token_ids[budget + len(marker) : -1]).lstrip("\n")


def test_the_answer_grammar_starts_after_the_end_marker(smollm_tokenizer):
    """The scripted reasoning is not JSON: were the grammar on during it, the worker would have to leave
    the script at the first token; the reply is the script's reasoning, then a JSON answer."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    engine = scripted_reasoning_engine(smollm_tokenizer, reasoning=REASONING, answer='{"ok":true}')
    structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    [outs] = run(engine, "hi", [SamplingParams(temperature=0, max_tokens=64, structured_outputs=structured,
                                               reasoning=ReasoningConfig("qwen3", starts_in_reasoning=True))])
    last = outs[-1]
    assert last.reasoning == REASONING
    assert json.loads(last.text) == {"ok": True} and last.finish_reason == "stop"


# ---- a tiny random Qwen3-shaped model, forced by a grammar --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen3(tiny_checkpoint, tmp_path_factory):
    folder = with_chat_template(tiny_checkpoint("qwen3"), tmp_path_factory.mktemp("tiny-qwen3-thinking"),
                                qwen3_thinking_template())
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    yield llm
    llm.close()


PLAIN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def forced_shape(**kwargs):
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(regex=THINK_REGEX),
                          reasoning=ReasoningConfig("qwen3"), **kwargs)


def test_tiny_qwen3_split_is_exact_in_stream_and_final(tiny_qwen3):
    tok = tiny_qwen3.get_tokenizer()
    delta, final = run(tiny_qwen3.engine, PLAIN_PROMPT, [
        forced_shape(temperature=0.9, seed=7, output_kind="delta"),
        forced_shape(temperature=0.9, seed=7, output_kind="final_only"),
    ])
    last = final[-1]
    whole = THINK_SHAPE.fullmatch(tok.decode(last.token_ids, skip_special_tokens=True))
    assert whole is not None
    assert (last.reasoning, last.text) == (whole["reasoning"], whole["answer"])
    assert joined(delta) == (whole["reasoning"], whole["answer"])
    assert [t for o in delta for t in o.token_ids] == last.token_ids


def test_tiny_qwen3_is_batch_invariant(tiny_qwen3):
    engine = tiny_qwen3.engine
    [alone] = run(engine, PLAIN_PROMPT, [forced_shape(temperature=0.9, seed=11)], ids=["alone"])
    batched = run(engine, PLAIN_PROMPT, [
        forced_shape(temperature=0.9, seed=3),
        forced_shape(temperature=0.9, seed=11),
        SamplingParams(temperature=0.9, seed=5, max_tokens=30),
    ], ids=["b0", "b1", "b2"])
    a, b = alone[-1], batched[1][-1]
    assert (a.token_ids, a.reasoning, a.text, a.num_reasoning_tokens) == (b.token_ids, b.reasoning, b.text,
                                                                         b.num_reasoning_tokens)


def test_tiny_qwen3_budget_then_json_answer(tiny_qwen3):
    """The template opens <think>; the random model would think on for ever: the budget closes it, then
    the answer follows the schema."""
    tok = tiny_qwen3.get_tokenizer()
    marker = tok.encode("</think>", add_special_tokens=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for budget in (0, 6):
        [out] = tiny_qwen3.chat([{"role": "user", "content": "Is it ok?"}], params, reasoning_parser="qwen3",
                                reasoning_budget_tokens=budget)
        o = out.outputs[0]
        assert o.num_reasoning_tokens <= budget + len(marker)
        assert o.token_ids[budget : budget + len(marker)] == marker
        assert o.reasoning == tok.decode(o.token_ids[:budget]).strip("\n")
        assert isinstance(json.loads(o.text)["ok"], bool)


def test_tiny_qwen3_effort_none_and_thinking_off(tiny_qwen3):
    tok = tiny_qwen3.get_tokenizer()
    marker = tok.encode("</think>", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    [out] = tiny_qwen3.chat([{"role": "user", "content": "hi"}], params, reasoning_parser="auto",
                            reasoning_effort="none")
    o = out.outputs[0]
    assert o.token_ids[: len(marker)] == marker and o.reasoning == ""
    assert o.num_reasoning_tokens == len(marker)
    # thinking off: the template closed the block, nothing is split, the answer is the whole text
    [off] = tiny_qwen3.chat([{"role": "user", "content": "hi"}], params, reasoning_parser="qwen3",
                            chat_template_kwargs={"enable_thinking": False})
    assert off.outputs[0].reasoning is None and off.outputs[0].num_reasoning_tokens == 0


# ---- the default model with a parser forced on its template -------------------------------------------------
def test_default_model_with_deepseek_r1(llm_default):
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(regex=THINK_REGEX))
    [out] = llm_default.chat([{"role": "user", "content": "Say hello."}], params, reasoning_parser="deepseek_r1")
    o = out.outputs[0]
    tok = llm_default.get_tokenizer()
    whole = THINK_SHAPE.fullmatch(tok.decode(o.token_ids, skip_special_tokens=True))
    assert whole is not None
    assert (o.reasoning, o.text) == (whole["reasoning"], whole["answer"])
    assert 0 < o.num_reasoning_tokens < len(o.token_ids)


def test_reasoning_sent_back_renders_through_the_template(tiny_qwen3):
    """An assistant message's ``reasoning_content`` reaches the template (Qwen3's variable) through the
    input processor: rendered for the turn being continued, dropped once a new user turn follows."""
    processor = tiny_qwen3.engine.input_processor
    turn = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "they greet me"}]
    assert "<think>\nthey greet me\n</think>\n\nHello." in processor.render_chat_text(turn)
    later = processor.render_chat_text(turn + [{"role": "user", "content": "again"}])
    assert "they greet me" not in later and later.endswith("<|im_start|>assistant\n<think>\n")



def test_no_drafts_while_a_sequence_reasons(smollm_tokenizer):
    """Speculative decoding proposes nothing while a sequence reasons (a verified run of drafts could
    pass the budget, and drafts crossing the end marker would skip the answer's grammar); it drafts
    again once the answer starts."""
    from types import SimpleNamespace

    from chatserve.reasoning.tracker import ReasoningTracker
    from chatserve.spec_decode.config import parse_speculative_config
    from chatserve.spec_decode.proposer import make_proposer

    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}')
    proposer = make_proposer(config, max_model_len=512)
    repeated = [11, 12, 13, 14, 15] * 6  # an n-gram the prompt-lookup drafter always matches
    tracker = ReasoningTracker.for_request(ReasoningConfig("qwen3", 64, starts_in_reasoning=True), smollm_tokenizer)
    seq = SimpleNamespace(seq_id=1, token_ids=repeated + [11, 12], num_prompt_tokens=len(repeated),
                          num_tokens=len(repeated) + 2, num_output_tokens=2, grammar=None, reasoning=tracker,
                          params=SamplingParams(max_tokens=100))
    assert proposer.propose(seq, budget=8, num_decoding=1) == []
    tracker.in_answer = True
    assert proposer.propose(seq, budget=8, num_decoding=1) == [13, 14, 15, 11]
