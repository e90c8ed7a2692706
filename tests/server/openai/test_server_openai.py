"""The OpenAI-compatible server, end to end: a real `chatserve serve` process, real HTTP clients.

The official `openai` SDK checks that clients written for OpenAI work unchanged; raw httpx checks
the SSE framing, every error case, the API key, cancellation in each state and disconnects.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.errors import assert_error
from tests.helpers.net import HTTP, wait_until
from tests.helpers.server import ServerProcess, start_server
from tests.helpers.streams import Stream, sse_events, stream_in_thread

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
# A system prompt of several hundred tokens, shared by requests that should hit the prefix cache.
LONG_SYSTEM = " ".join(
    f"Rule {i}: answer briefly, politely and truthfully, and never invent facts about topic {i}." for i in range(40)
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-body-bytes", "65536", "--max-model-len", "2048", api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: object = None, *, content: bytes | None = None,
         headers: dict | None = None, auth: bool = True) -> httpx.Response:
    h = dict(server.headers if auth else {})
    h.update(headers or {})
    if content is None:
        return HTTP.post(f"{server.url}{path}", json=body, headers=h, timeout=120)
    h.setdefault("content-type", "application/json")
    return HTTP.post(f"{server.url}{path}", content=content, headers=h, timeout=120)


# ---- the official SDK ------------------------------------------------------------------------------
def test_sdk_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0 or r.usage.prompt_tokens_details.cached_tokens >= 16


def test_sdk_chat_streaming_matches_non_streaming_and_reports_usage(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert len({c.id for c in chunks}) == 1


def test_sdk_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    s = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_sdk_cached_tokens_on_shared_system_prompt(client):
    def ask(q):
        return client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        )

    first = ask("What is rule 3 about?")
    second = ask("And what about rule 7?")
    assert first.usage.prompt_tokens > 400
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the whole shared system prompt, block-aligned (16-token blocks)
    assert cached >= first.usage.prompt_tokens - 40, (cached, first.usage.prompt_tokens)


def test_sdk_n_choices(client):
    # NOTE: bf16 logits of a cold prefill and of a prefix-cache hit differ in the last bits, which can flip
    # a sampled token; a warm-up request puts both compared requests on the same (cached) path.
    client.completions.create(model=MODEL, prompt="warm", max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}], max_tokens=1)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}],
                                       n=2, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens < 40  # the prompt is counted once, not once per choice
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}],
                                            n=2, max_tokens=6, temperature=1.0, seed=3, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in r.choices}  # same seed -> same samples


def test_sdk_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert "," in text, text
    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4, 5,", max_tokens=12, temperature=0,
                                        stop=[","])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text.split(",")[0]


def test_sdk_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a poem."}],
                                              max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content

    sample(10)  # warm the prefix cache: compared requests then take the same numeric path (see n_choices)
    a, b, c = sample(11), sample(11), sample(12)
    assert a == b
    assert a != c


def test_sdk_closing_stream_early_frees_the_request(client, server):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got >= 3:
                break
    stream.close()
    m = server.wait_idle(timeout=10)
    assert m["chatserve:kv_cache_usage_perc"] == 0
    aborts = server.metrics()['chatserve:request_aborts_total{model_name="%s",reason="client_disconnect"}' % MODEL]
    assert aborts >= 1


# ---- raw HTTP: framing ---------------------------------------------------------------------------
def test_sse_framing_no_ids_and_done(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "stream": True}
    with HTTP.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      headers={**server.headers, "X-Request-Id": "framing-1"}, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"] == "framing-1"
        events = sse_events(resp)
    assert events[-1][1] == "[DONE]"
    assert [i for i, _ in events] == [None] * len(events)  # a plain stream has no ids, as OpenAI's has none
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-framing-1" for c in chunks)
    assert "usage" not in chunks[0]  # only present when include_usage asks for it
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}


def test_keepalive_comments_while_waiting():
    # A server whose single slot is busy: the second request waits and gets keepalive comments.
    srv = start_server("--max-num-seqs", "1", "--sse-keepalive-s", "0.2", "--max-model-len", "1024")
    try:
        # 400 tokens keep the slot busy for seconds even where decode runs at ~170 tok/s (60 did not)
        slow = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 400, "temperature": 0,
                "stream": True, "ignore_eos": True}
        seen = threading.Event()

        def busy() -> None:  # holds the slot until the waiting request has seen a keepalive, then leaves
            with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json=slow, timeout=120) as r:
                for _ in r.iter_lines():
                    if seen.is_set():
                        return  # a disconnect: the server aborts it and the waiting request runs

        t = threading.Thread(target=busy)
        t.start()
        time.sleep(0.3)
        comments, data = 0, []
        with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json={**slow, "max_tokens": 2}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(":"):
                    comments += 1
                    seen.set()
                elif line.startswith("data:"):
                    data.append(line)
        t.join()
        assert comments >= 1 and data[-1] == "data: [DONE]"  # it waited, kept alive, then was served
    finally:
        assert srv.stop() == 0


# ---- raw HTTP: errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, contains",
    [
        (b'{"messages": [', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 1000}', "n must be at most"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"one": 2}}', "logit_bias"),
        (b'{"messages": [{"role": "user", "content": "x"}], "seed": 99999999999999999999999}', "seed"),
        (b'\xff\xfe{}', "UTF-8"),
        (b"", "empty"),
    ],
)
def test_bad_chat_bodies_are_400(server, content, contains):
    err = assert_error(post(server, "/v1/chat/completions", content=content), 400, contains=contains)
    assert err["type"] == "invalid_request_error"


def test_context_overflow_names_the_numbers(server):
    long = "word " * 2500
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}), 400)
    assert "2048" in err["message"] and err["code"] == "context_length_exceeded"
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2040}
    err = assert_error(post(server, "/v1/chat/completions", body), 400)
    assert "2048" in err["message"] and "2040" in err["message"]
    err = assert_error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4000}), 400, contains="4000")


def test_unknown_model_is_404(server):
    err = assert_error(post(server, "/v1/chat/completions",
                            {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404, contains="gpt-9")
    assert err["param"] == "model"


def test_api_key(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert_error(post(server, "/v1/chat/completions", body, auth=False), 401)
    assert_error(post(server, "/v1/chat/completions", body, auth=False, headers={"Authorization": "Bearer nope"}), 401)
    assert HTTP.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert HTTP.get(f"{server.url}/health", timeout=10).status_code == 200  # no key needed
    models = HTTP.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()
    assert models["data"][0]["id"] == MODEL


def test_body_over_limit_is_413(server):
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode()
    assert_error(post(server, "/v1/chat/completions", content=huge), 413)


def test_request_id_validation_and_echo(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert_error(post(server, "/v1/chat/completions", body, headers={"X-Request-Id": "a" * 129}), 400, contains="128")
    assert_error(post(server, "/v1/chat/completions", body, headers={"X-Request-Id": "bad id"}), 400)
    r = post(server, "/v1/chat/completions", body, headers={"X-Request-Id": "my-id.42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id.42" and r.json()["id"] == "chatcmpl-my-id.42"
    generated = post(server, "/v1/chat/completions", body)
    assert generated.headers["x-request-id"] and generated.json()["id"].endswith(generated.headers["x-request-id"])


def test_unknown_route_and_cancel_of_unknown_id_are_404_in_openai_shape(server):
    assert_error(HTTP.get(f"{server.url}/v1/nothing", headers=server.headers, timeout=10), 404)
    assert_error(post(server, "/v1/requests/never-seen/cancel"), 404)


def test_metrics_are_exposed_with_vllm_names(server):
    text = HTTP.get(f"{server.url}/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "request_aborts_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"chatserve:{name}" in text, name


# ---- cancellation in every state, disconnects, overload -------------------------------------------
@pytest.fixture(scope="module")
def small_server():
    """One running slot, a tiny token budget per step (long prefills span many steps), a short queue."""
    srv = start_server("--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-queue-len", "1",
                       "--max-model-len", "2048")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _stream(url: str, body: dict, rid: str) -> Stream:
    return stream_in_thread(url, "/v1/chat/completions", body, headers={"X-Request-Id": rid})


def test_cancel_in_waiting_prefilling_and_decoding_states(small_server):
    srv = small_server
    long_prompt = "Please summarise: " + "the quick brown fox jumps over the lazy dog " * 120  # ~1100 tokens
    decode_body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300,
                   "temperature": 0, "stream": True, "ignore_eos": True}
    prefill_body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 5, "stream": True}

    # decoding: a running request with tokens flowing
    a = _stream(srv.url, decode_body, "dec-1")
    wait_until(lambda: len(a.data) >= 3, 60, "decoding")  # role chunk + two tokens
    # waiting: the only slot is busy, so this one queues
    b = _stream(srv.url, prefill_body, "wait-1")
    wait_until(lambda: srv.gauge("num_requests_waiting") == 1, what="a waiting request")
    rb = post(srv, "/v1/requests/wait-1/cancel")
    assert rb.status_code == 200, rb.text
    sb = rb.json()
    assert sb["status"] == "aborted" and sb["state_when_cancelled"] == "waiting" and sb["completion_tokens"] == 0
    assert sb["blocks_freed"] == 0
    ra = HTTP.delete(f"{srv.url}/v1/requests/dec-1", timeout=30)
    assert ra.status_code == 200
    sa = ra.json()
    assert sa["status"] == "aborted" and sa["state_when_cancelled"] == "decoding" and sa["completion_tokens"] > 0
    assert sa["blocks_freed"] >= 1
    a.join(30)
    b.join(30)
    assert a.finish_reasons == b.finish_reasons == ["abort"]
    assert a.events[-1][1] == "[DONE]"

    # prefilling: a long prompt in 16-token chunks takes many steps
    c = _stream(srv.url, prefill_body, "pre-1")
    wait_until(lambda: _running(srv) == 1, what="a running request")
    rc = post(srv, "/v1/requests/pre-1/cancel").json()
    assert rc["state_when_cancelled"] == "prefilling" and rc["completion_tokens"] == 0 and rc["blocks_freed"] >= 1
    c.join(30)
    assert c.finish_reasons == ["abort"]

    # idempotent: cancelling again reports the same final state
    again = post(srv, "/v1/requests/pre-1/cancel").json()
    assert again == rc
    m = srv.wait_idle()
    assert m["chatserve:kv_cache_usage_perc"] == 0
    key = 'chatserve:request_aborts_total{model_name="%s",reason="cancel_endpoint"}' % MODEL
    assert srv.metrics()[key] >= 3
    assert HTTP.get(f"{srv.url}/debug/cache", timeout=30).json()["ok"] is True


def _running(srv: ServerProcess) -> float:
    return srv.gauge("num_requests_running")


def test_disconnect_mid_stream_aborts_within_a_step(small_server):
    srv = small_server
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n >= 5:
                break
    # The mechanism, not a time: the request is gone (no KV held, an abort counted for the
    # disconnect) long before its 500 tokens; wait_idle's bound only guards against a hang.
    srv.wait_idle(timeout=60)
    m = srv.metrics()
    assert m["chatserve:kv_cache_usage_perc"] == 0
    assert m['chatserve:request_aborts_total{model_name="%s",reason="client_disconnect"}' % MODEL] >= 1


def test_non_streaming_disconnect_aborts(small_server):
    srv = small_server
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{srv.url}/v1/chat/completions", json=body, timeout=1.0)
    srv.wait_idle(timeout=5)


def test_full_queue_sheds_load_with_503_and_retry_after(small_server):
    srv = small_server
    # (long enough that neither stream can finish before the third request arrives, on any tier: a
    # capped AVX2 run decoded 200 tokens before it did; both are cancelled below)
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    streams = [_stream(srv.url, body, f"q-{i}") for i in range(2)]
    # both in: one running, one waiting (waiting >= 1 alone was also true of the first stream before its
    # first step, which let the third request in ahead of the second on a loaded host)
    wait_until(lambda: srv.gauge("num_requests_running") >= 1 and srv.gauge("num_requests_waiting") >= 1,
               what="a running and a waiting request")
    r = post(srv, "/v1/chat/completions", body)
    err = assert_error(r, 503)
    assert r.headers["retry-after"] and err["code"] == "queue_full"
    for i in range(2):
        post(srv, f"/v1/requests/q-{i}/cancel")
    for st in streams:
        st.join(30)
    srv.wait_idle()
