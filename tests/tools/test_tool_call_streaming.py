"""Tool-call arguments that stream as they are generated: the one incremental parser
(`chatserve/tools/parser.py`) and the three APIs' streams built on it.

The parser: fed a reply in any chunking (char by char, random cuts), a call starts once its name is
known, its arguments' text arrives in deltas before the block closes, the deltas concatenate to the
final `arguments`, the events are the same whatever the chunking, `parse_tool_calls` gives the same
calls, and a block that is not a call of a known tool comes back as text, every character of it.

The APIs, in-process over FakeEngine (one token per delta): OpenAI chat (`delta.tool_calls`: id and
name first, then `function.arguments` pieces), Anthropic Messages (`content_block_start` tool_use,
`input_json_delta` per piece, `content_block_stop`) and Responses (`function_call_arguments.delta`)
all carry a call's arguments in more than one piece before the call ends, and the real clients'
stream helpers (openai's `chat.completions.stream` / `responses.stream`, anthropic's
`messages.stream`) assemble the same calls as the non-streaming body.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatserve.server import ServerSettings, create_app
from chatserve.tools import HERMES, XLAM, ToolCallStreamParser, ToolFormat, parse_tool_calls
from chatserve.tools.parser import ArgumentsDelta, CallEnd, CallStart, StreamEvent, TextEvent
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.streams import parse_sse_lines

KNOWN = ("get_weather", "get_time")
OPENING, CLOSING = "<tool_call>", "</tool_call>"


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def feed(text: str, fmt: ToolFormat = XLAM, cuts: list[int] | None = None, truncated: bool = False,
         known: tuple[str, ...] = KNOWN) -> list[list[StreamEvent]]:
    """The events of each feed (the last entry: finish()), the text cut into pieces of the `cuts` sizes
    (cycled; None: one character at a time)."""
    parser = ToolCallStreamParser(fmt, known, ids())
    sizes = itertools.cycle(cuts or [1])
    steps, i = [], 0
    while i < len(text):
        n = next(sizes)
        steps.append(parser.feed(text[i:i + n]))
        i += n
    steps.append(parser.finish(truncated))
    return steps


def merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Adjacent texts joined, adjacent deltas of one call joined: what does not depend on the chunking."""
    out: list[StreamEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, TextEvent) and isinstance(last, TextEvent):
            out[-1] = TextEvent(last.text + e.text)
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            out[-1] = ArgumentsDelta(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


def check_well_formed(events: list[StreamEvent]) -> None:
    """Every event non-empty; each call starts, sends deltas, ends, in order and under its own index;
    its final arguments are exactly its deltas' concatenation."""
    open_calls: dict[int, list[str]] = {}
    ended: list[int] = []
    for e in events:
        if isinstance(e, TextEvent):
            assert e.text
        elif isinstance(e, CallStart):
            assert e.index == len(ended) + len(open_calls) and not open_calls, "calls come one after the other"
            open_calls[e.index] = []
        elif isinstance(e, ArgumentsDelta):
            assert e.text and e.index in open_calls
            open_calls[e.index].append(e.text)
        elif isinstance(e, CallEnd):
            pieces = open_calls.pop(e.index)
            assert e.call.arguments == "".join(pieces)
            ended.append(e.index)
    assert not open_calls, "every started call ends by finish()"


def texts(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextEvent))


def calls(events: list[StreamEvent]) -> list[tuple[str, str, bool]]:
    return [(e.call.name, e.call.arguments, e.call.complete) for e in events if isinstance(e, CallEnd)]


# ---- the parser, by hand --------------------------------------------------------------------------------
XLAM_TWO = 'Checking. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e1, true]}}, ' \
           '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]</tool_call>'
HERMES_TWO = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "fmt": null}}\n</tool_call>'


