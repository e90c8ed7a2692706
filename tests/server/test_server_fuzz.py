"""Hostile input: property-based and fuzz tests of the request schemas, in-process and over HTTP.

Two layers. In-process, hypothesis throws arbitrary JSON (and text that is almost JSON: NaN,
1e400, 400-digit integers, lone surrogates, raw control characters, broken UTF-8, deep nesting)
at `parse_model` for every request model: the result is a model or a 400 `APIError`, nothing
else, and every model that validates also becomes `SamplingParams` and goes through the real
sampler without an exception. Over HTTP, one real server with small limits gets generated raw
bodies on every POST route plus explicit nasty cases; every answer is a 2xx or a 4xx in OpenAI's
error shape, never a 5xx, and afterwards the server is healthy, idle, its KV cache passes the
integrity check and its log has no traceback.

Generated requests that happen to be valid are made cheap (at most CHEAP_TOKENS tokens per
choice) before they are sent, so the whole file takes about a minute on two cores. Examples are
derandomized: CI sees the same bodies on every run.
"""

from __future__ import annotations

import collections
import json
import math
import socket
import time
import urllib.parse
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatserve.server.chat.params import build_sampling_params
from chatserve.server.errors import APIError
from chatserve.server.http_input import parse_model
from chatserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from chatserve.server.responses.protocol import ResponsesRequest
from chatserve.server.sessions.protocol import CreateSessionRequest, SessionMessageRequest
from chatserve.worker.sampler import Sampler, make_generator
from tests.helpers.errors import assert_error as assert_openai_error
from tests.helpers.errors import check_error_body
from tests.helpers.server import ServerProcess, start_server

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # SmolLM2's vocabulary
MAX_BODY, MAX_N, MAX_STOPS, MAX_MESSAGES, MAX_MODEL_LEN = 65536, 4, 4, 32, 1024
CHEAP_TOKENS = 2  # the most tokens a generated request that turns out valid may ask for


# ---- generating (almost) JSON ---------------------------------------------------------------------
class Raw(str):
    """Text spliced verbatim into a generated document: what json.dumps cannot or will not write."""


RAW_LITERALS = [Raw(x) for x in (
    "NaN", "-NaN", "Infinity", "-Infinity", "inf", "1e400", "-1e400", "1e-400", "9" * 400, "-" + "9" * 400,
    "-0", "1.0", "1E2", "00", "01", "+1", ".5", "0x10", "1_000", "'single'", "undefined", "None", "True",
    '"\\ud800"', '"\\udfff"', '"\\udc00\\ud800"', '"\\u0000"', '"a\x01b"', '"tab\there"', '"\x7f"', '"\\x41"',
    '"\\uZZZZ"', "[1,]", '{"a":1,}', "[" * 300 + "]" * 300, '{"a":' * 300 + "1" + "}" * 300, "",
)]
BIG_INTS = [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 10**400, -(10**400)]

texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # control chars, non-ASCII, emoji
ints = st.one_of(st.integers(-3, 40), st.integers(), st.sampled_from(BIG_INTS))
floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.sampled_from(RAW_LITERALS))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=10
)


def dump(value: Any) -> str:
    """JSON text of `value`, with `Raw` pieces written as they are."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: usually something of the right shape (in range or just outside), sometimes anything."""
    return st.one_of(plausible, plausible, json_values)


def num(lo: float, hi: float) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi), st.integers(math.ceil(lo), math.floor(hi)))


def field(valid: st.SearchStrategy, near: st.SearchStrategy | None = None) -> tuple[st.SearchStrategy, ...]:
    """(a valid value, a wild one): `near` is the right shape but may be out of range; wild adds any JSON."""
    return valid, mostly(st.one_of(valid, near) if near is not None else valid)


some_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
roles = st.sampled_from(["system", "developer", "user", "assistant"])
valid_message = st.fixed_dictionaries(
    {"role": roles, "content": st.one_of(texts, st.none(), st.lists(text_part, max_size=3))}, optional={"name": texts}
)
wild_message = st.fixed_dictionaries(
    {"role": mostly(st.one_of(roles, st.just("tool"))),
     "content": mostly(st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries(
         {"type": mostly(st.just("text")), "text": mostly(texts)}), max_size=3)))},
    optional={"name": mostly(texts)},
)
token_id = st.one_of(st.integers(-1, VOCAB + 1), st.sampled_from(BIG_INTS))
valid_stop = st.one_of(st.none(), some_text, st.lists(some_text, max_size=MAX_STOPS))

