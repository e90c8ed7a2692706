"""Real clients reading and sending back reasoning on a live server: the default model served with a
Qwen3-style thinking template (tests/helpers/reasoning.py: the prompt opens `<think>`) and
`--reasoning-parser qwen3`, so what the model writes is reasoning until the end marker, which the
engine forces when the request's budget is spent; the answer follows (the model writes on past its
end of turn with `ignore_eos`, so that the budget is what ends its reasoning).

- The openai SDK's `client.responses.stream`: the reasoning item's events before the message's,
  `reasoning.effort` bounding the reasoning, `reasoning_tokens` in usage, and the item's sealed
  `encrypted_content` sent back in `input` (a tampered one: the SDK's BadRequestError).
- The anthropic SDK's `client.messages.stream` with `thinking`: a thinking block (its deltas and its
  signature) before the text, sent back in the next request's assistant message, which then renders
  it (count_tokens counts it); an edited one is the SDK's BadRequestError naming the block.
How the split behaves on every chunking, and the exact text, are the in-process tests'
(tests/server/responses/test_reasoning_responses.py, tests/server/anthropic/test_reasoning_messages.py).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.helpers.reasoning import qwen3_thinking_template
from tests.helpers.server import ServerProcess, start_server

API_KEY = "reasoning-clients-key"
MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("reasoning") / "qwen3_thinking.jinja"
    template.write_text(qwen3_thinking_template(), encoding="utf-8")
    srv = start_server("--max-model-len", "4096", "--max-num-seqs", "4", "--chat-template", str(template),
                       "--reasoning-parser", "qwen3", "--reasoning-signing-key", "a shared secret",
                       "--served-model-name", MODEL, api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def openai_client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def anthropic_client(srv: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0, timeout=300)


def test_openai_responses_stream_reasoning_then_answer_and_send_it_back(server):
    client = openai_client(server)
    with client.responses.stream(model=MODEL, input="Name a colour.", reasoning={"effort": "minimal"},
                                 max_output_tokens=280, include=["reasoning.encrypted_content"],
                                 temperature=0, extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    # (ignore_eos: the reply runs to max_output_tokens, so it ends as response.incomplete)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.encrypted_content
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text and deltas.strip()
    # the budget (minimal: 256 tokens; ignore_eos keeps this small model writing) was spent, so the engine
    # ended the reasoning with the marker, and the answer followed
    assert final.usage is not None and 256 <= final.usage.output_tokens_details.reasoning_tokens <= 256 + 8
    assert [i.type for i in final.output] == ["reasoning", "message"], kinds
    last_reasoning = max(i for i, k in enumerate(kinds) if k.startswith("response.reasoning_text"))
    assert last_reasoning < kinds.index("response.output_text.delta")
    assert "<think>" not in final.output_text and "</think>" not in final.output_text
    # the item sent back as the SDK hands it over: taken; with its sealed value edited: refused
    back = [{"role": "user", "content": "Name a colour."}, reasoning.model_dump(exclude_none=True),
            final.output[1].model_dump(exclude_none=True), {"role": "user", "content": "Another one."}]
    again = client.responses.create(model=MODEL, input=back, max_output_tokens=4, temperature=0)
    assert again.status in ("completed", "incomplete")
    back[1]["encrypted_content"] = back[1]["encrypted_content"][:-2] + "xx"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=back, max_output_tokens=4)
    assert err.value.body["param"] == "input.1.encrypted_content"


def test_anthropic_stream_thinking_block_sent_back(server):
    client = anthropic_client(server)
    chat = [{"role": "user", "content": "Name a colour."}]
    with client.messages.stream(model=MODEL, max_tokens=1040, messages=chat,
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        message = stream.get_final_message()
    assert [b.type for b in message.content][:1] == ["thinking"], message.content
    thinking = message.content[0]
    assert thinking.thinking.strip() and thinking.signature
    delta_kinds = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
    assert delta_kinds[-1] == "signature_delta" and set(delta_kinds[:-1]) == {"thinking_delta"}
    assert "<think>" not in thinking.thinking and "</think>" not in thinking.thinking
    # (this small model ends its turn within the budget, often before any answer: a text block may follow)
    assert all(b.type == "text" and "think>" not in b.text for b in message.content[1:]), message.content
    # sent back before a prefill (after the last user turn, where the template renders reasoning): it renders
    prefill = {"type": "text", "text": "My answer:"}
    with_thinking = [*chat, {"role": "assistant", "content": [thinking.model_dump(), prefill]}]
    without = [*chat, {"role": "assistant", "content": [prefill]}]
    counted = client.messages.count_tokens(model=MODEL, messages=with_thinking).input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=without).input_tokens
    reply = client.messages.create(model=MODEL, max_tokens=4, messages=with_thinking)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted
    edited = {**thinking.model_dump(), "thinking": thinking.thinking + " (edited)"}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[*chat, {"role": "assistant", "content": [edited, prefill]}])
    assert "messages.1.content.0.signature" in str(err.value)
