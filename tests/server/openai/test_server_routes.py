"""The HTTP layer without a model: the real app over `FakeEngine`, driven through httpx's ASGITransport.

Everything here depends on the server alone, not on what a model computes: error shapes and the
`param` they name, auth, 404/405, the cancel endpoint's states, SSE framing ([DONE], the usage
chunk), load shedding, and the session routes over the in-memory store. `FakeEngine` is the real
engine over a scripted worker (no model), with the real tokenizer, so prompt validation, streams,
aborts and the KV cache are the engine's own. The end-to-end
tests against a real server (test_server_openai.py, test_server_sessions.py) cover the rest.

ASGITransport hands a response over only once it is complete, so a request that must still be
running while the test acts (cancel, overload) is started as a task and the test waits for the
fake engine to have it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from chatserve.server import ServerSettings, create_app
from chatserve.sessions import InMemorySessionStore, SessionStoreUnavailable
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.streams import blank_line_messages, parse_sse_lines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

REPLY = "Hello there, friend."
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply=REPLY)


client_for = app_client


def sse(resp: httpx.Response) -> list[tuple[str | None, str]]:
    """(id, data) per event of a complete (buffered) SSE response."""
    assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
    return parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))


def chunks(events: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    """The JSON chunks of a plain stream that ended with [DONE], after checking it has no `id:` lines (as OpenAI's)"""
    assert [eid for eid, _ in events] == [None] * len(events), events
    assert events[-1][1] == "[DONE]", events[-1]
    return [json.loads(data) for _, data in events[:-1]]


async def wait_for(predicate: Any) -> None:
    """Yield to the event loop until predicate() holds (bounded by the test's timeout, not asserted on)."""
    while not predicate():
        await asyncio.sleep(0.001)


# ---- bad bodies: 400 in OpenAI's shape, naming the field -------------------------------------------
@pytest.mark.parametrize(("body", "param", "contains"), [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", None),
    ({**CHAT, "temperature": "0.5"}, "temperature", None),
    ({**CHAT, "temperature": 3.0}, "temperature", None),
    ({**CHAT, "n": 0}, "n", None),
    ({**CHAT, "n": 99}, "n", "at most"),
    ({**CHAT, "stop": ["a"] * 40}, "stop", "stop sequences"),
    ({**CHAT, "stop": [""]}, "stop", "must not be empty"),
    ({**CHAT, "top_k": 2**40}, "top_k", None),
    ({**CHAT, "min_tokens": 300}, "min_tokens", "room left"),
    ({**CHAT, "logit_bias": {"1": 101.0}}, "logit_bias", "logit_bias"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}] * 40}, "messages", "at most 32 messages"),
])
async def test_bad_chat_bodies_name_the_field(engine, body, param, contains) -> None:
    async with client_for(engine, max_messages=32) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert_error(resp, 400, param=param, contains=contains)
    assert engine.requests == []  # refused before any engine work


@pytest.mark.parametrize(("content", "contains"), [
    (b"", "empty"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe", "UTF-8"),
])
async def test_unreadable_bodies_are_400(engine, content, contains) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert_error(resp, 400, param=None, code=None, contains=contains)


async def test_prompt_errors_come_from_the_input_processor_with_its_param_and_code(engine) -> None:
    long_text = "word " * 400  # far beyond max_model_len=256
    async with client_for(engine) as client:
        chat_long = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
        chat_budget = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 250})
        chat_budget_new = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 250})
        empty = await client.post("/v1/completions", json={"prompt": ""})
        vocab = await client.post("/v1/completions", json={"prompt": [1, 2, 10**7]})
        cmpl_long = await client.post("/v1/completions", json={"prompt": long_text})
    assert_error(chat_long, 400, param="messages", code="context_length_exceeded",
                 contains="maximum context length is 256 tokens")
    assert_error(chat_budget, 400, param="max_tokens", code="context_length_exceeded", contains="250 for the completion")
    assert_error(chat_budget_new, 400, param="max_tokens", code="context_length_exceeded")
    assert_error(empty, 400, param="prompt", contains="the prompt is empty")
    assert_error(vocab, 400, param="prompt", contains="outside the vocabulary")
    assert_error(cmpl_long, 400, param="prompt", code="context_length_exceeded")
    assert engine.requests == []