SAMPLING_FIELDS = {
    "model": field(st.sampled_from([None, MODEL]), st.just("gpt-4o")),
    "temperature": field(num(0.0, 2.0), num(-0.5, 2.5)),
    "top_p": field(st.floats(0.0, 1.0, exclude_min=True), num(-0.1, 1.1)),
    "n": field(st.integers(1, MAX_N), st.integers(-1, MAX_N + 2)),
    "stream": field(st.booleans()),
    "stream_options": field(st.none(), st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                          "resumable": mostly(st.booleans())})),
    "disconnect_policy": field(st.sampled_from([None, "abort", {"mode": "detach", "lease_seconds": 5}]), st.one_of(
        texts, st.sampled_from(["detach", "abort"]), st.fixed_dictionaries({}, optional={
            "mode": mostly(st.sampled_from(["abort", "detach"])), "lease_seconds": mostly(num(-1, 5000))}))),
    "stop": field(valid_stop, st.one_of(texts, st.lists(texts, max_size=MAX_STOPS + 2))),
    "max_tokens": field(st.integers(1, CHEAP_TOKENS), st.one_of(st.none(), st.integers(-1, 6))),
    "presence_penalty": field(num(-2.0, 2.0), num(-2.5, 2.5)),
    "frequency_penalty": field(num(-2.0, 2.0), num(-2.5, 2.5)),
    "seed": field(st.integers(-(2**63), 2**64 - 1), st.integers(-(2**64), 2**65)),
    "user": field(texts),
    "logit_bias": field(st.one_of(st.none(), st.dictionaries(st.integers(0, 63).map(str), st.floats(-100, 100),  # (in _LOGITS)
                                                             max_size=2)),
                        st.dictionaries(st.text("abc-", min_size=1, max_size=4), floats, min_size=1, max_size=2)),
    "top_k": field(st.one_of(st.integers(-1, 100), st.just(2**31 - 1)),
                   st.one_of(st.integers(-2, 100), st.sampled_from(BIG_INTS))),
    "min_p": field(st.floats(0.0, 1.0), num(-0.1, 1.1)),
    "repetition_penalty": field(st.floats(0.0, 10.0, exclude_min=True), num(-0.1, 11.0)),
    "min_tokens": field(st.integers(0, 1), st.integers(-1, 6)),
    "ignore_eos": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "stop_token_ids": field(st.one_of(st.none(), st.lists(st.integers(0, VOCAB + 10), max_size=3)),
                            st.lists(token_id, max_size=3)),
    "include_stop_str_in_output": field(st.booleans()),
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "max_completion_tokens": field(st.one_of(st.none(), st.integers(1, CHEAP_TOKENS)), st.integers(-1, 6)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.none(), st.integers(-1, 22)),
    "add_generation_prompt": field(st.booleans()),
    "tools": field(st.one_of(st.none(), st.just([])), st.lists(json_values, max_size=2)),
    "tool_choice": field(st.sampled_from([None, "none", "auto"]), st.just("required")),
    "functions": field(st.one_of(st.none(), st.just([])), st.lists(json_values, max_size=1)),
    "response_format": field(st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
                             st.sampled_from([{"type": "json_schema"}, {}, {"type": "xml"}])),
}
valid_prompt = st.one_of(some_text, st.lists(some_text, min_size=1, max_size=2),
                         st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "logprobs": field(st.one_of(st.none(), st.integers(0, 20)), st.integers(-1, 22)),
    "echo": field(st.booleans()),
    "suffix": field(st.one_of(st.none(), st.just("")), texts),
    "best_of": field(st.none(), st.integers(0, 3)),
}
DEFAULTS = {k: SAMPLING_FIELDS[k] for k in (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop")}


VALID_DEFAULTS = {k: v for k, (v, _) in DEFAULTS.items()}
WILD_DEFAULTS = {k: w for k, (_, w) in DEFAULTS.items()}


def body_of(required: dict[str, tuple], optional: dict[str, tuple]) -> st.SearchStrategy:
    """A valid body, a body shaped like the model with wild values (plus unknown keys), or any JSON value."""
    valid = st.fixed_dictionaries({k: v[0] for k, v in required.items()},
                                  optional={k: v[0] for k, v in optional.items()})
    wild = st.builds(
        lambda known, extra: {**extra, **known},
        st.fixed_dictionaries({k: v[1] for k, v in required.items()}, optional={k: v[1] for k, v in optional.items()}),
        st.dictionaries(texts, json_values, max_size=2),
    )
    return st.one_of(valid, wild, wild, json_values)


CHAT_BODIES = body_of(
    {"messages": field(st.lists(valid_message, min_size=1, max_size=4), st.lists(wild_message, max_size=5))},
    CHAT_FIELDS,
)
COMPLETION_BODIES = body_of({"prompt": field(valid_prompt, st.one_of(
    texts, st.lists(texts, max_size=3), st.lists(token_id, max_size=8),
    st.lists(st.lists(st.integers(-1, VOCAB), max_size=4), max_size=3)))}, COMPLETION_FIELDS)
CREATE_SESSION_BODIES = body_of({}, {
    "system_prompt": field(st.one_of(st.none(), texts)),
    "metadata": field(st.one_of(st.none(), st.dictionaries(texts, json_values, max_size=3))),
    "ttl_seconds": field(st.one_of(st.none(), st.integers(1, 3600)),
                         st.one_of(st.integers(-1, 400 * 24 * 3600), st.sampled_from(BIG_INTS))),
    "defaults": field(st.one_of(st.none(), st.fixed_dictionaries({}, optional=VALID_DEFAULTS)),
                      st.fixed_dictionaries({}, optional=WILD_DEFAULTS)),
})
SESSION_MESSAGE_BODIES = body_of({"content": field(some_text, texts)},
                                 {**SAMPLING_FIELDS, "logprobs": field(st.booleans())})
# POST /v1/responses: input items of every kind (and kinds we refuse), the Responses fields
text_or_parts = st.one_of(some_text, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text"]), "text": texts}), min_size=1, max_size=2))
valid_item = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": text_or_parts}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": some_text, "name": some_text,
                           "arguments": texts}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": some_text, "output": texts}),
)
wild_item = st.fixed_dictionaries({}, optional={
    "type": mostly(st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"])),
    "role": mostly(roles), "content": mostly(st.one_of(texts, st.lists(json_values, max_size=2))),
    "call_id": mostly(texts), "output": mostly(texts), "name": mostly(texts), "arguments": mostly(texts)})
RESPONSES_FIELDS = {
    **{k: SAMPLING_FIELDS[k] for k in ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                                       "presence_penalty", "frequency_penalty", "ignore_eos", "user")},
    "instructions": field(st.one_of(st.none(), texts)),
    "max_output_tokens": field(st.integers(1, CHEAP_TOKENS), st.one_of(st.none(), st.integers(-1, 6))),
    "stream": field(st.booleans()),
    "store": field(st.booleans()),
    "background": field(st.just(False), st.booleans()),
    "previous_response_id": field(st.none(), st.one_of(texts, st.just("resp_" + "0" * 32))),
    "tools": field(st.one_of(st.none(), st.just([])), st.lists(json_values, max_size=2)),
    "tool_choice": field(st.sampled_from([None, "none", "auto"]), st.one_of(st.just("required"), json_values)),
    "parallel_tool_calls": field(st.booleans()),
    "text": field(st.sampled_from([None, {"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
                  st.sampled_from([{"format": {"type": "json_schema"}}, {}, {"format": {"type": "xml"}},
                                   {"verbosity": "high"}])),
    "metadata": field(st.one_of(st.none(), st.dictionaries(some_text, texts, max_size=3)),
                      st.dictionaries(texts, json_values, max_size=20)),
    "truncation": field(st.sampled_from([None, "disabled"]), st.just("auto")),
    "include": field(st.one_of(st.none(), st.just([])), st.lists(texts, max_size=2)),
    "reasoning": field(st.none(), json_values),
}
RESPONSES_BODIES = body_of({"input": field(st.one_of(some_text, st.lists(valid_item, min_size=1, max_size=3)),
                                           st.one_of(texts, st.lists(wild_item, max_size=3)))}, RESPONSES_FIELDS)

# How the JSON text becomes bytes: UTF-8 two times in three, otherwise broken on the way.
ENCODINGS = ["utf-8"] * 14 + ["truncate", "bad-byte", "overlong", "surrogate-bytes", "utf-16", "bom", "latin-1"]
BAD_BYTES = [b"\xff", b"\xfe", b"\xc3", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x00"]


@st.composite
def encoded(draw: st.DrawFn, bodies: st.SearchStrategy, cheap: bool = False) -> tuple[Any, bytes]:
    body = draw(bodies)
    if cheap:
        body = cheapen(body)
    text = dump(body)
    how = draw(st.sampled_from(ENCODINGS))
    data = text.encode("utf-8", "surrogatepass")
    if how == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how in ("bad-byte", "overlong", "surrogate-bytes"):
        fixed = {"overlong": b"\xc0\xaf", "surrogate-bytes": b"\xed\xa0\x80"}
        piece = fixed.get(how) or draw(st.sampled_from(BAD_BYTES))
        at = draw(st.integers(0, len(data)))
        data = data[:at] + piece + data[at:]
    elif how == "utf-16":
        data = text.encode("utf-16", "surrogatepass")
    elif how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "latin-1":
        data = text.encode("latin-1", "replace")
    return body, data


def cheapen(body: Any) -> Any:
    """A body that would be valid asks for at most CHEAP_TOKENS tokens per choice (n is capped by the server).

    Only token counts that are valid and too large (or absent, which means "fill the context") are
    replaced; out-of-range and wrongly typed values are kept, since they must still get a 400.
    """
    if not isinstance(body, dict):
        return body
    body = dict(body)
    keys = ("max_output_tokens",) if "input" in body else ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        too_many = isinstance(value, int) and not isinstance(value, bool) and value > CHEAP_TOKENS
        if value is None or too_many or (isinstance(value, Raw) and value.strip() in ("null", "")):
            body[key] = CHEAP_TOKENS
    return body


# ---- 1. the pydantic models, in process ------------------------------------------------------------
MODELS = {
    "chat": (ChatCompletionRequest, CHAT_BODIES),
    "completions": (CompletionRequest, COMPLETION_BODIES),
    "create_session": (CreateSessionRequest, CREATE_SESSION_BODIES),
    "session_message": (SessionMessageRequest, SESSION_MESSAGE_BODIES),
    "responses": (ResponsesRequest, RESPONSES_BODIES),
}
_SAMPLER = Sampler()
_LOGITS = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 5


def parse_or_400(model: type, data: bytes) -> Any:
    """The model, or None after checking that the refusal is a 400 with a useful message."""
    try:
        return parse_model(model, data)
    except APIError as exc:
        assert exc.status == 400, (exc.status, exc.message)
        assert isinstance(exc.message, str) and exc.message and "Traceback" not in exc.message
        assert exc.param is None or isinstance(exc.param, str)
        err = exc.body()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        json.dumps(exc.body(), allow_nan=False)  # the error itself is serialisable
        return None


def check_sampling_path(parsed: Any) -> None:
    """A request that validates becomes SamplingParams (or a 400) and samples without an exception."""
    if isinstance(parsed, ChatCompletionRequest):
        max_tokens, logprobs = parsed.effective_max_tokens(), parsed.num_logprobs()
    elif isinstance(parsed, CompletionRequest):
        max_tokens, logprobs = parsed.max_tokens, parsed.logprobs
    elif isinstance(parsed, SessionMessageRequest):
        max_tokens, logprobs = parsed.max_tokens, (0 if parsed.logprobs else None)
    elif isinstance(parsed, ResponsesRequest):
        max_tokens, logprobs = parsed.max_output_tokens, None
        parsed = parsed.sampling_fields()  # what the route builds its SamplingParams from
    else:
        return
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(parsed, name)
        assert value is None or math.isfinite(value), (name, value)
    try:
        params = build_sampling_params(parsed, max_tokens, logprobs)
    except APIError as exc:
        assert exc.status == 400
        return
    result = _SAMPLER(_LOGITS, [params], [[1, 2, 3]], [[]], [make_generator(params.seed)], eos_token_ids=[0])
    assert 0 <= result.token_ids[0] < _LOGITS.shape[1]


@pytest.mark.parametrize("name", list(MODELS))
def test_models_accept_or_refuse_with_400(name):
    model, bodies = MODELS[name]

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(encoded(bodies))
    def check(case):
        _, data = case
        parsed = parse_or_400(model, data)
        if parsed is not None:
            assert isinstance(parsed, model)
            check_sampling_path(parsed)

    check()


@pytest.mark.parametrize("data", [
    b"[" * 100_000, b'{"a":' * 50_000, b'{"messages":' + b"[" * 5000,
    b'{"metadata":{"x":' + b"[" * 5000 + b"]" * 5000 + b"}}",
    b'{"temperature": 1e400}', b'{"top_k": ' + b"9" * 5000 + b"}", b'{"seed": NaN}', b'{"n": Infinity}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"\xff\xfe\x00{", b"\xed\xa0\x80", b"   ", b"null",
])
def test_models_edge_cases_are_400_not_exceptions(data):
    for model, _ in MODELS.values():
        assert parse_or_400(model, data) is None or model is CreateSessionRequest


def test_top_k_that_would_overflow_the_sampler_is_refused():
    for model, base in ((ChatCompletionRequest, '{"messages":[{"role":"user","content":"x"}],'),
                        (CompletionRequest, '{"prompt":"x",'), (SessionMessageRequest, '{"content":"x",')):
        assert parse_or_400(model, f'{base}"top_k": {2**63}}}'.encode()) is None
        assert parse_or_400(model, f'{base}"top_k": {2**31 - 1}}}'.encode()) is not None
    assert parse_or_400(CreateSessionRequest, f'{{"defaults": {{"top_k": {10**30}}}}}'.encode()) is None


# ---- 2. one real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-body-bytes", str(MAX_BODY), "--max-n", str(MAX_N), "--max-stop-sequences", str(MAX_STOPS),
                       "--max-messages", str(MAX_MESSAGES), "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-num-seqs", "8", "--no-web")
    yield srv
    code = srv.stop()
    log = srv.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-6000:]


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


STATUSES: collections.Counter = collections.Counter()  # what the fuzzed requests got, printed at the end


def assert_ok_or_openai_error(resp: httpx.Response) -> None:
    """2xx with a well-formed body (a JSON object, or an SSE stream that ends in [DONE]), or a clean 4xx."""
    STATUSES[resp.status_code] += 1
    if resp.status_code >= 300:
        assert_openai_error(resp)
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        data = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
        assert data and data[-1] == "[DONE]", resp.text[-500:]
        for d in data[:-1]:
            event = json.loads(d)
            assert "error" not in event, event
    else:
        assert isinstance(resp.json(), dict)


def post_raw(http: httpx.Client, path: str, data: bytes, headers: dict | None = None) -> httpx.Response:
    return http.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})


FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("path, bodies, examples", [
    ("/v1/chat/completions", CHAT_BODIES, 40),
    ("/v1/completions", COMPLETION_BODIES, 30),
])
def test_fuzzed_openai_bodies_get_2xx_or_openai_4xx(server, http, path, bodies, examples):
    @settings(FUZZ, max_examples=examples)
    @given(encoded(bodies, cheap=True))
    def check(case):
        _, data = case
        resp = post_raw(http, path, data)
        assert_ok_or_openai_error(resp)
        if resp.status_code == 200 and not resp.headers["content-type"].startswith("text/event-stream"):
            usage = resp.json()["usage"]
            assert usage["completion_tokens"] <= CHEAP_TOKENS * len(resp.json()["choices"])

    check()


def test_fuzzed_session_bodies_get_2xx_or_openai_4xx(server, http):
    @settings(FUZZ, max_examples=25)
    @given(encoded(CREATE_SESSION_BODIES))
    def create(case):
        _, data = case
        resp = post_raw(http, "/v1/sessions", data)
        assert_ok_or_openai_error(resp)
        if resp.status_code == 201:
            # Whatever defaults it was created with, a short turn works (or is a clean 400, e.g. a huge prompt).
            sid = resp.json()["id"]
            turn = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 1, "stream": False})
            assert turn.status_code == 200 or assert_openai_error(turn, 400)
            assert http.delete(f"/v1/sessions/{sid}").status_code == 200

    create()

    sid = http.post("/v1/sessions", json={}).json()["id"]

    @settings(FUZZ, max_examples=30)
    @given(encoded(SESSION_MESSAGE_BODIES, cheap=True))
    def turn(case):
        _, data = case
        assert_ok_or_openai_error(post_raw(http, f"/v1/sessions/{sid}/messages", data))

    turn()
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def assert_response_ok_or_openai_error(resp: httpx.Response) -> None:
    """/v1/responses: a response object, a typed event stream that ends in a final event, or a clean 4xx."""
    STATUSES[resp.status_code] += 1
    if resp.status_code >= 300:
        assert_openai_error(resp)
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[5:]) for line in resp.text.splitlines() if line.startswith("data:")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), resp.text[-500:]
        assert events[0]["type"] == "response.created", events[0]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), events[-1]
        if events[-1]["type"] == "response.failed":
            assert events[-1]["response"]["error"]["message"].startswith("generation failed:"), events[-1]
    else:
        body = resp.json()
        assert body["object"] == "response", body
        if body["status"] == "failed":
            # The engine ended the request with finish_reason "error" (e.g. a grammar that rejected the
            # sampled token; chat answers those with a 500 generation_error): the response says so.
            assert body["error"]["message"].startswith("generation failed:"), body
            STATUSES["failed"] += 1
        else:
            assert body["status"] in ("completed", "incomplete", "queued"), body
        if body["status"] != "queued":
            assert body["usage"]["output_tokens"] <= CHEAP_TOKENS


