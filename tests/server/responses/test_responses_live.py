"""The Responses API on a live `chatserve serve` (SmolLM2, Redis store), with the real SDKs.

One server for the module (Redis db 14, the module's own), short replies. What a fake engine
cannot show: a three-turn `previous_response_id` chain whose later turns are prefix-cache hits
over the whole earlier conversation, that chain continuing on a restarted server, the OpenAI
Agents SDK with its default model (the Responses one) answering, calling a tool and cancelling a
stream, cancel of a queued / running / finished response, and a background response resumed
after its client dropped with every remaining event exactly once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import redis

from tests.helpers.net import HTTP
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess
from tests.helpers.server import ServerProcess, start_server
from tests.helpers.streams import cancel_agent_stream_after, total_aborts

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the server's KV block size (the default)
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    """The module's server on a redis-server of its own (the last test kills it), else on the shared
    Redis's db 14."""
    rds = None
    if REDIS_SERVER is not None:
        rds = RedisProcess()
        rds.start()
        url = rds.url
    else:
        url = "redis://127.0.0.1:6379/14"
        redis.Redis.from_url(url).flushdb()
    args = ("--redis-url", url, "--max-model-len", "2048", "--max-num-seqs", "2")
    holder: dict[str, Any] = {"server": start_server(*args), "redis": rds, "url": url, "args": args}
    try:
        yield holder
    finally:
        holder["server"].stop()
        if rds is not None:
            rds.kill()
        else:
            redis.Redis.from_url(url).flushdb()


def client_of(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)


def test_three_turn_chain_hits_the_cache_and_survives_a_restart(server) -> None:
    srv: ServerProcess = server["server"]
    client = client_of(srv)
    first = client.responses.create(model=MODEL, instructions="You are a helpful assistant.",
                                    input="Name a colour.", max_output_tokens=12, temperature=0)
    assert first.status in ("completed", "incomplete") and first.usage is not None
    chain = [first]
    for text in ("Name another one.", "And one more."):
        prev = chain[-1]
        history = prev.usage.input_tokens + prev.usage.output_tokens
        nxt = client.responses.create(model=MODEL, instructions="You are a helpful assistant.", input=text,
                                      previous_response_id=prev.id, max_output_tokens=12, temperature=0)
        assert nxt.status in ("completed", "incomplete"), nxt
        assert nxt.usage.input_tokens > history
        assert nxt.usage.input_tokens_details.cached_tokens >= history - BLOCK, (nxt.usage, history)
        chain.append(nxt)
    # streamed, on the SDK's strict stream parser, then read back
    # (a reply cut at max_output_tokens ends with response.incomplete, which get_final_response() refuses)
    with client.responses.stream(model=MODEL, input="Say ok.", previous_response_id=chain[-1].id,
                                 max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    assert "".join(deltas) == streamed.output_text
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    items = client.responses.input_items.list(streamed.id)
    assert [i.content[0].text for i in items.data] == ["Say ok."]

    # a new server process on the same Redis continues the chain from the stored tokens
    srv.stop()
    srv = server["server"] = start_server(*server["args"])
    client = client_of(srv)
    assert client.responses.retrieve(chain[-1].id).output_text == chain[-1].output_text
    last = chain[-1]
    after = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=last.id,
                                    max_output_tokens=8, temperature=0)
    assert after.status in ("completed", "incomplete")
    assert after.usage.input_tokens > last.usage.input_tokens + last.usage.output_tokens
    # DELETE removes every key of it
    assert HTTP.delete(f"{srv.url}/v1/responses/{after.id}").status_code == 200
    assert not [k for k in redis.Redis.from_url(server["url"]).scan_iter(f"*{after.id}*")]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(after.id)


def test_cancel_queued_running_and_finished(server) -> None:
    srv: ServerProcess = server["server"]
    client = client_of(srv)
    finished = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.cancel(finished.id).status == finished.status  # as it was
    # --max-num-seqs 2: two long runs fill the engine, the third waits in the queue
    running = [client.responses.create(model=MODEL, input="Tell me a long story.", background=True,
                                       max_output_tokens=400, extra_body=IGNORE_EOS) for _ in range(2)]
    queued = client.responses.create(model=MODEL, input="Tell me a story.", background=True, max_output_tokens=400,
                                     extra_body=IGNORE_EOS)
    assert queued.status == "queued"
    for r in running:
        for _ in range(600):
            if client.responses.retrieve(r.id).status == "in_progress":
                break
            asyncio.run(asyncio.sleep(0.05))
    assert client.responses.retrieve(queued.id).status == "queued"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    for r in running:
        c = client.responses.cancel(r.id)
        assert c.status == "cancelled" and 0 < c.usage.output_tokens < 400
        assert client.responses.cancel(r.id).status == "cancelled"  # idempotent
    srv.wait_idle()


def _sse_events(lines: Any, limit: int | None = None) -> list[dict]:
    out: list[dict] = []
    for line in lines:
        if line.startswith("data: "):
            out.append(json.loads(line[len("data: "):]))
            if limit is not None and len(out) >= limit:
                break
    return out