async def test_implicit_max_tokens_is_capped_to_the_room_left(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    (req,) = engine.requests
    assert req.params.max_tokens == engine.max_model_len - req.prompt.num_tokens


async def test_request_id_header_is_checked_and_echoed(engine) -> None:
    async with client_for(engine) as client:
        bad = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "has space"})
        long = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "x" * 500})
        ok = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "my-id-1"})
    assert_error(bad, 400, param="X-Request-Id")
    assert_error(long, 400, param="X-Request-Id")
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "my-id-1"
    assert ok.json()["id"] == "chatcmpl-my-id-1"


async def test_body_over_the_limit_is_413(engine) -> None:
    async with client_for(engine, max_body_bytes=1024) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 4096}]})
    assert_error(resp, 413, code="body_too_large")


async def test_unknown_model_is_404_naming_model(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
        models = await client.get("/v1/models")
    assert_error(resp, 404, param="model", code="model_not_found", contains="fake-model")
    assert [m["id"] for m in models.json()["data"]] == ["fake-model"]
    assert models.json()["data"][0]["max_model_len"] == 256


async def test_served_model_name_overrides_the_engines(engine) -> None:
    async with client_for(engine, served_model_name="alias") as client:
        models = await client.get("/v1/models")
        ok = await client.post("/v1/chat/completions", json={**CHAT, "model": "alias"})
    assert models.json()["data"][0]["id"] == "alias"
    assert ok.status_code == 200 and ok.json()["model"] == "alias"


# ---- routing and auth ------------------------------------------------------------------------------
async def test_unknown_route_is_404_and_wrong_method_is_405_in_openai_shape(engine) -> None:
    async with client_for(engine) as client:
        missing = await client.get("/v1/nothing-here")
        wrong = await client.get("/v1/chat/completions")
    assert_error(missing, 404, contains="no route for GET /v1/nothing-here")
    assert_error(wrong, 405, contains="method GET is not allowed on /v1/chat/completions")


async def test_api_key_guards_the_api_but_not_health(engine) -> None:
    async with client_for(engine, api_key="sekrit") as client:
        none = await client.post("/v1/chat/completions", json=CHAT)
        wrong = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
        scheme = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Basic sekrit"})
        debug = await client.get("/debug/cache")
        health = await client.get("/health")
        ok = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekrit"})
        metrics = await client.get("/metrics")
    for resp in (none, wrong, scheme, debug):
        assert_error(resp, 401, code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ok.status_code == 200, ok.text
    assert 'chatserve:http_errors_total{model_name="fake-model",status="401"} 4.0' in metrics.text


# ---- replies: non-streaming and SSE ---------------------------------------------------------------
async def test_chat_reply_shape_usage_and_n(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "logprobs": True, "top_logprobs": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert c["message"] == {"role": "assistant", "content": REPLY, "refusal": None}
        assert c["finish_reason"] == "stop"
        *reply, end = c["logprobs"]["content"]  # the end token is generated too, with its logprob
        assert "".join(t["token"] for t in reply) == REPLY and end["token"] == "<|im_end|>"
    n_reply = len(engine.reply_ids) + 1
    (req,) = engine.requests
    assert body["usage"] == {"prompt_tokens": req.prompt.num_tokens, "completion_tokens": 2 * n_reply,
                             "total_tokens": req.prompt.num_tokens + 2 * n_reply,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             # our extension, always there (the first request: nothing was cached)
                             "chatserve": {"matched_tokens": 0, "miss_reason": "new", "diverged_at": None,
                                           "lease_hit": False, "session_history_matched": None,
                                           "tiers": {"memory": 0, "disk": 0, "redis": 0, "tier_miss_reason": None}}}


async def test_chat_stream_framing_without_and_with_usage(engine) -> None:
    async with client_for(engine) as client:
        plain = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        with_usage = await client.post("/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert plain.status_code == 200 and plain.headers["cache-control"] == "no-cache"
    got = chunks(sse(plain))
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in got)
    assert got[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got) == REPLY
    assert got[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert len({c["id"] for c in got}) == 1

    got = chunks(sse(with_usage))
    *body, last = got
    assert all(c["usage"] is None for c in body)
    n_reply = len(engine.reply_ids) + 1  # (and the end token)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n_reply
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + n_reply


async def test_completions_echo_several_prompts_and_length(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/completions", json={"prompt": ["One", "Two"], "echo": True, "max_tokens": 2},
                                 headers={"X-Request-Id": "c1"})
        streamed = await client.post("/v1/completions", json={"prompt": "One", "echo": True, "max_tokens": 2,
                                                               "stream": True, "logprobs": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion"
    head = engine.tokenizer.decode(engine.reply_ids[:2])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "One" + head, "length"), (1, "Two" + head, "length")]
    assert body["usage"]["completion_tokens"] == 4
    assert body["id"] == "cmpl-c1"
    assert [r.request_id for r in engine.requests[:2]] == ["c1-0", "c1-1"]  # one engine request per prompt

    got = chunks(sse(streamed))
    assert got[0]["choices"] == [{"index": 0, "text": "One", "logprobs": None, "finish_reason": None}]
    assert "".join(c["choices"][0]["text"] for c in got) == "One" + head
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in got[1:]]
    assert offsets == [3, 3 + len(engine.tokenizer.decode(engine.reply_ids[:1]))]


async def test_prompts_times_n_is_limited(engine) -> None:
    async with client_for(engine, max_n=4) as client:
        resp = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
    assert_error(resp, 400, param="prompt", contains="prompts x n")


# ---- engine state ---------------------------------------------------------------------------------
async def test_dead_engine_is_503_and_unhealthy(engine) -> None:
    engine.kill()
    async with client_for(engine) as client:
        health = await client.get("/health")
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert_error(resp, 503, code="engine_dead")


async def test_engine_dying_mid_stream_ends_with_an_error_event(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True)
    async with client_for(engine) as client:
        task = asyncio.ensure_future(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
        await wait_for(lambda: engine.requests and engine.requests[0].num_sent == 1)
        engine.kill()
        resp = await task
    events = sse(resp)
    assert "[DONE]" not in [data for _, data in events]
    assert json.loads(events[-1][1])["error"]["code"] == "engine_dead"


async def test_full_queue_sheds_load_with_503_and_retry_after(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True, max_num_seqs=1)
    async with client_for(engine, max_queue_len=1, retry_after_s=7) as client:
        running = [asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
        await wait_for(lambda: engine.num_live_requests == 2)
        shed = await client.post("/v1/chat/completions", json=CHAT)
        engine.release()
        done = await asyncio.gather(*running)
    assert_error(shed, 503, code="queue_full")
    assert shed.headers["retry-after"] == "7"
    assert [r.status_code for r in done] == [200, 200]


# ---- the cancel endpoint --------------------------------------------------------------------------
async def test_cancel_of_unknown_id_is_404_naming_request_id(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/requests/nope/cancel")
    assert_error(resp, 404, param="request_id", code="request_not_found")


async def test_cancel_a_running_request_then_again_and_a_finished_one(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True)
    async with client_for(engine) as client:
        task = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r1"}))
        await wait_for(lambda: engine.requests and engine.requests[0].num_sent == 1)
        cancelled = await client.post("/v1/requests/r1/cancel")
        reply = await task
        again = await client.delete("/v1/requests/r1")
        engine.release()
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r2"})
        finished = await client.post("/v1/requests/r2/cancel")
        metrics = await client.get("/metrics")
    state = cancelled.json()
    assert cancelled.status_code == 200
    held = engine.requests[0].prompt.num_tokens + 1  # the prompt and the first token, in whole blocks
    assert state == {"id": "r1", "object": "request.state", "status": "aborted", "finish_reason": "abort",
                     "state_when_cancelled": "decoding", "completion_tokens": 1, "cached_prompt_tokens": 0,
                     "blocks_freed": -(-held // engine.block_size)}
    assert again.status_code == 200 and again.json() == state  # idempotent: the final state from history
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "abort"
    assert reply.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(engine.reply_ids[:1])
    assert finished.json()["status"] == "finished" and finished.json()["finish_reason"] == "stop"
    assert 'chatserve:request_aborts_total{model_name="fake-model",reason="cancel_endpoint"} 1.0' in metrics.text


async def test_duplicate_running_request_id_is_409(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True)
    async with client_for(engine) as client:
        task = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"}))
        await wait_for(lambda: engine.num_live_requests == 1)
        dup = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"})
        engine.release()
        first = await task
    assert_error(dup, 409, param="X-Request-Id", code="duplicate_request_id")
    assert first.status_code == 200


async def test_debug_cache_reports_stats(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.get("/debug/cache")
    assert resp.status_code == 200 and resp.json()["ok"] is True
    assert resp.json()["live_requests"] == 0


# ---- sessions -------------------------------------------------------------------------------------
async def test_session_api_is_absent_without_a_store(engine) -> None:
    async with client_for(engine) as client:
        resp = await client.post("/v1/sessions", json={})
    assert_error(resp, 404, contains="no route")


async def test_session_turns_extend_the_exact_token_history(engine) -> None:
    store = InMemorySessionStore()
    async with client_for(engine, store) as client:
        created = await client.post("/v1/sessions", json={"system_prompt": "Be brief.", "defaults": {"max_tokens": 3}})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        first = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "stream": False})
        second = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "More"})
        got = await client.get(f"/v1/sessions/{sid}")
        listed = await client.get("/v1/sessions")
        deleted = await client.delete(f"/v1/sessions/{sid}")
        gone = await client.get(f"/v1/sessions/{sid}")
    assert first.status_code == 200, first.text
    assert first.json()["session_id"] == sid and first.headers["x-session-id"] == sid
    assert first.json()["choices"][0]["finish_reason"] == "length"  # the session default max_tokens=3
    turn1, turn2 = engine.requests
    history = turn1.prompt.prompt_token_ids + engine.reply_ids[:3]
    assert turn2.prompt.prompt_token_ids[: len(history)] == history
    streamed = chunks(sse(second))
    assert streamed[-1]["usage"]["completion_tokens"] == 3  # sessions stream usage by default
    assert [m["role"] for m in got.json()["messages"]] == ["user", "assistant", "user", "assistant"]
    assert listed.json()["data"][0]["id"] == sid
    assert deleted.json() == {"id": sid, "object": "session.deleted", "deleted": True}
    assert_error(gone, 404, param="session_id", code="session_not_found")


async def test_session_bad_requests_name_the_field(engine) -> None:
    store = InMemorySessionStore()
    async with client_for(engine, store, max_stop_sequences=2) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        n2 = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "n": 2})
        empty = await client.post(f"/v1/sessions/{sid}/messages", json={"content": ""})
        long = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "word " * 400})
        budget = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 250})
        missing = await client.post("/v1/sessions/nope/messages", json={"content": "Hi"})
        stops = await client.post("/v1/sessions", json={"defaults": {"stop": ["a", "b", "c"]}})
        limit = await client.get("/v1/sessions?limit=x")
        limit_range = await client.get("/v1/sessions?limit=1000")
        after = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "stream": False})
    assert_error(n2, 400, param="n")
    assert_error(empty, 400, param="content")
    assert_error(long, 400, param="content", code="context_length_exceeded")
    assert_error(budget, 400, param="max_tokens", code="context_length_exceeded")
    assert_error(missing, 404, param="session_id", code="session_not_found")
    assert_error(stops, 400, param="defaults.stop")
    assert_error(limit, 400, param="limit")
    assert_error(limit_range, 400, param="limit")
    assert after.status_code == 200, after.text  # a refused turn released the session's lock