@pytest.mark.parametrize(("fmt", "text"), [(XLAM, XLAM_TWO), (HERMES, HERMES_TWO)])
def test_char_by_char_arguments_stream_before_the_block_closes(fmt, text) -> None:
    steps = feed(text, fmt)
    events = [e for step in steps for e in step]
    check_well_formed(events)
    closing_at = text.index(CLOSING)  # the first block's closing tag: fed at step closing_at
    first = [i for i, step in enumerate(steps) for e in step if isinstance(e, ArgumentsDelta) and e.index == 0]
    assert len(first) > 5 and first[-1] < closing_at, "call 0's arguments arrive piece by piece, before the closing tag"
    start = next(i for i, step in enumerate(steps) for e in step if isinstance(e, CallStart) and e.index == 0)
    assert start == text.index('{', text.index('"arguments"')), "the call starts as its arguments' { is generated"
    for index in (0, 1):
        pieces = [e.text for step in steps for e in step if isinstance(e, ArgumentsDelta) and e.index == index]
        assert not any(_is_json("".join(pieces[:k])) for k in range(1, len(pieces))), "pieces of a still open object"
    whole = parse_tool_calls(text, fmt, KNOWN, ids())
    assert calls(events) == [(c.name, c.arguments, True) for c in whole.tool_calls]
    assert [json.loads(a) for _, a, _ in calls(events)] == [
        {"city": "Paris", "days": [1, 25.0, True]} if fmt is XLAM else {"city": "Oslo"},
        {"tz": "Europe/Paris"} if fmt is XLAM else {"tz": "UTC", "fmt": None}]
    assert texts(events).strip() == (whole.content or "").strip() == "Checking."
    # the arguments are the generated text itself, not a re-serialisation
    assert calls(events)[0][1] == text[text.index('{', text.index('"arguments"')):][:len(calls(events)[0][1])]


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def test_a_closing_tag_inside_an_argument_string_is_argument_text() -> None:
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "a</tool_call>b \\"q\\" \\u00e9"}}]</tool_call> after'
    events = [e for step in feed(text) for e in step]
    check_well_formed(events)
    assert calls(events) == [("get_weather", '{"city": "a</tool_call>b \\"q\\" \\u00e9"}', True)]
    assert json.loads(calls(events)[0][1]) == {"city": 'a</tool_call>b "q" é'}
    assert texts(events) == " after"


@pytest.mark.parametrize("text", [
    '<tool_call>[{"name": "unknown_fn", "arguments": {"a": 1}}]</tool_call>',  # not a tool of this request
    '<tool_call>[{"nam": "get_weather", "arguments": {"a": 1}}]</tool_call>',  # no name
    '<tool_call>[{"name": "get_weather", "arguments": [1, 2]}]</tool_call>',  # arguments not an object
    '<tool_call>[{"name": "get_weather", "arguments": "[1]"}]</tool_call>',  # nor the JSON text of one
    '<tool_call>[{"name": get_weather, "arguments": {}}]</tool_call>',  # not JSON before the name
    '<tool_call>[]</tool_call>',  # no calls
    '<tool_call>Let me think about <b>that</b>.</tool_call>',  # prose
    "I use <tool_ sometimes",  # only a partial opening
    '<tool_call>[{"name": "get_weather"',  # ended before its arguments began (not cut by max_tokens)
    'a <tool_call> b </tool_call> c <tool_call>{"name": "get_time", "x": </tool_call>',
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_block_that_is_not_a_call_comes_back_as_text_every_character(text, step) -> None:
    events = [e for s in feed(text, XLAM, [step]) for e in s]
    check_well_formed(events)
    assert calls(events) == []
    assert texts(events) == text
    parsed = parse_tool_calls(text, XLAM, KNOWN, ids())
    assert parsed.tool_calls == [] and parsed.content == text


def test_a_started_call_stays_a_call_when_the_block_then_goes_wrong() -> None:
    """Documented: once a call started its arguments are out; a block that breaks afterwards ends the
    call as far as it got (complete only if its arguments were a whole object), and what follows is
    text. (Under a tool grammar this cannot happen; a stop string can cut a block, though.)"""
    broken = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Par" oops}}]</tool_call> bye'
    events = [e for s in feed(broken) for e in s]
    check_well_formed(events)
    assert calls(events) == [("get_weather", '{"city": "Par" ', False)]
    assert texts(events) == 'oops}}]</tool_call> bye'
    # a second call in the list that is not a call: the first stands, the rest is text
    second = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]</tool_call>'
    events = [e for s in feed(second) for e in s]
    assert calls(events) == [("get_time", "{}", True)]
    assert texts(events) == ', {"name": "nope", "arguments": {}}]</tool_call>'
    # ended (a stop string, end of turn) before the closing tag: complete if its arguments were whole
    assert calls([e for s in feed('<tool_call>[{"name": "get_time", "arguments": {"a": 1}}') for e in s]) == \
        [("get_time", '{"a": 1}', True)]
    cut = parse_tool_calls('<tool_call>[{"name": "get_time", "arguments": {"a": [1', XLAM, KNOWN, ids())
    assert [(c.arguments, c.complete) for c in cut.tool_calls] == [('{"a": [1', False)] and cut.content is None


def test_arguments_written_first_or_as_a_json_string_start_once_the_name_is_known() -> None:
    first = '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
    steps = feed(first, HERMES)
    (start,) = [i for i, s in enumerate(steps) for e in s if isinstance(e, CallStart)]
    assert start == first.index('"get_time"') + len('"get_time"') - 1
    assert calls([e for s in steps for e in s]) == [("get_time", '{"tz": "UTC"}', True)]
    as_string = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    events = [e for s in feed(as_string, HERMES) for e in s]
    check_well_formed(events)
    assert calls(events) == [("get_time", '{"tz": "UTC"}', True)]
    no_args = '<tool_call>{"name": "get_time"}</tool_call>'
    assert calls([e for s in feed(no_args, HERMES) for e in s]) == [("get_time", "{}", True)]


@pytest.mark.parametrize(("text", "expected"), [
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Par', [("get_weather", '{"city": "Par', False)]),
    ('<tool_call>[{"name": "get_ti', [("get_time", "", False)]),
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {"ci',
     [("get_weather", '{"city": "Rome"}', True), ("get_time", '{"ci', False)]),
    ('<tool_call>[{"name": "get_weather", "arguments": {}}]</tool_', [("get_weather", "{}", True)]),
])
def test_a_block_cut_by_max_tokens_is_partial_calls_streamed_the_same(text, expected) -> None:
    for cuts in ([1], [4], [len(text)]):
        events = [e for s in feed(text, cuts=cuts, truncated=True) for e in s]
        check_well_formed(events)
        assert calls(events) == expected and texts(events) == ""
    parsed = parse_tool_calls(text, XLAM, KNOWN, ids(), truncated=True)
    assert [(c.name, c.arguments, c.complete) for c in parsed.tool_calls] == expected and parsed.content is None


def test_a_long_argument_streams_in_many_pieces() -> None:
    body = "x" * 20000
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "' + body + '"}}]</tool_call>'
    steps = feed(text, cuts=[3])
    deltas = [e for s in steps for e in s if isinstance(e, ArgumentsDelta)]
    assert len(deltas) > 6000
    assert json.loads("".join(d.text for d in deltas)) == {"city": body}