def test_fuzzed_responses_bodies_get_2xx_or_openai_4xx(server, http):
    @settings(FUZZ, max_examples=40)
    @given(encoded(RESPONSES_BODIES, cheap=True))
    def check(case):
        _, data = case
        resp = post_raw(http, "/v1/responses", data)
        assert_response_ok_or_openai_error(resp)
        if resp.status_code == 200 and resp.headers["content-type"].startswith("application/json"):
            rid = resp.json()["id"]
            for r in (http.get(f"/v1/responses/{rid}"), http.get(f"/v1/responses/{rid}/input_items"),
                      http.post(f"/v1/responses/{rid}/cancel")):
                assert r.status_code == 200 or assert_openai_error(r, 404), r.text  # 404: store false
            assert http.delete(f"/v1/responses/{rid}").status_code in (200, 404)

    check()


def test_fuzzed_response_ids_and_query_params(server, http):
    rid = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1}).json()["id"]

    @settings(FUZZ, max_examples=15)
    @given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=300), texts, texts)
    def check(some_id, a, b):
        quoted = "/v1/responses/" + urllib.parse.quote(some_id, safe="").replace(".", "%2E")
        for resp in (http.get(quoted), http.delete(quoted), http.post(quoted + "/cancel"),
                     http.get(quoted + "/input_items"), http.get(quoted, params={"stream": "true"})):
            assert resp.status_code in (404, 405), resp.text
            assert_openai_error(resp)
        for params in ({"limit": a[:20]}, {"order": a, "after": b}, {"before": a}, {"include": a}):
            assert_ok_or_openai_error(http.get(f"/v1/responses/{rid}/input_items", params=params))
        for params in ({"stream": a[:10]}, {"stream": "true", "starting_after": a[:20]}, {"starting_after": b}):
            resp = http.get(f"/v1/responses/{rid}", params=params)
            assert resp.status_code in (200, 400), resp.text
            if resp.status_code == 400:
                assert_openai_error(resp)

    check()
    assert http.delete(f"/v1/responses/{rid}").status_code == 200


