"""Real OpenAI clients, unchanged, against a live `chatserve serve`: the contract our users run.

The official `openai` SDK (sync and async), `openai-agents`, `langchain-openai`, `pydantic-ai`
and `litellm`, each pointed at one shared server that sends a keepalive every
`KEEPALIVE_S`. What is asserted is what a user of each library sees: the streamed text equals
the non-streamed text of the same greedy request, finish reasons and usage are honest, nothing
raises. Every stream test includes one stream long enough to carry at least three keepalives
between its events (counted on the raw bytes under the client, by `helpers.sse_tap`): that is
what broke the SDK's SSE decoder, which turned the blank line after a keepalive into an empty
event and json-parsed it. After each test the server must be idle with every KV block back in
the free list or the prefix cache (`GET /debug/cache` checks the invariants).

Versions are pinned in pyproject.toml's dev extras; nothing here touches the network.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.net import HTTP, wait_until
from tests.helpers.server import ServerProcess, start_server
from tests.helpers.sse_tap import AsyncTapTransport, SSETap, TapTransport
from tests.helpers.streams import cancel_agent_stream_after

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "compat-key"
KEEPALIVE_S = 0.02
# A reply long enough to span many keepalive intervals on any machine this runs on (each test
# checks that it did, on the raw bytes, rather than trusting a time). Greedy and ignore_eos, so
# its length and text are fixed.
LONG_TOKENS = 64
SHORT_TOKENS = 8
MIN_KEEPALIVES = 3
IGNORE_EOS = {"ignore_eos": True}
LONG_PROMPT = "Tell me a long story about a lighthouse keeper."
CHAT_LONG = [{"role": "user", "content": LONG_PROMPT}]
TEXT_PROMPT = "Once upon a time, in a small village by the sea,"

pytestmark = pytest.mark.timeout(300)


# ---- the shared server and clients ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    srv = start_server("--sse-keepalive-s", str(KEEPALIVE_S), "--max-model-len", "1024", "--max-num-seqs", "8",
                       api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def tap() -> SSETap:
    return SSETap()


@pytest.fixture(scope="module")
def client(server: ServerProcess, tap: SSETap) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(transport=TapTransport(tap)))


def async_client(server: ServerProcess, tap: SSETap) -> openai.AsyncOpenAI:
    """A fresh one per event loop (each test runs its own with asyncio.run)."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                              http_client=openai.DefaultAsyncHttpxClient(transport=AsyncTapTransport(tap)))


@pytest.fixture(autouse=True)
def server_idle_after(request):
    """After every test: nothing runs or waits, the cache invariants hold, no block is held by a request."""
    yield
    if "server" not in request.fixturenames:
        return
    srv: ServerProcess = request.getfixturevalue("server")
    assert_idle(srv)