class _FailingAppendStore(InMemorySessionStore):
    """Everything works except writing a turn (a store outage at the worst moment)."""

    async def append_turn(self, *args: Any, **kwargs: Any) -> Any:
        raise SessionStoreUnavailable("the store went away")


async def test_turn_that_cannot_be_stored_ends_the_stream_with_an_error_event(engine) -> None:
    async with client_for(engine, _FailingAppendStore()) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        streamed = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi"})
        plain = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "stream": False})
    events = sse(streamed)
    assert [eid for eid, _ in events] == [None] * len(events)
    assert "[DONE]" not in [data for _, data in events]
    assert json.loads(events[-1][1])["error"]["code"] == "session_store_unavailable"
    assert_error(plain, 503, code="session_store_unavailable")  # the lock was released: not 409


# ---- null means the default, on every body -------------------------------------------------------
async def test_null_for_every_optional_field_means_its_default(engine) -> None:
    chat_nulls = {k: None for k in (
        "model", "temperature", "top_p", "n", "stream", "stream_options", "stop", "max_tokens", "presence_penalty",
        "frequency_penalty", "seed", "user", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
        "skip_special_tokens", "stop_token_ids", "include_stop_str_in_output", "max_completion_tokens", "logprobs",
        "top_logprobs", "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice", "functions",
        "response_format", "logit_bias", "guided_json", "structured_outputs", "continue_final_message")}
    cmpl_nulls = {k: None for k in ("n", "stream", "max_tokens", "logprobs", "echo", "suffix", "best_of", "stop",
                                    "temperature", "seed", "stream_options", "guided_regex")}
    store = InMemorySessionStore()
    async with client_for(engine, store) as client:
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": None}],
            **chat_nulls})
        cmpl = await client.post("/v1/completions", json={"prompt": "Hi", **cmpl_nulls})
        created = await client.post("/v1/sessions", json={"system_prompt": None, "metadata": None, "ttl_seconds": None,
                                                          "defaults": {"temperature": None, "stop": None}})
        sid = created.json()["id"]
        turn = await client.post(f"/v1/sessions/{sid}/messages", json={
            "content": "Hi", "stream": None, "n": None, "logprobs": None, "max_tokens": None, "stream_options": None})
    assert chat.status_code == 200, chat.text
    assert chat.headers["content-type"].startswith("application/json")  # stream: null is not a stream
    assert [c["index"] for c in chat.json()["choices"]] == [0]  # n: null is 1
    assert "logprobs" not in chat.json()["choices"][0] or chat.json()["choices"][0]["logprobs"] is None
    assert cmpl.status_code == 200, cmpl.text
    assert created.status_code == 201, created.text
    assert turn.status_code == 200, turn.text
    assert turn.headers["content-type"].startswith("text/event-stream")  # a session turn streams by default
    chat_req, cmpl_req, turn_req = engine.requests
    assert (chat_req.params.n, chat_req.params.temperature, chat_req.params.logprobs) == (1, 1.0, None)
    assert cmpl_req.params.max_tokens == 16  # OpenAI's default for completions, also when sent as null
    assert turn_req.params.logprobs is None