# ---- the parser, by hypothesis ------------------------------------------------------------------------------
_JSON_TEXT = st.lists(st.sampled_from(list('ab é"\\/<>{}[],:\n\t\x01\u2028') + ["</tool_call>", "<tool_call>"]),
                     max_size=8).map("".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | _JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_JSON_TEXT, inner, max_size=3), max_leaves=8)
_ARGS = st.dictionaries(_JSON_TEXT, _JSON, max_size=4)
_DUMPS = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}, {"indent": 0}])
_PROSE = st.lists(st.sampled_from(list("Hi, ok.\n <>/_") + ["<tool_", "<tool_cal", "</tool_call>", "tool_call>"]),
                  max_size=10).map("".join).filter(lambda s: OPENING not in s)


@st.composite
def replies(draw: Any) -> tuple[ToolFormat, str, str, list[tuple[str, str]]]:
    """A reply of prose and call blocks: (format, reply, its prose, its calls as (name, arguments text))."""
    fmt = draw(st.sampled_from([XLAM, HERMES]))
    parts: list[str] = []
    prose: list[str] = []
    expected: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(0, 3))):
        text = draw(_PROSE)
        prose.append(text)
        parts.append(text)
        batch = []
        for _ in range(draw(st.integers(1, 3) if fmt is XLAM else st.just(1))):
            name = draw(st.sampled_from(KNOWN))
            args = json.dumps(draw(_ARGS), **draw(_DUMPS))
            key = draw(st.sampled_from(["arguments", "parameters"]))
            members = [f'"name": "{name}"', f'"{key}": {args}']
            if draw(st.booleans()):
                members.reverse()
            batch.append("{" + ", ".join(members) + "}")
            expected.append((name, args))
        ws = draw(st.sampled_from(["", "\n", " "]))
        inner = batch[0] if fmt is HERMES and draw(st.booleans()) else "[" + ", ".join(batch) + "]"
        parts.append(OPENING + ws + inner + ws + CLOSING)
    tail = draw(_PROSE)
    prose.append(tail)
    parts.append(tail)
    return fmt, "".join(parts), "".join(prose), expected


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(replies(), st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_any_chunking_gives_the_same_calls_text_and_events(reply, cuts) -> None:
    fmt, text, prose, expected = reply
    events = [e for s in feed(text, fmt, cuts) for e in s]
    check_well_formed(events)
    assert calls(events) == [(n, a, True) for n, a in expected]  # the generated text of each arguments object
    assert texts(events) == prose
    at_once = [e for s in feed(text, fmt, [len(text) or 1]) for e in s]
    assert merged(events) == merged(at_once)
    whole = parse_tool_calls(text, fmt, KNOWN, ids())
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [(n, a) for n, a in expected]
    assert whole.content == (None if expected and not prose.strip() else prose)


_NOISE = st.lists(st.sampled_from(
    [OPENING, CLOSING, '{"name": "get_weather", "arguments": ', '"get_time"', '"nope"', '"name"', '"arguments"',
     "{", "}", "[", "]", '"', "\\", ",", ":", " ", "\n", "1", "-", "e", ".", "tru", "e", "null", "x", "<", "/"]),
    max_size=40).map("".join)


@_SETTINGS
@given(_NOISE, st.lists(st.integers(1, 7), min_size=1, max_size=5), st.booleans())
@example("<tool_call><", [1], False)  # a block cut inside what could be its closing tag, no call in it
@example("<tool_call></", [13], True)
def test_any_text_parses_without_losing_text_and_independently_of_chunking(text, cuts, truncated) -> None:
    steps = feed(text, XLAM, cuts, truncated)
    events = [e for s in steps for e in s]
    check_well_formed(events)
    at_once = [e for s in feed(text, XLAM, [len(text) or 1], truncated) for e in s]
    assert merged(events) == merged(at_once)
    if not calls(events):
        assert texts(events) == text, "no call: every character comes back as text"
    pos = 0  # every piece of text is the reply's own, in order
    for e in at_once:
        if isinstance(e, TextEvent):
            found = text.find(e.text, pos)
            assert found >= 0, (e.text, text)
            pos = found + len(e.text)
    whole = parse_tool_calls(text, XLAM, KNOWN, ids(), truncated=truncated)
    assert [(c.name, c.arguments, c.complete) for c in whole.tool_calls] == calls(events)


# ---- the three APIs' streams ------------------------------------------------------------------------------
# (the schemas take the reply's arguments: the tools' grammar runs, and a model can only say what it allows)
WEATHER_OPENAI = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}
TIME_OPENAI = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
REPLY = 'Checking. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, ' \
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]</tool_call>'
ARGS = [{"city": "Paris", "unit": "celsius"}, {"zone": "Europe/Paris"}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def http_client(engine: FakeEngine, **kwargs: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(engine, None, ServerSettings(serve_web=False), None, **kwargs)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30) as http:
            yield http, app


def _sse_data(resp: httpx.Response) -> list[dict[str, Any]]:
    events = parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))
    return [json.loads(data) for _, data in events if data != "[DONE]"]