def test_fuzzed_session_ids_and_query_params(server, http):
    @settings(FUZZ, max_examples=15)
    @given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=300), texts)
    def check(sid, after):
        quoted = "/v1/sessions/" + urllib.parse.quote(sid, safe="").replace(".", "%2E")
        for resp in (http.get(quoted), http.delete(quoted),
                     http.post(quoted + "/messages", json={"content": "x", "max_tokens": 1})):
            assert resp.status_code == 404 or resp.status_code == 405, resp.text
            assert_openai_error(resp)
        assert_ok_or_openai_error(http.get("/v1/sessions", params={"limit": sid[:20], "after": after}))

    check()


# ---- explicit nasty cases ----------------------------------------------------------------------------
CHAT_OK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def with_field(base: dict, key: str, raw: str) -> bytes:
    return (json.dumps(base)[:-1] + f', "{key}": {raw}}}').encode()


@pytest.mark.parametrize("data", [
    b"[" * 60_000,  # under the body limit: refused by the parser's depth limit
    b'{"messages": ' + b"[" * 60_000,
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "user": ' + b'{"a":' * 10_000 + b"}",
    b"[" * 100_000,  # over the body limit: 413 before parsing
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',  # overlong '/'
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # a surrogate encoded in UTF-8
    b'{"messages": [{"role": "user", "content": "\xe6\x97"}]}',  # truncated character
    '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),
    json.dumps(CHAT_OK).encode("utf-16"),
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 1}',
    b"", b"   ", b"null", b"1e400", b"NaN", b'"x"', b"[]", b"{}",
])
def test_malformed_bodies_are_clean_4xx(server, http, data):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/sessions", "/v1/sessions/sess_missing/messages",
                 "/v1/responses"):
        resp = post_raw(http, path, data)
        if path == "/v1/sessions" and data == b"{}":
            assert resp.status_code == 201
            continue
        assert_openai_error(resp)