# ---- known but unsupported fields: a 400 naming the field, never silently ignored ----------------
# (tools, tool_choice, response_format, structured_outputs and guided_* are served: tests/tools/test_tools.py)
REFUSED = [
    ("/v1/chat/completions", "guided_whitespace_pattern", r"\s*"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "required"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("session", "chat_template_kwargs", {"enable_thinking": True}),
    ("session", "chat_template", "{{ messages }}"),
    # served by chat and completions, not by a session turn (its prompt is its stored history)
    ("session", "continue_final_message", True),
    ("session", "truncate_prompt_tokens", 3),
    ("session", "return_tokens_as_token_ids", True),
    ("session", "prompt_logprobs", 1),
]


@pytest.mark.parametrize(("route", "name", "value"), REFUSED, ids=[f"{r.split('/')[-1]}-{n}" for r, n, _ in REFUSED])
async def test_known_unsupported_fields_are_refused_by_name(engine, route, name, value) -> None:
    store = InMemorySessionStore()
    async with client_for(engine, store) as client:
        if route == "session":
            sid = (await client.post("/v1/sessions", json={})).json()["id"]
            resp = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", name: value})
        else:
            base = CHAT if route == "/v1/chat/completions" else {"prompt": "Hi"}
            resp = await client.post(route, json={**base, name: value})
    err = assert_error(resp, 400, param=name, code="unsupported_field", contains="not support")
    assert name in err["message"]
    assert engine.requests == []


async def test_neutral_values_of_refused_fields_are_accepted(engine) -> None:
    neutral = {"tools": [], "tool_choice": "auto", "functions": [], "response_format": {"type": "text"},
               "structured_outputs": {"json": None, "regex": None}, "continue_final_message": False,
               "logit_bias": {}, "use_beam_search": False, "length_penalty": 1.0, "modalities": ["text"],
               "echo": False, "bad_words": [],
               # ignored on purpose (README lists them): they do not change the reply
               "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True, "service_tier": "auto",
               "prompt_cache_key": "x", "some_vendor_field": 1}
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, **neutral})
        tool_none = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})
    assert resp.status_code == 200, resp.text
    assert tool_none.status_code == 200, tool_none.text