def assert_idle(srv: ServerProcess) -> None:
    def settled() -> dict[str, Any] | None:
        m = srv.metrics()
        if m["chatserve:num_requests_running"] or m["chatserve:num_requests_waiting"]:
            return None
        r = HTTP.get(f"{srv.url}/debug/cache", headers=srv.headers, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        stats = body["stats"]
        if body["live_requests"] or stats["num_live_requests"] or stats["num_running"] or stats["num_waiting"]:
            return None
        return {"metrics": m, "stats": stats}

    seen = wait_until(settled, timeout=20, what="the server to be idle")
    stats = seen["stats"]
    # Every block is free or in the prefix cache, none locked by a request.
    assert stats["num_locked_blocks"] == 0, stats
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"], stats
    assert seen["metrics"]["chatserve:kv_cache_usage_perc"] == 0


def aborts(srv: ServerProcess, reason: str) -> float:
    return srv.metrics().get(f'chatserve:request_aborts_total{{model_name="{MODEL}",reason="{reason}"}}', 0.0)


def assert_long(tap: SSETap, mark: int) -> None:
    """The one stream since `mark` carried keepalives between its events: the case that broke parsers."""
    streams = tap.since(mark)
    assert streams, "no SSE stream went through the tapped client"
    most = max(s.keepalives_between_events for s in streams)
    assert most >= MIN_KEEPALIVES, (
        f"the long stream carried only {most} keepalives between events; make LONG_TOKENS larger so the test "
        f"checks what it is meant to")


# ---- greedy references, computed once through plain HTTP -------------------------------------------
_refs: dict[tuple, dict[str, Any]] = {}


def chat_reference(srv: ServerProcess, messages: list[dict[str, Any]], max_tokens: int,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The non-streamed greedy reply, asked twice: the first puts the prompt and the reply in the prefix cache,
    so the second and every later identical request take the same numeric path (bf16 logits of a cold
    prefill and of a prefix-cache hit, whole or of a partial block, can differ in the last bits)."""
    key = ("chat", repr(messages), max_tokens, repr(extra))
    if key not in _refs:
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **(extra or {})}
        post(srv, "/v1/chat/completions", body)
        _refs[key] = post(srv, "/v1/chat/completions", body)
    return _refs[key]


def completion_reference(srv: ServerProcess, prompt: str, max_tokens: int) -> dict[str, Any]:
    key = ("text", prompt, max_tokens)
    if key not in _refs:
        body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, **IGNORE_EOS}
        post(srv, "/v1/completions", body)  # warms the cache, as in chat_reference
        _refs[key] = post(srv, "/v1/completions", body)
    return _refs[key]


def post(srv: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = HTTP.post(f"{srv.url}{path}", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def long_chat_reference(srv: ServerProcess) -> dict[str, Any]:
    return chat_reference(srv, CHAT_LONG, LONG_TOKENS, IGNORE_EOS)


# ---- the openai SDK: sync ----------------------------------------------------------------------------
def test_openai_sync_chat_stream_with_usage_survives_keepalives(server, client, tap):
    ref = long_chat_reference(server)
    assert ref["usage"]["completion_tokens"] == LONG_TOKENS
    full = client.chat.completions.create(model=MODEL, messages=CHAT_LONG, max_tokens=LONG_TOKENS, temperature=0,
                                          extra_body=IGNORE_EOS)
    assert full.choices[0].message.content == ref["choices"][0]["message"]["content"]
    assert full.choices[0].finish_reason == "length"

    mark = tap.mark()
    stream = client.chat.completions.create(model=MODEL, messages=CHAT_LONG, max_tokens=LONG_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert_long(tap, mark)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, LONG_TOKENS, full.usage.prompt_tokens + LONG_TOKENS)


def test_openai_sync_completions_stream_with_usage_survives_keepalives(server, client, tap):
    ref = completion_reference(server, TEXT_PROMPT, LONG_TOKENS)
    full = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=LONG_TOKENS, temperature=0,
                                     extra_body=IGNORE_EOS)
    assert full.choices[0].text == ref["choices"][0]["text"] and full.choices[0].finish_reason == "length"
    mark = tap.mark()
    stream = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=LONG_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert_long(tap, mark)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == LONG_TOKENS
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_openai_with_raw_response_headers(server, client, tap):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=SHORT_TOKENS, temperature=0,
        extra_headers={"X-Request-Id": "compat-raw-1"})
    assert raw.http_response.status_code == 200
    assert raw.headers["x-request-id"] == "compat-raw-1"
    assert raw.headers["content-type"].startswith("application/json")
    parsed = raw.parse()
    assert parsed.id == "chatcmpl-compat-raw-1" and parsed.choices[0].message.content

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=SHORT_TOKENS, temperature=0,
        stream=True)
    rid = raw.headers["x-request-id"]  # the server's own id when the client sends none
    assert rid and raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert {c.id for c in chunks} == {f"chatcmpl-{rid}"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == parsed.choices[0].message.content


def test_openai_optional_settings_forwarded_as_none_mean_defaults(server, client, tap):
    # Code that passes its unset options through as None sends JSON nulls; they must mean "default".
    ref = long_chat_reference(server)["choices"][0]["message"]["content"]
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT_LONG, max_tokens=SHORT_TOKENS, temperature=0, extra_body=IGNORE_EOS,
        n=None, logprobs=None, top_logprobs=None, stop=None, seed=None, presence_penalty=None,
        frequency_penalty=None, top_p=None, user=None, stream_options=None, response_format=None, tools=None,
        tool_choice=None, logit_bias=None, max_completion_tokens=None)
    assert [c.index for c in r.choices] == [0] and r.choices[0].logprobs is None
    assert ref.startswith(r.choices[0].message.content) and r.usage.completion_tokens == SHORT_TOKENS
    c = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, temperature=0, max_tokens=None, n=None,
                                  logprobs=None, echo=None, suffix=None, best_of=None, stop=None, extra_body=IGNORE_EOS)
    assert c.usage.completion_tokens == 16  # max_tokens: null is OpenAI's default for completions


def test_openai_leaving_a_stream_early_aborts_the_request(server, client, tap):
    before = aborts(server, "client_disconnect")
    stream = client.chat.completions.create(model=MODEL, messages=CHAT_LONG, max_tokens=400, temperature=0,
                                            stream=True, extra_body=IGNORE_EOS,
                                            extra_headers={"X-Request-Id": "compat-leave-1"})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()
    assert_idle(server)
    assert aborts(server, "client_disconnect") == before + 1
    state = HTTP.post(f"{server.url}/v1/requests/compat-leave-1/cancel", headers=server.headers, timeout=30).json()
    assert state["finish_reason"] == "abort" and state["completion_tokens"] < 400


def test_openai_async_chat_and_completions_streams(server, tap):
    ref_chat = long_chat_reference(server)
    ref_text = completion_reference(server, TEXT_PROMPT, LONG_TOKENS)

    async def main() -> None:
        aclient = async_client(server, tap)
        async with aclient:
            ref = ref_chat["choices"][0]["message"]["content"]
            # Non-streamed, short: the greedy reply's first tokens (the long one is the sync test's).
            short = await aclient.chat.completions.create(model=MODEL, messages=CHAT_LONG, max_tokens=SHORT_TOKENS,
                                                          temperature=0, extra_body=IGNORE_EOS)
            assert ref.startswith(short.choices[0].message.content) and short.choices[0].finish_reason == "length"
            assert short.usage.completion_tokens == SHORT_TOKENS
            short_text = await aclient.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=SHORT_TOKENS,
                                                          temperature=0, extra_body=IGNORE_EOS)
            assert ref_text["choices"][0]["text"].startswith(short_text.choices[0].text)
            mark = tap.mark()
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=CHAT_LONG, max_tokens=LONG_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
            chunks = [c async for c in stream]
            assert_long(tap, mark)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
            assert chunks[-1].usage.completion_tokens == LONG_TOKENS
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
                ["length"]

            mark = tap.mark()
            stream = await aclient.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=LONG_TOKENS,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
            chunks = [c async for c in stream]
            assert_long(tap, mark)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text["choices"][0]["text"]
            assert chunks[-1].usage.completion_tokens == LONG_TOKENS

    asyncio.run(main())


def test_openai_async_cancel_from_a_second_task(server, tap):
    ref = long_chat_reference(server)["choices"][0]["message"]["content"]
    rid = "compat-cancel-1"

    async def main() -> None:
        aclient = async_client(server, tap)
        got: list[str] = []
        enough = asyncio.Event()

        async def consume() -> list[Any]:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=CHAT_LONG, max_tokens=400, temperature=0, stream=True,
                extra_body=IGNORE_EOS, extra_headers={"X-Request-Id": rid})
            chunks = []
            async for c in stream:
                chunks.append(c)
                if c.choices and c.choices[0].delta.content:
                    got.append(c.choices[0].delta.content)
                    if len(got) >= 3:
                        enough.set()
            return chunks

        async def cancel() -> dict[str, Any]:
            await enough.wait()
            async with httpx.AsyncClient(timeout=30) as h:
                r = await h.post(f"{server.url}/v1/requests/{rid}/cancel", headers=server.headers)
            assert r.status_code == 200, r.text
            return r.json()

        async with aclient:
            chunks, state = await asyncio.gather(consume(), cancel())
        # The consumer's stream ended normally (no exception) with the abort as its finish reason.
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["abort"]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert ref.startswith(text) or text.startswith(ref), (text, ref)
        assert state["id"] == rid and state["finish_reason"] == "abort" and 3 <= state["completion_tokens"] < 400

    asyncio.run(main())


# ---- openai-agents -----------------------------------------------------------------------------------
def _agent(server: ServerProcess, tap: SSETap, max_tokens: int):
    import agents
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel

    agents.set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client(server, tap))
    # include_usage: the SDK asks for the usage chunk only from api.openai.com unless told to
    settings = ModelSettings(temperature=0, max_tokens=max_tokens, extra_body=IGNORE_EOS, include_usage=True)
    return Agent(name="compat", instructions="You are a storyteller.", model=model, model_settings=settings)


AGENT_MESSAGES = [{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": LONG_PROMPT}]


def test_agents_run_and_run_streamed(server, tap):
    from agents import Runner
    from openai.types.responses import ResponseTextDeltaEvent

    ref = chat_reference(server, AGENT_MESSAGES, LONG_TOKENS, IGNORE_EOS)["choices"][0]["message"]["content"]

    async def main() -> None:
        result = await Runner.run(_agent(server, tap, LONG_TOKENS), LONG_PROMPT)
        assert result.final_output == ref
        assert result.context_wrapper.usage.output_tokens == LONG_TOKENS

        mark = tap.mark()
        streamed = Runner.run_streamed(_agent(server, tap, LONG_TOKENS), LONG_PROMPT)
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        assert_long(tap, mark)
        assert "".join(deltas) == ref
        assert streamed.is_complete and streamed.final_output == ref
        usage = streamed.context_wrapper.usage
        assert usage.output_tokens == LONG_TOKENS and usage.input_tokens > 0

    asyncio.run(main())


def test_agents_run_streamed_cancel(server, tap):
    from agents import Runner

    before = aborts(server, "client_disconnect")

    async def main() -> None:
        await cancel_agent_stream_after(Runner.run_streamed(_agent(server, tap, 400), LONG_PROMPT))

    asyncio.run(main())
    assert_idle(server)
    assert aborts(server, "client_disconnect") == before + 1


# ---- langchain-openai --------------------------------------------------------------------------------
def _chat_openai(server: ServerProcess, tap: SSETap, max_tokens: int):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0,
                      max_tokens=max_tokens, max_retries=0, timeout=120, stream_usage=True, extra_body=IGNORE_EOS,
                      http_client=openai.DefaultHttpxClient(transport=TapTransport(tap)),
                      http_async_client=openai.DefaultAsyncHttpxClient(transport=AsyncTapTransport(tap)))


def test_langchain_invoke_and_stream(server, tap):
    ref = long_chat_reference(server)
    llm = _chat_openai(server, tap, LONG_TOKENS)
    msg = llm.invoke(LONG_PROMPT)
    assert msg.content == ref["choices"][0]["message"]["content"]
    assert msg.response_metadata["finish_reason"] == "length"
    assert msg.usage_metadata["output_tokens"] == LONG_TOKENS

    mark = tap.mark()
    chunks = list(llm.stream(LONG_PROMPT))
    assert_long(tap, mark)
    assert "".join(c.content for c in chunks) == msg.content
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.response_metadata["finish_reason"] == "length"
    assert total.usage_metadata["output_tokens"] == LONG_TOKENS
    assert total.usage_metadata["input_tokens"] == msg.usage_metadata["input_tokens"]


def test_langchain_astream_early_break_aborts(server, tap):
    llm = _chat_openai(server, tap, 400)
    before = aborts(server, "client_disconnect")

    async def main() -> int:
        n = 0
        stream = llm.astream(LONG_PROMPT)
        async for chunk in stream:
            n += bool(chunk.content)
            if n >= 3:
                break
        await stream.aclose()
        return n

    assert asyncio.run(main()) == 3
    assert_idle(server)
    assert aborts(server, "client_disconnect") == before + 1


# ---- pydantic-ai -------------------------------------------------------------------------------------
def _pydantic_agent(server: ServerProcess, tap: SSETap):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=async_client(server, tap))
    return Agent(OpenAIChatModel(MODEL, provider=provider),
                 model_settings={"temperature": 0, "max_tokens": LONG_TOKENS, "extra_body": IGNORE_EOS})


def test_pydantic_ai_run_sync_and_run_stream(server, tap):
    ref = long_chat_reference(server)["choices"][0]["message"]["content"]
    result = _pydantic_agent(server, tap).run_sync(LONG_PROMPT)
    assert result.output == ref
    assert result.usage.output_tokens == LONG_TOKENS

    async def main() -> tuple[str, str, Any]:
        agent = _pydantic_agent(server, tap)
        async with agent.run_stream(LONG_PROMPT) as run:
            parts = [d async for d in run.stream_text(delta=True)]
            output = await run.get_output()
            return "".join(parts), output, run.usage

    mark = tap.mark()
    streamed, output, usage = asyncio.run(main())
    assert_long(tap, mark)
    assert streamed == ref and output == ref
    assert usage.output_tokens == LONG_TOKENS


# ---- litellm -----------------------------------------------------------------------------------------
def test_litellm_completion_and_stream(server, tap):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    ref = long_chat_reference(server)["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(transport=TapTransport(tap)))
    kwargs = dict(model=f"openai/{MODEL}", messages=CHAT_LONG, api_base=f"{server.url}/v1", api_key=API_KEY,
                  temperature=0, max_tokens=LONG_TOKENS, extra_body=IGNORE_EOS, client=client)
    full = litellm.completion(**kwargs)
    assert full.choices[0].message.content == ref and full.choices[0].finish_reason == "length"
    mark = tap.mark()
    chunks = list(litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert_long(tap, mark)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
