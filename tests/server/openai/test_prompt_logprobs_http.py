"""vLLM's prompt_logprobs over HTTP: completions put them on each choice, chat on the reply object, a stream
in its first chunk that has them; each entry {token_id: {logprob, rank, decoded_token}}, the first None.

A real engine over a tiny random Llama (float32) with SmolLM2's tokenizer, read through the `openai` SDK's
extra fields where the SDK is the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.helpers.asgi import app_client
from tests.helpers.streams import sse_chunks

PROMPT = "The sky is blue because the light of the sun is scattered by the air"
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def served(folder: Any) -> AsyncIterator[tuple[Any, openai.AsyncOpenAI]]:
    from chatserve import AsyncLLMEngine, EngineArgs
    from chatserve.sessions import InMemorySessionStore

    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(model=str(folder), dtype="float32", num_threads=1,
                                                                 max_model_len=256, block_size=16,
                                                                 served_model_name="tiny"))
    try:
        async with app_client(engine, InMemorySessionStore(), lifespan=True) as http:
            yield http, openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
    finally:
        await engine.shutdown()




def check_entries(entries: list[Any], prompt_ids: list[int], k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(token) in entry
        assert k <= len(entry) <= k + 1
        for item in entry.values():
            assert set(item) == {"logprob", "rank", "decoded_token"} and item["logprob"] <= 0 and item["rank"] >= 1
        assert sorted(item["rank"] for t, item in entry.items() if t != str(token) or item["rank"] <= k)[:k] \
            == list(range(1, k + 1))


@pytest.mark.anyio
async def test_completions_and_chat_return_prompt_logprobs_as_vllm(tiny_checkpoint, smollm_tokenizer) -> None:
    prompt_ids = smollm_tokenizer.encode(PROMPT, add_special_tokens=False)
    async with served(tiny_checkpoint("llama")) as (http, client):
        plain = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
        cmpl = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, n=2,
                                               extra_body={"prompt_logprobs": 3})
        # the reply is the plain one; every choice carries its prompt's entries
        assert cmpl.choices[0].text == plain.choices[0].text
        first = cmpl.choices[0].model_extra["prompt_logprobs"]
        check_entries(first, prompt_ids, 3)
        assert cmpl.choices[1].model_extra["prompt_logprobs"] == first
        # a cached prompt is not read (vLLM): every token of it is computed
        assert cmpl.usage.prompt_tokens_details.cached_tokens == 0
        # 0: the prompt token alone
        zero = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                               extra_body={"prompt_logprobs": 0})
        assert [list(e) for e in zero.choices[0].model_extra["prompt_logprobs"][1:]] == [[str(t)] for t in prompt_ids[1:]]
        assert [e[str(t)]["logprob"] for e, t in zip(zero.choices[0].model_extra["prompt_logprobs"][1:], prompt_ids[1:])] \
            == [e[str(t)]["logprob"] for e, t in zip(first[1:], prompt_ids[1:])]

        # chat: on the reply object (one prompt)
        chat = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, temperature=0,
                                                    extra_body={"prompt_logprobs": 2})
        entries = chat.model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
        assert all(2 <= len(e) <= 3 for e in entries[1:])
        assert "prompt_logprobs" not in (chat.choices[0].model_extra or {})

        # streams: in the first chunk that has them, once
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                     "stream": True, "prompt_logprobs": 3})
        got = sse_chunks(r.text)
        carrying = [c for c in got if c["choices"] and "prompt_logprobs" in c["choices"][0]]
        assert len(carrying) == 1 and carrying[0] is got[0]
        assert carrying[0]["choices"][0]["prompt_logprobs"] == first
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "temperature": 0,
                                                          "stream": True, "prompt_logprobs": 2})
        got = sse_chunks(r.text)
        carrying = [c for c in got if "prompt_logprobs" in c]
        assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == entries


@pytest.mark.anyio
async def test_bad_values_and_session_turns_are_a_400_naming_the_field(tiny_checkpoint) -> None:
    async with served(tiny_checkpoint("llama")) as (http, _):
        for value in (-1, 21, "3"):
            for route, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": ASK})):
                r = await http.post(route, json={**base, "max_tokens": 1, "prompt_logprobs": value})
                assert r.status_code == 400, (route, value, r.text)
                assert r.json()["error"]["param"] == "prompt_logprobs"
        sid = (await http.post("/v1/sessions", json={})).json()["id"]
        r = await http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "prompt_logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        assert "session" in r.json()["error"]["message"]