@pytest.mark.anyio
async def test_openai_chat_stream_sends_id_and_name_first_then_argument_pieces(smollm_tokenizer) -> None:
    import openai

    engine = FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048)
    async with http_client(engine) as (http, _):
        body = {"messages": ASK, "tools": [WEATHER_OPENAI, TIME_OPENAI]}
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
        async with client.chat.completions.stream(model="fake-model", messages=ASK,
                                                  tools=[WEATHER_OPENAI, TIME_OPENAI]) as stream:
            sdk_events = [e async for e in stream]
            final = await stream.get_final_completion()
    chunks = _sse_data(streamed)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    order: list[tuple[int, str]] = []
    for c in chunks:
        for tc in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["arguments"] == "" and not pieces[tc["index"]]
                order.append((tc["index"], "start"))
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                pieces[tc["index"]].append(tc["function"]["arguments"])
                order.append((tc["index"], "arguments"))
    assert order[0] == (0, "start") and order.index((1, "start")) > order.index((0, "arguments"))
    assert all(i == 1 for i, _ in order[order.index((1, "start")):]), "call 0 is done before call 1 starts"
    assert len(pieces[0]) > 3 and len(pieces[1]) > 3, "arguments arrive in pieces as generated"
    assert not _is_json(pieces[0][0])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking. "
    body_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert [("".join(pieces[i])) for i in (0, 1)] == [a for _, a in body_calls]
    assert [json.loads(a) for _, a in body_calls] == ARGS
    # the openai SDK's stream helper assembles the same calls, and saw the argument pieces one by one
    sdk_calls = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert sdk_calls == body_calls
    arg_events = [e for e in sdk_events if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
    assert len(arg_events) == len(pieces[0]) + len(pieces[1])
    assert {e.type for e in sdk_events} >= {"tool_calls.function.arguments.done", "content.done"}


@pytest.mark.anyio
async def test_anthropic_stream_sends_input_json_deltas_as_generated(smollm_tokenizer) -> None:
    import anthropic

    tools = [{"name": "get_weather", "input_schema": WEATHER_OPENAI["function"]["parameters"]},
             {"name": "get_time", "input_schema": TIME_OPENAI["function"]["parameters"]}]
    import httpx2  # (the anthropic SDK's own httpx)

    engine = FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048)
    payload = {"model": "fake-model", "max_tokens": 200, "messages": ASK, "tools": tools}
    headers = {"anthropic-version": "2023-06-01"}
    async with http_client(engine) as (http, app):
        whole = (await http.post("/v1/messages", json=payload, headers=headers)).json()
        streamed = await http.post("/v1/messages", json={**payload, "stream": True}, headers=headers)
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test", timeout=30) as h2:
            client = anthropic.AsyncAnthropic(api_key="x", base_url="http://test", http_client=h2, max_retries=0)
            async with client.messages.stream(**payload) as stream:
                sdk_events = [e async for e in stream]
                final = await stream.get_final_message()
    assert whole["stop_reason"] == "tool_use"
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use", "tool_use"]
    assert [b["input"] for b in whole["content"][1:]] == ARGS
    frames = [d for d in _sse_data(streamed) if d["type"] != "ping"]
    for block in (1, 2):
        (start,) = [i for i, d in enumerate(frames) if d["type"] == "content_block_start" and d["index"] == block]
        (stop,) = [i for i, d in enumerate(frames) if d["type"] == "content_block_stop" and d["index"] == block]
        opened = frames[start]["content_block"]
        assert opened["id"].startswith("toolu_")
        assert (opened["type"], opened["name"], opened["input"]) == ("tool_use", KNOWN[block - 1], {})
        deltas = [d["delta"]["partial_json"] for d in frames[start + 1:stop]]
        assert all(d["type"] == "content_block_delta" and d["index"] == block and
                   d["delta"]["type"] == "input_json_delta" for d in frames[start + 1:stop])
        assert len(deltas) > 3 and not _is_json(deltas[0]), "the input arrives in pieces before the block stops"
        assert json.loads("".join(deltas)) == ARGS[block - 1]
    # the anthropic SDK's accumulator builds the same message
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b["type"], b.get("name"), b.get("input")) for b in whole["content"]]
    assert sum(1 for e in sdk_events if e.type == "input_json") > 6
    assert final.stop_reason == "tool_use"