# ---- non-text content parts -----------------------------------------------------------------------
@pytest.mark.parametrize(("part", "medium"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image input"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio input"),
    ({"type": "file", "file": {"file_id": "f"}}, "file input"),
])
async def test_non_text_content_part_is_a_clear_400(engine, part, medium) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": messages})
    err = assert_error(resp, 400, param="messages.1.content.1", code="unsupported_content")
    assert f"{medium} is not supported by this model" in err["message"], err
    assert "Input should be" not in err["message"]  # not pydantic's dump of the union it failed
    assert engine.requests == []


async def test_text_content_parts_still_work_and_bad_ones_name_the_part(engine) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    async with client_for(engine) as client:
        ok = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
        bad = await client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": None}]}]})
    assert ok.status_code == 200, ok.text
    assert "Hello there" in engine.tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)
    err = assert_error(bad, 400, param="messages.0.content.0")
    assert "Input should be" not in err["message"]


# ---- chat_template_kwargs reach the template ------------------------------------------------------
async def test_chat_template_kwargs_are_template_variables(smollm_tokenizer) -> None:
    import copy

    tokenizer = copy.deepcopy(smollm_tokenizer)
    tokenizer.chat_template = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
                               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    engine = FakeEngine(tokenizer, reply=REPLY)
    async with client_for(engine) as client:
        plain = await client.post("/v1/chat/completions", json=CHAT)
        greeted = await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"greeting": "HEY"}})
        reserved = await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert plain.status_code == 200 and greeted.status_code == 200, (plain.text, greeted.text)
    prompts = [tokenizer.decode(r.prompt.prompt_token_ids) for r in engine.requests]
    assert prompts == ["user: Hi\n", "[HEY]user: Hi\n"]
    assert_error(reserved, 400, param="chat_template_kwargs", contains="tokenize")


