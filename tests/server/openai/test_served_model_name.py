"""`--served-model-name NAME [NAME ...]` (vLLM's form): the first name is the one replies report, a
request may name any of them, and `GET /v1/models` lists each. The flag's parsing, and the real app
over `FakeEngine` (no model computes anything here)."""

from __future__ import annotations

import dataclasses

import pytest

from chatserve.cli import options_from_args, parse_args
from chatserve.config import EngineArgs
from chatserve.server.settings import ServerSettings
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
NAMES = ["claude-sonnet-4-5", "claude-haiku-4-5", "smollm2"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply="Hello there.")


def test_the_flag_takes_several_names_the_first_is_the_engines():
    args = parse_args(["serve", "--served-model-name", *NAMES], environ={})
    engine, settings = options_from_args(EngineArgs, args), options_from_args(ServerSettings, args)
    assert engine.served_model_name == settings.served_model_name == NAMES[0]
    assert settings.served_model_aliases == tuple(NAMES[1:])
    # one name is as before; the environment variable splits at whitespace
    one = options_from_args(ServerSettings, parse_args(["serve", "--served-model-name", "m"], environ={}))
    assert (one.served_model_name, one.served_model_aliases) == ("m", None)
    env = options_from_args(ServerSettings, parse_args(["serve"], environ={"CHATSERVE_SERVED_MODEL_NAME": " ".join(NAMES)}))
    assert (env.served_model_name, env.served_model_aliases) == (NAMES[0], tuple(NAMES[1:]))
    # the long form says the same, and `dataclasses.replace` (the CLI sets instance_id so) keeps the aliases
    long = options_from_args(ServerSettings, parse_args(
        ["serve", "--served-model-name", NAMES[0], "--served-model-aliases", *NAMES[1:]], environ={}))
    assert long == settings
    assert dataclasses.replace(settings, instance_id="h:1").served_model_aliases == tuple(NAMES[1:])
    assert EngineArgs(served_model_name=NAMES).served_model_name == NAMES[0]  # LLM(served_model_name=[...])


def test_bad_name_lists_are_refused():
    with pytest.raises(ValueError, match="twice"):
        ServerSettings(served_model_name=["a", "b", "a"])
    with pytest.raises(ValueError, match="non-empty"):
        ServerSettings(served_model_name=["a", " "])
    with pytest.raises(ValueError, match="at least one"):
        EngineArgs(served_model_name=[])
    with pytest.raises(ValueError, match="needs served_model_name"):
        ServerSettings(served_model_aliases=("b",))
    with pytest.raises(SystemExit):  # the flag needs a value
        parse_args(["serve", "--served-model-name"], environ={})


@pytest.mark.anyio
async def test_every_name_is_served_and_listed_replies_report_the_first(engine):
    async with app_client(engine, served_model_name=NAMES) as client:
        models = (await client.get("/v1/models")).json()
        replies = [await client.post("/v1/chat/completions", json={**CHAT, "model": name}) for name in NAMES]
        completion = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "model": NAMES[2]})
        no_model = await client.post("/v1/chat/completions", json=CHAT)
        other = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert [m["id"] for m in models["data"]] == NAMES
    assert all(m["object"] == "model" and m["max_model_len"] == engine.max_model_len for m in models["data"])
    for resp in [*replies, completion, no_model]:
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == NAMES[0]
    assert_error(other, 404, param="model", code="model_not_found", contains=NAMES[0])
    assert all(name in other.json()["error"]["message"] for name in NAMES)


@pytest.mark.anyio
async def test_without_the_flag_the_engines_name_alone(engine):
    async with app_client(engine) as client:
        models = (await client.get("/v1/models")).json()
        other = await client.post("/v1/chat/completions", json={**CHAT, "model": NAMES[0]})
    assert [m["id"] for m in models["data"]] == [engine.model_name]
    assert_error(other, 404, param="model", code="model_not_found", contains=engine.model_name)
