"""The reasoning parsers, the budget table and the per-request config, without an engine.

Every recorded output is split under every chunking into two or three pieces (and one character at a
time): the result must be the same exact reasoning and answer whatever the chunking, a marker split
across pieces never leaking into either text.
"""

from __future__ import annotations

import itertools

import jinja2
import pytest

from chatserve.reasoning import (
    REASONING_PARSERS,
    ReasoningConfig,
    budget_for_effort,
    detect_reasoning_parser,
    reasoning_config_for,
    reasoning_parser_named,
)
from chatserve.reasoning.budget import MESSAGES_EFFORT_BUDGETS, OPENAI_EFFORT_BUDGETS
from chatserve.reasoning.forced import ForcedTokens
from chatserve.reasoning.splitter import Phase, ReasoningSplitter
from chatserve.structured.bitmask import expand_bitmask
from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply

# (parser, starts_in_reasoning, output text, reasoning, answer): outputs as the families write them.
RECORDED = [
    # Qwen3 / DeepSeek-R1 writing the opening marker itself
    ("qwen3", False, "<think>\nThe user says hi.\nGreet back.\n</think>\n\nHello! How can I help?",
     "The user says hi.\nGreet back.", "Hello! How can I help?"),
    ("deepseek_r1", False, "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.", "2 + 2 is 4.", "The answer is 4."),
    # the prompt opened the block (Qwen3-Thinking, DeepSeek-R1's template): no opening marker in the output
    ("qwen3", True, "Short thought.\n</think>\n\nDone.", "Short thought.", "Done."),
    ("deepseek_r1", True, "\nsome <b>markup</b> and </thin k>\n</think>\n\n{\"a\": 1}",
     "some <b>markup</b> and </thin k>", "{\"a\": 1}"),
    # Mistral Magistral's markers
    ("mistral", False, "[THINK]Let me count: 1, 2, 3.[/THINK]Three.", "Let me count: 1, 2, 3.", "Three."),
    ("mistral", True, "[THINK is not the end] fine[/THINK]\n\nOK [THINK] stays", "[THINK is not the end] fine",
     "OK [THINK] stays"),
    # no reasoning block at all: everything is the answer, leading whitespace and all
    ("qwen3", False, "  Plain answer with </think> inside.", "", "  Plain answer with </think> inside."),
    ("qwen3", False, "<thin", "", "<thin"),
    # no end marker before the output ended (max_tokens): everything is reasoning
    ("qwen3", True, "still thinking about </thi", "still thinking about </thi", ""),
    ("qwen3", False, "<think>\nunfinished\n\n", "unfinished\n\n", ""),
    # an empty reasoning (thinking turned off by the template, or a budget of 0)
    ("qwen3", True, "\n</think>\n\nAnswer.", "", "Answer."),
    ("qwen3", False, "<think></think>Answer.", "", "Answer."),
    # blank lines inside the reasoning are content, only the ones next to the markers are layout
    ("qwen3", True, "a\n\nb\n</think>\n\n\nc\n", "a\n\nb", "c\n"),
]


