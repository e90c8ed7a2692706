"""Each family's tool-call format with a tiny random model whose chat template has that family's tool
syntax (tests/helpers/tool_templates), served in-process (issue 55).

Per format (llama3_json, mistral in its v11 and v13 spellings, qwen3_coder, pythonic; the format is found
from the template):
greedy forced calls ("required" and a named function) parse into the right function with arguments
that validate against its schema; a streamed call's arguments arrive in more than one chunk and
concatenate to the non-streamed arguments (OpenAI deltas and the Messages API's input_json_delta);
the round trip (assistant tool_calls + the tool result rendered through the family's template) reuses
the first turn's cached prefix; a call cut by max_tokens comes back as a call with finish_reason
"length"; Mistral's ids are 9 alphanumerics (its template refuses any other on the round trip), and v13's
are the ones the model wrote (`name[CALL_ID]id[ARGS]`): the same greedy call has the same id streamed or not,
in the Messages API too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helpers.asgi import tiny_model_client
from tests.helpers.streams import parse_sse_lines, sse_chunks
from tests.helpers.tiny_families import TOOL_FAMILIES, tool_template, with_chat_template

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
FAMILIES = list(TOOL_FAMILIES)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def family_models(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, (arch, template) in TOOL_FAMILIES.items():
        out[name] = with_chat_template(tiny_checkpoint(arch), tmp_path_factory.mktemp(f"tools-{name}"),
                                       tool_template(template))
    return out






def body(**extra: Any) -> dict[str, Any]:
    """A greedy request offering get_weather ("required" then has one right function to call)."""
    return {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 120, **extra}


@pytest.mark.anyio
@pytest.mark.parametrize("family", FAMILIES)
async def test_a_family_calls_tools_in_its_own_format(family_models, family) -> None:
    async with tiny_model_client(family_models[family], max_model_len=512) as client:
        # greedy forced calls: "required" and a named function
        required = await client.post("/v1/chat/completions", json=body(tool_choice="required", parallel_tool_calls=False))
        named = await client.post("/v1/chat/completions", json=body(
            tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
        streamed = await client.post("/v1/chat/completions", json=body(tool_choice="required", parallel_tool_calls=False,
                                                                       stream=True))
        messages = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 120, "temperature": 0, "messages": ASK, "stream": True,
            "tools": [{"name": "get_weather", "description": "The weather", "input_schema": PARAMS}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
        # the same greedy reply, cut three tokens before its end: inside the call's arguments
        cut_at = required.json()["usage"]["completion_tokens"] - 3
        cut = await client.post("/v1/chat/completions", json=body(tool_choice="required", parallel_tool_calls=False,
                                                                  max_tokens=cut_at))

        for resp, name in ((required, "get_weather"), (named, "get_time")):
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == name
            schema = PARAMS if name == "get_weather" else TIME["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            if family.startswith("mistral"):
                assert len(call["id"]) == 9 and call["id"].isalnum(), call["id"]
            else:
                assert call["id"].startswith("call_")
        whole = required.json()["choices"][0]["message"]["tool_calls"][0]

        # streamed: id and name first, then the arguments in more than one piece, the same as the body's
        deltas = [c["choices"][0]["delta"] for c in sse_chunks(streamed.text) if c["choices"]]
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == ""
        pieces = [tc["function"]["arguments"] for tc in calls[1:]]
        assert len(pieces) > 1 and "".join(pieces) == whole["function"]["arguments"]
        if family == "mistral_v13":  # the model's own id, so the same greedy call has the same one
            assert calls[0]["id"] == whole["id"]

        # the Messages API: input_json_delta pieces that concatenate to the same arguments
        events = [json.loads(data) for _, data in parse_sse_lines(messages.text.replace("\r\n", "\n").split("\n"))
                  if data.startswith("{")]
        partial = [e["delta"]["partial_json"] for e in events if e.get("type") == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
        assert len(partial) > 1 and json.loads("".join(partial)) == json.loads(whole["function"]["arguments"])
        if family == "mistral_v13":
            (start,) = [e for e in events if e.get("type") == "content_block_start"
                        and e["content_block"]["type"] == "tool_use"]
            assert start["content_block"]["id"] == whole["id"]

        # cut by max_tokens: still a call, finish_reason "length"
        assert cut.status_code == 200, cut.text
        choice = cut.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        (partial,) = choice["message"]["tool_calls"]
        assert partial["function"]["name"] == "get_weather"
        assert whole["function"]["arguments"].startswith(partial["function"]["arguments"])

        # the round trip: the call and its result rendered through the family template extend the first prompt
        first_prompt = required.json()["usage"]["prompt_tokens"]
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [whole]},
                         {"role": "tool", "tool_call_id": whole["id"], "content": "sunny, 21C"}]
        second = await client.post("/v1/chat/completions", json={**body(max_tokens=4), "messages": history})
        assert second.status_code == 200, second.text
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first_prompt // 16 * 16 > 0, (cached, first_prompt)


@pytest.mark.anyio
async def test_mistral_template_refuses_other_ids_so_they_are_rendered_as_nine_alphanumerics(family_models) -> None:
    call = {"id": "call_from_another_server_01", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    async with tiny_model_client(family_models["mistral"], max_model_len=512) as client:
        resp = await client.post("/v1/chat/completions", json={**body(max_tokens=2), "messages": history})
        assert resp.status_code == 200, resp.text


def test_family_models_are_distinct_templates(family_models) -> None:
    texts = {json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] for folder in family_models.values()}
    assert len(texts) == len(FAMILIES)