def test_background_stream_resumed_after_a_drop(server) -> None:
    srv: ServerProcess = server["server"]
    # a reply that ends by itself (greedy, short), so its last event is response.completed
    body = {"model": MODEL, "input": "Count from one to ten.", "background": True, "stream": True,
            "max_output_tokens": 256, "temperature": 0}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{srv.url}/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            seen = _sse_events(resp.iter_lines(), limit=6)  # then the connection drops
    rid = seen[0]["response"]["id"]
    assert [e["sequence_number"] for e in seen] == list(range(6))
    client = client_of(srv)
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=seen[-1]["sequence_number"]))
    numbers = [e.sequence_number for e in rest]
    assert numbers == list(range(6, 6 + len(rest))), numbers  # no gap, no duplicate
    assert rest[-1].type == "response.completed"
    final = rest[-1].response
    text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta") + \
        "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == final.output_text and 0 < final.usage.output_tokens < 256
    assert client.responses.retrieve(rid).status == "completed"


def test_foreground_stream_dropped_is_stored_cancelled(server) -> None:
    srv: ServerProcess = server["server"]
    body = {"model": MODEL, "input": "Tell me a long story.", "stream": True, "max_output_tokens": 400, **IGNORE_EOS}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{srv.url}/v1/responses", json=body) as resp:
            seen = _sse_events(resp.iter_lines(), limit=6)
    rid = seen[0]["response"]["id"]
    client = client_of(srv)
    for _ in range(400):
        got = client.responses.retrieve(rid)
        if got.status != "in_progress":
            break
        asyncio.run(asyncio.sleep(0.05))
    assert got.status == "cancelled" and 0 < got.usage.output_tokens < 400, got
    srv.wait_idle()


CITIES = ("Paris", "Lyon", "Marseille")


class Capital(pydantic.BaseModel):
    city: Literal[CITIES]  # type: ignore[valid-type]


def test_agents_sdk_default_model_answers_calls_a_tool_and_cancels(server) -> None:
    import agents
    from agents import Agent, ModelSettings, Runner, function_tool

    srv: ServerProcess = server["server"]
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    async def main() -> None:
        agents.set_tracing_disabled(True)
        agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0,
                                                            timeout=300), use_for_tracing=False)
        agents.set_default_openai_api("responses")
        # a structured answer whose language is finite (an enum; JSON whitespace runs are bounded), so the
        # reply ends within max_tokens whatever the dtype makes of the question: a free-text reply of a
        # 135M model may ramble past any budget, which the SDK raises on (response.incomplete)
        plain = Agent(name="plain", instructions="Answer briefly.", model=MODEL, output_type=Capital,
                      model_settings=ModelSettings(temperature=0, max_tokens=64))
        answer = await Runner.run(plain, "What is the capital of France?")
        assert isinstance(answer.final_output, Capital) and answer.final_output.city in CITIES
        # the SDK's default model went through /v1/responses (a Chat Completions model has no response id)
        assert answer.raw_responses[0].response_id.startswith("resp_")
        tooled = Agent(name="weather", instructions="Answer weather questions with the tool.", model=MODEL,
                       tools=[get_weather],
                       model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120))
        result = await Runner.run(tooled, "What is the weather in Paris?", max_turns=4)
        assert seen and isinstance(result.final_output, str)
        await cancel_agent_stream_after(Runner.run_streamed(
            Agent(name="story", instructions="Tell stories.", model=MODEL,
                  model_settings=ModelSettings(max_tokens=300, extra_body=IGNORE_EOS)),
            "Tell me a long story about a lighthouse."))

    before = total_aborts(srv.metrics())
    asyncio.run(main())
    srv.wait_idle()
    # The cancel reached the server: the 300-token run was aborted, not left to finish.
    assert total_aborts(srv.metrics()) == before + 1


def test_redis_killed_mid_background_run(server) -> None:
    """The run goes on in memory (its reader here gets every event), the server stays up, what needs the
    store answers 503 with a log line saying what was lost, and everything works again once Redis is back."""
    rds: RedisProcess | None = server["redis"]
    if rds is None:
        pytest.skip("redis-server is not installed (the shared Redis is not ours to kill)")
    srv: ServerProcess = server["server"]
    body = {"model": MODEL, "input": "Tell me a long story.", "background": True, "stream": True,
            "max_output_tokens": 60, **IGNORE_EOS}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{srv.url}/v1/responses", json=body) as resp:
            lines = resp.iter_lines()
            first = _sse_events(lines, limit=8)
            rds.kill()
            rest = _sse_events(lines)
        events = first + rest
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        assert events[-1]["response"]["usage"]["output_tokens"] == 60
        rid = events[0]["response"]["id"]
        assert http.get(f"{srv.url}/health").status_code == 200
        got = http.get(f"{srv.url}/v1/responses/{rid}")
        assert got.status_code == 503 and got.json()["error"]["code"] == "response_store_unavailable", got.text
        new = http.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
        assert new.status_code == 503, new.text
        assert f"response {rid}: could not store its" in srv.log()
        rds.start()  # an empty Redis (no persistence): new responses are stored again
        new = http.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
        assert new.status_code == 200, new.text
        assert http.get(f"{srv.url}/v1/responses/{new.json()['id']}").status_code == 200
    srv.wait_idle()
