"""Reasoning in the session API and across turns with the prefix cache.

A session turn stores its reply's reasoning apart from the answer (`reasoning` on the stored assistant
message, returned by the API) and keeps the exact token ids, thinking included, so the next turn's prompt
matches the cache in full. The stateless chat API re-renders the conversation through the template, and
Qwen3's template drops an earlier turn's reasoning: the prompt then diverges from the cached one where
that reasoning was, and the cache reports exactly that (`diverged` at its position) and still serves
everything before it. Both run here over the real engine (its radix tree) saying exact text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chatserve.sessions import InMemorySessionStore, Message
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply
from tests.helpers.streams import parse_sse_lines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

REASONING = "the user greets me so i greet back"
ANSWER = "Hello there, friend."
BLOCK = 16
# a first message long enough to fill several KV blocks, so what is cached is visible in whole blocks
FIRST = "Please keep this in mind: " + " ".join(f"fact {i} is that the sky is blue." for i in range(12))
SECOND = "And what did I say?"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def thinking_template(tmp_path: Path) -> str:
    path = tmp_path / "qwen3_thinking.jinja"
    path.write_text(qwen3_thinking_template(), encoding="utf-8")
    return str(path)


def engine_for(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer, reply=reasoning_reply(REASONING, ANSWER), max_model_len=1024, num_kv_blocks=256,
                      block_size=BLOCK)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_a_turn_stores_its_reasoning_apart_and_streams_it(smollm_tokenizer, thinking_template) -> None:
    engine = engine_for(smollm_tokenizer)
    store = InMemorySessionStore()
    async with app_client(engine, store, chat_template=thinking_template) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        resp = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi"})  # streams by default
        assert resp.status_code == 200, resp.text
        events = parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))
        deltas = [json.loads(d)["choices"][0]["delta"] for _, d in events[:-1] if json.loads(d)["choices"]]
        got = (await client.get(f"/v1/sessions/{sid}")).json()
    assert "".join(d.get("reasoning") or "" for d in deltas) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    user, reply = got["messages"]
    assert "reasoning" not in user
    assert (reply["content"], reply["reasoning"]) == (ANSWER, REASONING)
    # the history keeps the thinking exactly as generated (the markers too), for the next turn's prompt
    history = smollm_tokenizer.decode(await store.get_history_tokens(sid))
    assert history.endswith(f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>")


async def test_turn_reasoning_effort_is_the_budget_table_and_checked(smollm_tokenizer, thinking_template) -> None:
    engine = engine_for(smollm_tokenizer)
    async with app_client(engine, InMemorySessionStore(), chat_template=thinking_template) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        bad = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "reasoning_effort": "huge"})
        ok = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "reasoning_effort": "low",
                                                                     "stream": False})
        again = await client.post(f"/v1/sessions/{sid}/regenerate", json={"reasoning_effort": "medium",
                                                                         "stream": False})
    assert_error(bad, 400, param="reasoning_effort")
    assert ok.status_code == 200 and again.status_code == 200, (ok.text, again.text)
    assert [r.params.reasoning.budget_tokens for r in engine.requests] == [1024, 4096]
    assert ok.json()["choices"][0]["message"]["reasoning"] == REASONING


async def test_reasoning_round_trips_through_the_stored_record() -> None:
    reply = Message("assistant", ANSWER, finish_reason="stop", reasoning=REASONING)
    back = Message.from_record(reply.to_record())
    assert (back.content, back.reasoning) == (ANSWER, REASONING)
    assert "reasoning" not in Message("assistant", ANSWER).to_dict()  # a reply that did not reason


async def test_multi_turn_cache_stateless_chat_diverges_where_the_template_drops_reasoning_sessions_hit_fully(
        smollm_tokenizer, thinking_template) -> None:
    # ---- the stateless chat API: the client sends the first reply back, reasoning and all ----------
    engine = engine_for(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        first = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": FIRST}]})
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        second = await client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": message["content"], "reasoning": message["reasoning"]},
            {"role": "user", "content": SECOND}]})
    assert second.status_code == 200, second.text
    one, two = engine.requests
    cached_run = one.prompt.prompt_token_ids + smollm_tokenizer.encode(reasoning_reply(REASONING, ANSWER),
                                                                       add_special_tokens=False)
    where = common_prefix(two.prompt.prompt_token_ids, cached_run)
    # the template dropped the earlier turn's reasoning: the prompts part where the first reply began
    assert where < one.prompt.num_tokens
    assert "<think>" in smollm_tokenizer.decode(one.prompt.prompt_token_ids[where:])
    assert REASONING not in smollm_tokenizer.decode(two.prompt.prompt_token_ids)  # sent back, dropped by the template
    usage = second.json()["usage"]
    assert (usage["chatserve"]["miss_reason"], usage["chatserve"]["diverged_at"]) == ("diverged", where)
    assert where - BLOCK < usage["prompt_tokens_details"]["cached_tokens"] <= where  # everything before it is served

    # ---- the session API: the stored tokens, thinking included, are the next prompt's start ---------
    engine = engine_for(smollm_tokenizer)
    store = InMemorySessionStore()
    async with app_client(engine, store, chat_template=thinking_template) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        turns = [await client.post(f"/v1/sessions/{sid}/messages", json={"content": text, "stream": False})
                 for text in (FIRST, SECOND)]
        got = (await client.get(f"/v1/sessions/{sid}")).json()
    assert [t.status_code for t in turns] == [200, 200], [t.text for t in turns]
    one, two = engine.requests
    history = one.prompt.num_tokens + len(smollm_tokenizer.encode(reasoning_reply(REASONING, ANSWER),
                                                                  add_special_tokens=False)) + 1  # + the end token
    assert two.prompt.prompt_token_ids[:history] == (await store.get_history_tokens(sid))[:history]
    usage = turns[1].json()["usage"]
    assert usage["chatserve"]["session_history_matched"] is True
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (history - 1) // BLOCK * BLOCK  # every whole block
    assert [(m["content"], m.get("reasoning")) for m in got["messages"]] == [
        (FIRST, None), (ANSWER, REASONING), (SECOND, None), (ANSWER, REASONING)]