@pytest.mark.anyio
async def test_responses_stream_sends_function_call_argument_deltas_as_generated(smollm_tokenizer) -> None:
    import openai

    from chatserve.sessions.memory_response_store import InMemoryResponseStore

    tools = [{"type": "function", **WEATHER_OPENAI["function"]}, {"type": "function", **TIME_OPENAI["function"]}]
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048)
    async with http_client(engine, responses=InMemoryResponseStore()) as (http, _):
        whole = (await http.post("/v1/responses", json={"input": "Weather?", "tools": tools})).json()
        streamed = await http.post("/v1/responses", json={"input": "Weather?", "tools": tools, "stream": True})
        client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
        async with client.responses.stream(model="fake-model", input="Weather?", tools=tools) as stream:
            sdk_events = [e async for e in stream]
            final = await stream.get_final_response()
    items = [i for i in whole["output"] if i["type"] == "function_call"]
    assert [json.loads(i["arguments"]) for i in items] == ARGS and all(i["status"] == "completed" for i in items)
    events = _sse_data(streamed)
    for item in items:
        output_index = whole["output"].index(item)
        (added,) = [i for i, e in enumerate(events) if e["type"] == "response.output_item.added"
                    and e["output_index"] == output_index]
        assert events[added]["item"]["arguments"] == "" and events[added]["item"]["name"] == item["name"]
        (done,) = [i for i, e in enumerate(events) if e["type"] == "response.function_call_arguments.done"
                   and e["output_index"] == output_index]
        deltas = [e["delta"] for e in events[added:done] if e["type"] == "response.function_call_arguments.delta"]
        assert len(deltas) > 3 and not _is_json(deltas[0])
        assert "".join(deltas) == events[done]["arguments"] == item["arguments"]
    sdk_calls = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert sdk_calls == [(i["name"], i["arguments"]) for i in items]
    assert sum(1 for e in sdk_events if e.type == "response.function_call_arguments.delta") > 6
