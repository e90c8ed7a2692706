"""`/tokenize`, `/detokenize`, `/v1/chat/completions/render` over the real app and the real input path.

The render route must give exactly the ids the chat route runs: checked against what the fake
engine was handed for the same body (the FakeEngine records its requests' prompt ids).
"""

from __future__ import annotations

import pytest

from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CHAT = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


client_for = app_client


async def test_render_gives_the_ids_the_chat_route_runs(smollm_tokenizer):
    engine = FakeEngine(smollm_tokenizer, reply="Blue.")
    async with client_for(engine) as client:
        rendered = (await client.post("/v1/chat/completions/render", json={**CHAT, "temperature": 0.3, "max_tokens": 7})).json()
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    ran = engine.requests[-1].prompt.prompt_token_ids
    assert rendered["token_ids"] == ran
    assert rendered["sampling_params"]["temperature"] == pytest.approx(0.3)
    assert rendered["sampling_params"]["max_tokens"] == 7
    expected = smollm_tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    assert smollm_tokenizer.decode(ran) == expected


async def test_tokenize_prompt_and_messages_and_detokenize_round_trip(smollm_tokenizer):
    engine = FakeEngine(smollm_tokenizer)
    async with client_for(engine) as client:
        plain = (await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
        assert plain["tokens"] == smollm_tokenizer.encode("Hello world", add_special_tokens=True)
        assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == engine.max_model_len
        assert "".join(plain["token_strs"]).replace("Ġ", " ") == "Hello world"
        chat = (await client.post("/tokenize", json=CHAT)).json()
        rendered = (await client.post("/v1/chat/completions/render", json=CHAT)).json()
        assert chat["tokens"] == rendered["token_ids"] and chat["token_strs"] is None
        back = (await client.post("/detokenize", json={"tokens": chat["tokens"]})).json()
        assert back["prompt"] == smollm_tokenizer.decode(chat["tokens"])


async def test_bad_bodies_name_the_field(smollm_tokenizer):
    engine = FakeEngine(smollm_tokenizer)
    async with client_for(engine) as client:
        assert_error(await client.post("/detokenize", json={"tokens": [1, 10**9]}), 400, param="tokens[1]")
        assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens.0")
        assert_error(await client.post("/tokenize", json={"prompt": 5}), 400, param="prompt")
        assert_error(await client.post("/tokenize", json={**CHAT, "add_special_tokens": True}), 400,
                     param="add_special_tokens")
        assert_error(await client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, param="model")
        assert_error(await client.post("/v1/chat/completions/render", json={"messages": []}), 400, param="messages")
        too_long = {"messages": [{"role": "user", "content": "word " * 5000}]}
        assert_error(await client.post("/v1/chat/completions/render", json=too_long), 400, param="messages")
    assert engine.requests == []  # nothing rendered was ever run


async def test_token_routes_need_the_api_key(smollm_tokenizer):
    async with client_for(FakeEngine(smollm_tokenizer), api_key="k") as client:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                           ("/v1/chat/completions/render", CHAT)):
            assert_error(await client.post(path, json=body), 401)
            assert (await client.post(path, json=body, headers={"Authorization": "Bearer k"})).status_code == 200


async def test_render_with_tools_matches_the_chat_route(smollm_tokenizer):
    """Tools change the template (the shipped xLAM one for SmolLM2): render must see that too."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    body = {**CHAT, "tools": tools, "tool_choice": "auto"}
    engine = FakeEngine(smollm_tokenizer, reply="Sunny.")
    async with client_for(engine) as client:
        rendered = (await client.post("/v1/chat/completions/render", json=body)).json()
        plain = (await client.post("/v1/chat/completions/render", json=CHAT)).json()
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert rendered["token_ids"] == engine.requests[-1].prompt.prompt_token_ids
    assert rendered["token_ids"] != plain["token_ids"]
    assert "get_weather" in smollm_tokenizer.decode(rendered["token_ids"])