def split(parser: str, starts: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(REASONING_PARSERS[parser], starts_in_reasoning=starts)
    seen_reasoning, seen_answer = [], []
    for piece in pieces:
        splitter.feed(piece)
        # what has been released is final: later text only ever extends it
        seen_reasoning.append(splitter.reasoning)
        seen_answer.append(splitter.answer)
    splitter.finish()
    for earlier in seen_reasoning:
        assert splitter.reasoning.startswith(earlier)
    for earlier in seen_answer:
        assert splitter.answer.startswith(earlier)
    return splitter.reasoning, splitter.answer


def chunkings(text: str):
    """Every split into two or three pieces, and one character at a time."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("parser", "starts", "text", "reasoning", "answer"), RECORDED)
def test_every_chunking_splits_exactly(parser, starts, text, reasoning, answer):
    for pieces in chunkings(text):
        assert split(parser, starts, pieces) == (reasoning, answer), pieces


def test_a_partial_end_marker_is_held_back_until_it_resolves():
    splitter = ReasoningSplitter(REASONING_PARSERS["qwen3"], starts_in_reasoning=True)
    splitter.feed("thinking</th")
    assert splitter.reasoning == "thinking" and splitter.answer == ""
    splitter.feed("ink>\n\nHi")
    assert splitter.phase is Phase.ANSWER and splitter.reasoning_ended
    assert (splitter.reasoning, splitter.answer) == ("thinking", "Hi")
    # and a prefix that turns out to be text is released as reasoning
    other = ReasoningSplitter(REASONING_PARSERS["qwen3"], starts_in_reasoning=True)
    other.feed("a </th")
    assert other.reasoning == "a "
    other.feed("ing")
    assert other.reasoning == "a </thing"


def test_the_opening_marker_counts_only_at_the_start():
    splitter = ReasoningSplitter(REASONING_PARSERS["qwen3"], starts_in_reasoning=False)
    splitter.feed("<th")
    assert splitter.phase is Phase.START and splitter.answer == ""
    splitter.feed("ink>\nx")
    assert splitter.phase is Phase.REASONING


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_reasoning_reply_round_trips_through_its_parser(parser):
    for opens in (False, True):
        text = reasoning_reply("step one\nstep two", "Final.", parser=parser, opens=opens)
        assert split(parser, not opens, [text]) == ("step one\nstep two", "Final.")


def test_parser_names_and_detection():
    assert {"deepseek_r1", "qwen3", "mistral"} <= set(REASONING_PARSERS)
    assert reasoning_parser_named("qwen3").end == "</think>"
    assert reasoning_parser_named("mistral").start == "[THINK]"
    with pytest.raises(ValueError, match="deepseek_r1.*mistral.*qwen3"):
        reasoning_parser_named("granite-nope")
    assert detect_reasoning_parser(qwen3_thinking_template()) == "qwen3"
    r1 = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}{{ content.split('</think>')[-1] }}"
    assert detect_reasoning_parser(r1) == "deepseek_r1"
    magistral = "{{ '[SYSTEM_PROMPT]' }}First draft your thinking process inside [THINK] and [/THINK]."
    assert detect_reasoning_parser(magistral) == "mistral"
    chatml = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    assert detect_reasoning_parser(chatml) is None
    assert detect_reasoning_parser(None) is None


def test_the_budget_table():
    assert OPENAI_EFFORT_BUDGETS == {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                                     "xhigh": 32768}
    assert MESSAGES_EFFORT_BUDGETS == {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}
    assert budget_for_effort("low", api="responses") == 1024
    with pytest.raises(ValueError, match="reasoning_effort must be one of none, minimal"):
        budget_for_effort("extreme", api="openai")
    with pytest.raises(ValueError, match="reasoning.effort"):
        budget_for_effort("max", api="responses")
    with pytest.raises(ValueError, match="output_config.effort must be one of low, medium, high, xhigh, max"):
        budget_for_effort("none", api="messages")


def test_reasoning_config_for():
    opened = "<|im_start|>assistant\n<think>\n"
    plain = "<|im_start|>assistant\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert reasoning_config_for(None, opened, effort="high") is None
    assert reasoning_config_for("qwen3", opened) == ReasoningConfig("qwen3", None, True)
    assert reasoning_config_for("qwen3", plain, effort="low") == ReasoningConfig("qwen3", 1024, False)
    assert reasoning_config_for("qwen3", opened, effort="none") == ReasoningConfig("qwen3", 0, True)
    # an explicit count wins over an effort
    assert reasoning_config_for("qwen3", opened, effort="high", budget_tokens=7, api="messages").budget_tokens == 7
    assert reasoning_config_for("qwen3", opened, effort="max", api="messages").budget_tokens is None
    # thinking off: nothing to split when the template closed the block, a budget of 0 when it did not
    assert reasoning_config_for("qwen3", closed, enable_thinking=False) is None
    assert reasoning_config_for("qwen3", opened, enable_thinking=False) == ReasoningConfig("qwen3", 0, True)
    with pytest.raises(ValueError, match="output_config.effort"):
        reasoning_config_for("qwen3", opened, effort="minimal", api="messages")
    with pytest.raises(ValueError, match="budget_tokens"):
        reasoning_config_for("qwen3", opened, budget_tokens=-1)
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_config_for("nope", opened)
    with pytest.raises(ValueError, match="budget_tokens"):
        ReasoningConfig("qwen3", budget_tokens=True)


def test_forced_tokens_allow_one_token_at_a_time():
    import xgrammar as xgr

    forced = ForcedTokens([5, 31, 63, 64])
    bitmask = xgr.allocate_token_bitmask(2, 100)
    for token in (5, 31, 63, 64):
        forced.fill_bitmask(bitmask, 1)
        allowed = expand_bitmask(bitmask, 100)
        assert allowed[1].nonzero().flatten().tolist() == [token]
        assert allowed[0].all()  # the other row untouched
        assert not forced.accept(token + 1)
        assert forced.accept(token)
    assert forced.done and not forced.is_terminated
    forced.rollback(2)
    assert forced.next_token == 63
    with pytest.raises(ValueError):
        forced.rollback(3)


def render(messages, **kwargs):
    template = jinja2.Environment().from_string(qwen3_thinking_template())
    return template.render(messages=messages, add_generation_prompt=True, **kwargs)


def test_the_test_template_thinks_like_qwen3():
    turn1 = [{"role": "user", "content": "hi"}]
    assert render(turn1).endswith("<|im_start|>assistant\n<think>\n")
    assert render(turn1, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answered = turn1 + [{"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}]
    # the reasoning of the last turn renders (a tool loop continues it); after a new user turn it is dropped
    assert "<think>\ngreet\n</think>\n\nHello." in render(answered)
    later = render(answered + [{"role": "user", "content": "more"}])
    assert "greet" not in later and "<|im_start|>assistant\nHello.<|im_end|>" in later