NASTY_NUMBERS = ["1e400", "-1e400", "1e-400", "1" + "0" * 400, "-1" + "0" * 400, "NaN", "Infinity", "-Infinity",
                 str(2**63), str(2**64), "-0.0", "1.5"]
CHAT_NUMERIC = ["temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "seed", "top_k", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "top_logprobs"]


@pytest.mark.parametrize("raw", NASTY_NUMBERS)
def test_huge_and_non_finite_numbers(server, http, raw):
    for key in CHAT_NUMERIC:
        base = {**CHAT_OK, "logprobs": True} if key == "top_logprobs" else CHAT_OK
        if key in ("max_tokens", "max_completion_tokens"):
            base = {"messages": CHAT_OK["messages"]}
        assert_ok_or_openai_error(post_raw(http, "/v1/chat/completions", with_field(base, key, raw)))
    for key, base in (("stop_token_ids", CHAT_OK), ("logprobs", {"prompt": "x", "max_tokens": 1}),
                      ("prompt", {"max_tokens": 1})):
        value = raw if key == "logprobs" else f"[{raw}]"
        path = "/v1/chat/completions" if key == "stop_token_ids" else "/v1/completions"
        assert_ok_or_openai_error(post_raw(http, path, with_field(base, key, value)))
    for key in ("ttl_seconds", "metadata"):
        value = raw if key == "ttl_seconds" else f'{{"x": {raw}}}'
        resp = post_raw(http, "/v1/sessions", f'{{"{key}": {value}}}'.encode())
        assert_ok_or_openai_error(resp)
        if resp.status_code == 201:
            got = http.get(f"/v1/sessions/{resp.json()['id']}")
            assert got.status_code == 200, got.text  # what was stored can be read back as JSON
    # Numbers that are syntactically fine but absurd are refused, never passed to the engine.
    for key in ("n", "max_tokens", "top_k", "seed", "min_tokens"):
        if raw in ("1" + "0" * 400, str(2**64)):
            assert_openai_error(post_raw(http, "/v1/chat/completions", with_field(CHAT_OK, key, raw)), 400)


def test_body_over_the_limit_with_and_without_content_length(server, http):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}).encode()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/sessions", "/v1/sessions/sess_x/messages",
                 "/v1/responses"):
        err = assert_openai_error(post_raw(http, path, big), 413)
        assert err["code"] == "body_too_large" and str(MAX_BODY) in err["message"]

        def chunks():  # no Content-Length: a chunked upload that never says how big it is
            for i in range(0, len(big), 4096):
                yield big[i:i + 4096]

        resp = http.post(path, content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in resp.request.headers
        assert assert_openai_error(resp, 413)["code"] == "body_too_large"


def test_body_exactly_at_the_limit_is_read(server, http):
    body = json.dumps(CHAT_OK).encode()
    padded = body + b" " * (MAX_BODY - len(body))  # JSON allows trailing whitespace
    assert len(padded) == MAX_BODY
    assert post_raw(http, "/v1/chat/completions", padded).status_code == 200
    assert_openai_error(post_raw(http, "/v1/chat/completions", padded + b" "), 413)


def raw_request(server: ServerProcess, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a bare socket (httpx refuses to send some header bytes): status, body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


# Bytes an HTTP field value may not contain at all: the HTTP parser refuses the request (plain-text 400)
# before the application sees it. Every other byte reaches the app, which must answer in OpenAI's shape.
PARSER_REFUSES = {0x00, 0x0A, 0x0B, 0x0C, 0x0D}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/sessions/{sid}/messages"])
def test_hostile_request_ids(server, http, path):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    path = path.format(sid=sid)
    body = json.dumps({"content": "Hi", "max_tokens": 1, "stream": False} if "sessions" in path else
                      CHAT_OK if "chat" in path else {"prompt": "Hi", "max_tokens": 1}).encode()
    ids = [b"a" + bytes([b]) + b"b" for b in [*range(32), 0x20, 0x7F, 0x80, 0xC3, 0xFF]]
    ids += ["é".encode(), "日本".encode(), "\U0001f600".encode(), b"x" * 129, b"x" * 10_000, b"\xed\xa0\x80"]
    for rid in ids:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
                + b"X-Request-Id: " + rid + b"\r\n")
        status, payload = raw_request(server, head, body)
        assert status == 400, (rid[:40], status, payload[:300])
        if not (set(rid) & PARSER_REFUSES):
            assert check_error_body(json.loads(payload))["param"] == "X-Request-Id", payload[:300]
    # The longest allowed id is echoed back.
    resp = post_raw(http, path, body, headers={"X-Request-Id": "r" * 128})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "r" * 128
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_limits_are_enforced(server, http):
    def chat(**extra: Any) -> httpx.Response:
        return http.post("/v1/chat/completions", json={**CHAT_OK, **extra})

    def completion(**extra: Any) -> httpx.Response:
        return http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **extra})

    # max_tokens beyond the context, for every route that generates
    err = assert_openai_error(chat(max_tokens=MAX_MODEL_LEN), 400)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    assert_openai_error(chat(max_completion_tokens=MAX_MODEL_LEN + 1), 400)
    assert_openai_error(completion(prompt=[1, 2, 3], max_tokens=MAX_MODEL_LEN - 2), 400)
    assert_openai_error(completion(prompt=[1] * MAX_MODEL_LEN), 400)
    sid = http.post("/v1/sessions", json={}).json()["id"]
    assert_openai_error(http.post(f"/v1/sessions/{sid}/messages",
                                  json={"content": "Hi", "max_tokens": MAX_MODEL_LEN, "stream": False}), 400)
    # n, and prompts x n for completions
    assert chat(n=MAX_N).status_code == 200
    assert assert_openai_error(chat(n=MAX_N + 1), 400)["param"] == "n"
    assert completion(prompt=["a", "b"], n=MAX_N // 2).status_code == 200
    assert_openai_error(completion(prompt=["a", "b", "c"], n=2), 400)
    assert_openai_error(http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "n": 2}), 400)
    # stop list length and stop string length, in requests and in session defaults
    assert chat(stop=[str(i) for i in range(MAX_STOPS)]).status_code == 200
    assert assert_openai_error(chat(stop=[str(i) for i in range(MAX_STOPS + 1)]), 400)["param"] == "stop"
    assert_openai_error(chat(stop=["x" * 257]), 400)
    assert_openai_error(chat(stop=[""]), 400)
    assert_openai_error(completion(stop=[str(i) for i in range(MAX_STOPS + 1)]), 400)
    assert_openai_error(http.post(f"/v1/sessions/{sid}/messages",
                                  json={"content": "Hi", "stop": ["a"] * (MAX_STOPS + 1)}), 400)
    err = assert_openai_error(http.post("/v1/sessions", json={"defaults": {"stop": ["a"] * (MAX_STOPS + 1)}}), 400)
    assert err["param"] == "defaults.stop"
    assert_openai_error(http.post("/v1/sessions", json={"defaults": {"stop": ""}}), 400)
    assert_openai_error(http.post("/v1/sessions", json={"defaults": {"stop": ["y" * 257]}}), 400)
    assert http.post("/v1/sessions", json={"defaults": {"stop": "a"}}).status_code == 201
    # logprobs
    r = chat(logprobs=True, top_logprobs=20)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    assert_openai_error(chat(logprobs=True, top_logprobs=21), 400)
    assert_openai_error(chat(top_logprobs=2), 400)  # top_logprobs without logprobs
    assert completion(logprobs=20).status_code == 200
    assert_openai_error(completion(logprobs=21), 400)
    # message count
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(MAX_MESSAGES + 1)]
    ok = http.post("/v1/chat/completions", json={"messages": many[:MAX_MESSAGES], "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    err = assert_openai_error(http.post("/v1/chat/completions", json={"messages": many, "max_tokens": 1}), 400)
    assert err["param"] == "messages" and str(MAX_MESSAGES) in err["message"]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 1}), 400)
    # top_k that would not fit the sampler's int64 tensor
    assert assert_openai_error(chat(top_k=2**63), 400)["param"] == "top_k"
    assert chat(top_k=2**31 - 1).status_code == 200
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_fuzzed_resume_ids_and_cursors(server, http):
    """The resume routes: hostile ids are 404s, hostile cursors (header or query) 400s, valid ones streams."""
    path = "/v1/chat/completions/chatcmpl-fuzz-resume/stream"
    started = http.post("/v1/chat/completions", json={**CHAT_OK, "stream": True, "stream_options": {"resumable": True}},
                        headers={"X-Request-Id": "fuzz-resume"})
    assert started.status_code == 200 and started.text.rstrip().endswith("[DONE]")
    printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)

    def stream_or_4xx(resp: httpx.Response) -> None:
        STATUSES[resp.status_code] += 1
        if resp.status_code == 200:
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert "error" not in resp.text
        else:
            assert resp.status_code in (400, 404), resp.text
            assert_openai_error(resp)

    @settings(FUZZ, max_examples=25)
    @given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=300), st.one_of(
        printable, st.integers(-3, 12).map(str), st.sampled_from(BIG_INTS).map(str)), st.one_of(texts, printable))
    def check(run_id, header, query):
        for base in ("/v1/chat/completions/", "/v1/completions/"):
            resp = http.get(base + urllib.parse.quote(run_id, safe="").replace(".", "%2E") + "/stream",
                            headers={"Last-Event-ID": header})
            assert resp.status_code in (400, 404), resp.text
            assert_openai_error(resp)
        stream_or_4xx(http.get(path, headers={"Last-Event-ID": header}))
        stream_or_4xx(http.get(path, params={"starting_after": query}))
        stream_or_4xx(http.get(path, params={"starting_after": query}, headers={"Last-Event-ID": header}))

    check()


def test_server_is_healthy_after_all_of_it(server, http):
    """Runs last: nothing above left the server broken, busy or leaking."""
    assert http.get("/health").json() == {"status": "ok"}
    metrics = server.wait_idle(timeout=30)
    assert metrics["chatserve:num_requests_running"] == 0 and metrics["chatserve:num_requests_waiting"] == 0
    assert metrics["chatserve:kv_cache_usage_perc"] == 0
    cache = http.get("/debug/cache")
    assert cache.status_code == 200 and cache.json()["ok"] is True, cache.text
    assert cache.json()["live_requests"] == 0
    assert not any(k.startswith("chatserve:http_errors_total") and 'status="5' in k and v > 0
                   for k, v in metrics.items()), {k: v for k, v in metrics.items() if "http_errors" in k}
    # Still serves a normal request.
    r = http.post("/v1/chat/completions", json={**CHAT_OK, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    time.sleep(0.2)
    assert "Traceback" not in server.log(), server.log()[-6000:]
    print(f"\nfuzzed responses by status: {dict(sorted(STATUSES.items()))}")