# ---- keepalives that the SDK's own SSE decoder reads as nothing -----------------------------------
async def _drive_stream(app: Any, path: str, body: dict[str, Any], until: Any) -> tuple[list[bytes], asyncio.Task]:
    """Run one POST through the ASGI app directly, collecting body pieces as they are sent (ASGITransport
    only hands over a finished response); returns once until(pieces) holds, with the app still running."""
    pieces: list[bytes] = []
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            pieces.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
             "server": ("test", 80), "client": ("127.0.0.1", 1234)}
    task = asyncio.get_running_loop().create_task(app(scope, receive, send))
    await wait_for(lambda: until(pieces) or task.done())
    return pieces, task


@pytest.mark.parametrize("route", ["chat", "completions", "session", "resumable"])
async def test_keepalives_between_events_do_not_become_events_for_the_sdk(smollm_tokenizer, route) -> None:
    from openai._streaming import SSEDecoder

    engine = FakeEngine(smollm_tokenizer, reply=REPLY, hold=True)  # one token, then wait for release()
    store = InMemorySessionStore()
    app = create_app(engine, store, ServerSettings(serve_web=False, sse_keepalive_s=0.005))
    path, body = {"chat": ("/v1/chat/completions", {**CHAT, "stream": True}),
                  "completions": ("/v1/completions", {"prompt": "Hi", "stream": True}),
                  "session": ("/v1/sessions/{sid}/messages", {"content": "Hi"}),
                  "resumable": ("/v1/chat/completions",
                                {**CHAT, "stream": True, "stream_options": {"resumable": True}})}[route]
    if route == "session":
        sid = (await store.create(system_prompt=None, metadata={}, ttl_seconds=None, defaults={},
                                  model=engine.model_name)).id
        path = path.format(sid=sid)

    def keepalives_after_the_first_event(pieces: list[bytes]) -> int:
        lines = b"".join(pieces).decode().split("\r\n")
        first = next((i for i, line in enumerate(lines) if line.startswith("data:")), len(lines))
        return sum(line.startswith(":") for line in lines[first:])

    pieces, task = await _drive_stream(app, path, body, lambda p: keepalives_after_the_first_event(p) >= 3)
    engine.release()
    await task
    assert keepalives_after_the_first_event(pieces) >= 3  # the held reply sat between events meanwhile
    raw = b"".join(pieces)
    lines = raw.decode().split("\r\n")
    events = list(SSEDecoder().iter_bytes(iter(pieces)))
    assert events and events[-1].data == "[DONE]", events
    for ev in events[:-1]:
        json.loads(ev.data)  # what the SDK does with every event: an empty one was the bug
    assert len(events) == len([line for line in lines if line.startswith("data:")])
    if route == "resumable":  # numbered: every event has its sequence number, what Last-Event-ID sends back
        assert [ev.id for ev in events] == [str(i) for i in range(len(events))]
        # (lines[-1] is the empty rest after the stream's last CRLF, not a blank line: a keepalive may be
        # the last thing written after [DONE], which a loaded host sometimes does)
        assert not any(line == "" and prev.startswith(":") for prev, line in zip(lines, lines[1:-1]))
        return
    # A plain stream is framed as OpenAI frames it: no ids, every message one data line, keepalives
    # whole messages of their own, so a reader that splits at blank lines (vLLM's client) reads it too.
    assert all(ev.id is None for ev in events)
    assert blank_line_messages(raw.decode()) == [ev.data for ev in events]
