"""vLLM's request fields over HTTP (chat and completions), each changing the reply as vLLM's does.

Where tokens matter (logit_bias, allowed_token_ids, bad_words) a real engine over a tiny random
Llama with SmolLM2's tokenizer serves them, greedy; where the mechanism suffices (echo,
continue_final_message, truncate_prompt_tokens, return_tokens_as_token_ids, suffix, priority) the
scripted worker under the real engine (FakeEngine) does, and the prompt it was handed is checked.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from chatserve.server.openai.fim import FIM_SPELLINGS
from tests.helpers.asgi import app_client, tiny_model_client
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.streams import sse_chunks

REPLY = "Hello there, friend."
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"






# ---- tokens that matter: a real tiny engine ---------------------------------------------------------
@pytest.mark.anyio
async def test_logit_bias_allowed_token_ids_and_bad_words_change_a_real_reply(tiny_checkpoint, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    async with tiny_model_client(tiny_checkpoint("llama")) as client:
        async def reply_ids(**extra: Any) -> list[int]:
            r = await client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 6, "temperature": 0,
                                                           "logprobs": 0, "return_tokens_as_token_ids": True, **extra})
            assert r.status_code == 200, r.text
            return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        plain = await reply_ids()
        assert len(plain) == 6
        # logit_bias -100 on the first token: it never comes (OpenAI's "ban")
        banned = await reply_ids(logit_bias={str(plain[0]): -100})
        assert plain[0] not in banned
        # +100 on a token: it is all the model says
        assert await reply_ids(logit_bias={"1234": 100}) == [1234] * 6
        # allowed_token_ids: only those, and the best of them first
        allowed = sorted({plain[1], 300, 301, 5000})
        assert set(await reply_ids(allowed_token_ids=allowed)) <= set(allowed)
        # bad_words: a word the plain reply says never comes; vLLM bans a word as it tokenises, and after
        # a space where that is as many tokens: so a word that is one token either way
        words = [(t, tok.decode([t]).strip()) for t in plain]

        def one_token(w: str) -> bool:
            return len(tok.encode(w, add_special_tokens=False)) == 1

        word = next(((t, w) for t, w in words if w and one_token(w) and [t] in (
            tok.encode(w, add_special_tokens=False), tok.encode(" " + w, add_special_tokens=False))), None)
        assert word is not None, f"no reply token is a word on its own: {words}"
        assert word[0] not in await reply_ids(bad_words=[word[1]])
        # the same through chat
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0,
                                                            "logit_bias": {"1234": 100}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode([1234] * 4)


@pytest.mark.anyio
async def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(smollm_tokenizer) -> None:
    async with app_client(FakeEngine(smollm_tokenizer)) as client:
        for field, value in (("logit_bias", {"999999": 1}), ("allowed_token_ids", [1, 999999])):
            r = await client.post("/v1/chat/completions", json={"messages": ASK, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and "outside the vocabulary" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias")
        r = await client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"a5": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


# ---- the mechanism: the scripted worker under the real engine --------------------------------------
@pytest.mark.anyio
async def test_the_sampling_fields_reach_the_engine(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY)
    async with app_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": ASK, "logit_bias": {"7": -3.5}, "allowed_token_ids": [7, 9], "bad_words": ["red"]})
        assert r.status_code == 200, r.text
    params = engine.requests[-1].params
    assert params.logit_bias == {7: -3.5} and params.allowed_token_ids == [7, 9] and params.bad_words == ["red"]
    assert smollm_tokenizer.encode("red", add_special_tokens=False) in params.bad_words_token_ids
    assert smollm_tokenizer.encode(" red", add_special_tokens=False) in params.bad_words_token_ids


@pytest.mark.anyio
async def test_chat_echo_prepends_the_last_message_as_vllm(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY)
    prefill = ASK + [{"role": "assistant", "content": "My answer:"}]
    async with app_client(engine) as client:
        # the last message has the reply's role (add_generation_prompt false: its own role): echoed
        r = await client.post("/v1/chat/completions", json={"messages": prefill, "echo": True,
                                                            "add_generation_prompt": False})
        assert r.json()["choices"][0]["message"]["content"] == "My answer:" + REPLY
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "echo": True,
                                                            "add_generation_prompt": False})
        assert r.json()["choices"][0]["message"]["content"] == "Name a colour." + REPLY
        # a new assistant turn after a user message: the user's text is not the reply's, nothing echoed
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "echo": True})
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        # streamed: the echo comes right after the role delta, then the reply
        r = await client.post("/v1/chat/completions", json={"messages": prefill, "echo": True, "stream": True,
                                                            "add_generation_prompt": False})
        deltas = [c["choices"][0]["delta"].get("content") for c in sse_chunks(r.text) if c["choices"]]
        assert deltas[:2] == ["", "My answer:"] and "".join(d or "" for d in deltas) == "My answer:" + REPLY


CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'  # xlam, the default
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.anyio
@pytest.mark.parametrize(("messages", "echoed"), [
    (ASK + [{"role": "assistant", "content": "Let me look."}], "Let me look."),  # the assistant's own turn, continued
    (ASK, "Name a colour."),  # add_generation_prompt false: the user's role is the reply's
])
async def test_chat_echo_with_tool_calls_prepends_the_last_message_and_still_parses_the_calls(
        smollm_tokenizer, messages, echoed) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    request = {"messages": messages, "tools": [WEATHER], "echo": True, "add_generation_prompt": False}
    async with app_client(engine) as client:
        r = await client.post("/v1/chat/completions", json=request)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        # vLLM: the echo is prepended to the content (which a reply of calls alone leaves null)
        assert choice["message"]["content"] == echoed and choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["function"]["arguments"] == '{"city": "Paris"}'
        # streamed: the echo is the first content delta after the role, then the call's deltas
        r = await client.post("/v1/chat/completions", json={**request, "stream": True})
        assert r.status_code == 200, r.text
        chunks = [c["choices"][0] for c in sse_chunks(r.text) if c["choices"]]
        contents = [c["delta"]["content"] for c in chunks if c["delta"].get("content") is not None]
        assert contents[:2] == ["", echoed] and "".join(contents) == echoed
        calls = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # without echo, nothing is prepended: a reply of calls alone has null content
        r = await client.post("/v1/chat/completions", json={**request, "echo": False})
        assert r.json()["choices"][0]["message"]["content"] is None


@pytest.mark.anyio
async def test_continue_final_message_leaves_the_assistant_message_open(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY)
    prefill = ASK + [{"role": "assistant", "content": "The colour is"}]
    async with app_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": prefill, "continue_final_message": True,
                                                            "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        continued = smollm_tokenizer.decode(engine.requests[-1].prompt.prompt_token_ids)
        assert continued.endswith("The colour is"), continued  # no end of turn: the reply goes on from there
        r = await client.post("/v1/chat/completions", json={"messages": prefill, "add_generation_prompt": False})
        closed = smollm_tokenizer.decode(engine.requests[-1].prompt.prompt_token_ids)
        assert closed.startswith(continued) and len(closed) > len(continued)
        # vLLM's refusals: both with add_generation_prompt, and nothing to continue
        r = await client.post("/v1/chat/completions", json={"messages": prefill, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "continue_final_message": True,
                                                            "add_generation_prompt": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.anyio
async def test_truncate_prompt_tokens_keeps_the_last_tokens_on_chat_and_completions(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY)
    text = "one two three four five six seven eight nine ten"
    async with app_client(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 3})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].prompt.prompt_token_ids == smollm_tokenizer.encode(text)[-3:]
        assert r.json()["usage"]["prompt_tokens"] == 3
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "truncate_prompt_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
        r = await client.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.anyio
async def test_return_tokens_as_token_ids_spells_logprob_tokens_as_ids(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY)
    ids = smollm_tokenizer.encode(REPLY, add_special_tokens=False)
    async with app_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "logprobs": True, "top_logprobs": 2,
                                                            "return_tokens_as_token_ids": True})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content][: len(ids)] == [f"token_id:{t}" for t in ids]
        assert all(top["token"].startswith("token_id:") for c in content for top in c["top_logprobs"])
        r = await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1, "max_tokens": 3,
                                                       "return_tokens_as_token_ids": True})
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids[:3]]
        r = await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1, "max_tokens": 3})
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [smollm_tokenizer.decode([t]) for t in ids[:3]]


@pytest.mark.anyio
async def test_suffix_is_a_fill_in_the_middle_prompt_or_a_400_naming_the_model(smollm_tokenizer) -> None:
    async with app_client(FakeEngine(smollm_tokenizer, model_name="smol")) as client:
        r = await client.post("/v1/completions", json={"prompt": "def f(", "suffix": "    return x"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "suffix" and "smol has none" in r.json()["error"]["message"]
    fim = copy.deepcopy(smollm_tokenizer)  # SmolLM2 has no FIM tokens: a copy of its tokenizer with StarCoder's
    fim.add_special_tokens({"additional_special_tokens": list(FIM_SPELLINGS[0])})
    markers = fim.convert_tokens_to_ids(list(FIM_SPELLINGS[0]))
    engine = FakeEngine(fim, reply=REPLY)
    async with app_client(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": "def f(", "suffix": "    return x"})
        assert r.status_code == 200, r.text
        want = [markers[0], *fim.encode("def f(", add_special_tokens=False), markers[1],
                *fim.encode("    return x", add_special_tokens=False), markers[2]]
        assert engine.requests[-1].prompt.prompt_token_ids == want
        r = await client.post("/v1/completions", json={"prompt": "x", "suffix": "y", "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


@pytest.mark.anyio
async def test_priority_is_served_under_the_priority_policy_and_refused_otherwise(smollm_tokenizer) -> None:
    async with app_client(FakeEngine(smollm_tokenizer)) as client:
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "priority": 0})
        assert r.status_code == 200
    engine = FakeEngine(smollm_tokenizer, scheduling_policy="priority")
    async with app_client(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "priority": -7})
        assert r.status_code == 200, r.text
    assert engine.requests[-1].params.priority == -7


@pytest.mark.anyio
async def test_a_session_turn_still_refuses_what_only_chat_and_completions_serve(smollm_tokenizer) -> None:
    from chatserve.server.sessions.protocol import SessionMessageRequest

    for field, value in (("truncate_prompt_tokens", 3), ("continue_final_message", True)):
        with pytest.raises(Exception, match=field):
            SessionMessageRequest.model_validate({"content": "hi", field: value})
