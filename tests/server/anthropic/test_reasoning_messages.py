"""Extended thinking on the Messages API, in-process: the real app over `FakeEngine` (the real engine over a
scripted worker) saying `<think>`-shaped replies through a Qwen3-style thinking template, the reasoning
parser forced (`--reasoning-parser qwen3`); the anthropic SDK's own types read every body and event.

What is checked: a `thinking` block before the text (body, and stream: `content_block_start` with
empty thinking and signature, `thinking_delta`s, one `signature_delta`, `content_block_stop`, as
`client.messages.stream` accumulates them), `display: "omitted"`, the signature round trip (a block
sent back renders through the template's `reasoning_content`; an edited text, a forged signature or
another server's key is a 400 naming `messages.N.content.M.signature`), `redacted_thinking`
accepted and left out, Anthropic's budget rules (`budget_tokens` >= 1024 and < `max_tokens`),
`output_config.effort` and `budget_tokens` through the budget table, `thinking: disabled` rendering
`enable_thinking` off, `output_tokens` counting the thinking, and a server whose model has no parser
ignoring the thinking fields (as Claude Code sends them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from chatserve.reasoning.signature import ReasoningSigner
from chatserve.server import ServerSettings, create_app
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply

REASONING = "the user greets me so i greet back"
ANSWER = "Hello there, friend."
MODEL = "fake-model"
HEADERS = {"anthropic-version": "2023-06-01"}

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def template_file(tmp_path: Path) -> str:
    path = tmp_path / "qwen3_thinking.jinja"
    path.write_text(qwen3_thinking_template(), encoding="utf-8")
    return str(path)


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply=reasoning_reply(REASONING, ANSWER), max_model_len=4096,
                      num_kv_blocks=512)


def app(engine: FakeEngine, template_file: str | None, **settings: Any) -> Any:
    if template_file is not None:
        settings.setdefault("chat_template", template_file)
        settings.setdefault("reasoning_parser", "qwen3")
    return create_app(engine, None, ServerSettings(serve_web=False, **settings), None)


def clients(application: Any) -> tuple[httpx2.AsyncClient, anthropic.AsyncAnthropic]:
    """Plain HTTP and the anthropic SDK over the app in-process (httpx2: the SDK's own httpx)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=application), base_url="http://test", timeout=30)
    return http, anthropic.AsyncAnthropic(api_key="x", base_url="http://test", http_client=http, max_retries=0)


def body(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "Hi"}],
                           "thinking": {"type": "enabled", "budget_tokens": 1024}}
    out.update(fields)
    return out


def prompt_text(engine: FakeEngine, tokenizer: Any) -> str:
    return tokenizer.decode(engine.requests[-1].prompt.prompt_token_ids)


@pytest.mark.anyio
async def test_thinking_block_before_the_text_signed(engine, smollm_tokenizer, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        message = await client.messages.create(**body())
    assert [b.type for b in message.content] == ["thinking", "text"]
    thinking = message.content[0]
    assert thinking.thinking == REASONING and thinking.signature
    assert message.content[1].text == ANSWER
    assert engine.requests[-1].params.reasoning.budget_tokens == 1024
    # output_tokens counts the thinking too (Anthropic's usage has no separate count)
    assert message.usage.output_tokens == len(engine.reply_ids) + 1


@pytest.mark.anyio
async def test_stream_thinking_events_and_sdk_accumulation(engine, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        async with client.messages.stream(**body()) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
    raw = [e for e in events if e.type in ("content_block_start", "content_block_delta", "content_block_stop")]
    block0 = [e for e in raw if e.index == 0]
    assert block0[0].type == "content_block_start"
    assert block0[0].content_block.model_dump() == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [e.delta for e in block0 if e.type == "content_block_delta"]
    assert [d.type for d in deltas[:-1]] == ["thinking_delta"] * (len(deltas) - 1)
    assert deltas[-1].type == "signature_delta" and block0[-1].type == "content_block_stop"
    assert "".join(d.thinking for d in deltas[:-1]) == REASONING
    # the thinking block is closed before the text block starts
    assert raw.index(block0[-1]) < next(i for i, e in enumerate(raw) if e.index == 1)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[0].signature == deltas[-1].signature
    assert final.content[1].text == ANSWER


@pytest.mark.anyio
async def test_signature_round_trip_and_refusals(engine, smollm_tokenizer, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        first = await client.messages.create(**body())
        thinking = first.content[0].model_dump()
        turn = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [thinking, {"type": "text", "text": "The answer is"}]}]
        await client.messages.create(**body(messages=turn))  # a prefill after the thinking: it renders
        assert f"<think>\n{REASONING}\n</think>\n\nThe answer is" in prompt_text(engine, smollm_tokenizer)
        n = len(engine.requests)
        foreign = ReasoningSigner.from_key("another server")
        for block in ({**thinking, "thinking": REASONING + " and more"},
                      {**thinking, "signature": "csig1_" + "A" * 43},
                      {**thinking, "signature": foreign.sign(REASONING)},
                      {**thinking, "signature": foreign.seal(REASONING), "thinking": ""}):
            bad = [turn[0], {"role": "assistant", "content": [{"type": "text", "text": "x"}, block]}]
            r = await http.post("/v1/messages", json=body(messages=bad), headers=HEADERS)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith("messages.1.content.1.signature"), error
        r = await http.post("/v1/messages/count_tokens", headers=HEADERS, json={
            "model": MODEL, "messages": [turn[0], {"role": "assistant", "content": [block]}]})
        assert r.status_code == 400 and "messages.1.content.0.signature" in r.json()["error"]["message"]
        assert len(engine.requests) == n  # nothing refused reached the engine


@pytest.mark.anyio
async def test_omitted_display_round_trips_through_the_signature(engine, smollm_tokenizer, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        async with client.messages.stream(**body(thinking={"type": "adaptive", "display": "omitted"})) as stream:
            events = [e async for e in stream]
            message = await stream.get_final_message()
        assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        block = message.content[0]
        assert block.type == "thinking" and block.thinking == "" and block.signature
        assert REASONING not in block.signature
        turn = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "The answer is"}]}]
        await client.messages.create(**body(messages=turn))
    assert f"<think>\n{REASONING}\n</think>\n\nThe answer is" in prompt_text(engine, smollm_tokenizer)


@pytest.mark.anyio
async def test_redacted_thinking_is_accepted_and_left_out(engine, smollm_tokenizer, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        await client.messages.create(**body(messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque-secret"},
                                              {"type": "text", "text": "The answer is"}]}]))
    rendered = prompt_text(engine, smollm_tokenizer)
    assert "opaque-secret" not in rendered and rendered.endswith("The answer is")


@pytest.mark.anyio
async def test_budget_rules_and_effort(engine, smollm_tokenizer, template_file) -> None:
    http, client = clients(app(engine, template_file))
    async with http:
        for payload, field in ((body(thinking={"type": "enabled", "budget_tokens": 1023}), "thinking.budget_tokens"),
                               (body(max_tokens=1024), "thinking.budget_tokens"),
                               (body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
                               (body(thinking={"type": "adaptive", "budget_tokens": 2000}), "thinking.budget_tokens"),
                               (body(output_config={"effort": "extreme"}), "output_config.effort")):
            r = await http.post("/v1/messages", json=payload, headers=HEADERS)
            assert r.status_code == 400, (payload, r.text)
            assert r.json()["error"]["message"].startswith(field), r.json()
        await client.messages.create(**body(thinking={"type": "adaptive"}, output_config={"effort": "medium"}))
        assert engine.requests[-1].params.reasoning.budget_tokens == 4096
        await client.messages.create(**body(thinking={"type": "enabled", "budget_tokens": 1500},
                                            output_config={"effort": "high"}))
        assert engine.requests[-1].params.reasoning.budget_tokens == 1500  # (a token count wins over an effort)
        await client.messages.create(**body(thinking={"type": "adaptive"}, output_config={"effort": "max"}))
        assert engine.requests[-1].params.reasoning.budget_tokens is None
        message = await client.messages.create(**body(thinking={"type": "disabled"}))
    # thinking off: the template's enable_thinking=False renders a closed empty block, nothing is reasoning
    assert prompt_text(engine, smollm_tokenizer).endswith("<think>\n\n</think>\n\n")
    assert engine.requests[-1].params.reasoning is None
    assert [b.type for b in message.content] == ["text"]


@pytest.mark.anyio
async def test_a_model_without_a_parser_ignores_thinking(smollm_tokenizer) -> None:
    """Claude Code sends `thinking` and an effort on every request: on a model that does not reason they
    change nothing (no 400), and the reply has no thinking block."""
    engine = FakeEngine(smollm_tokenizer, reply=ANSWER, max_model_len=4096)
    http, client = clients(app(engine, None))
    async with http:
        message = await client.messages.create(**body(thinking={"type": "adaptive", "display": "omitted"},
                                                      output_config={"effort": "medium"}))
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == ANSWER
    assert engine.requests[-1].params.reasoning is None


def test_signer_accepts_only_what_its_key_made() -> None:
    """The signer alone: a signature is for one text under one key; a sealed value opens only under its
    key and whole (cut, re-encoded or retagged: refused); a signature never passes as a sealed value."""
    from chatserve.reasoning.signature import ReasoningSignatureError

    signer, other = ReasoningSigner.from_key("k1"), ReasoningSigner.from_key("k2")
    text = "a thought, with unicode: é 思"
    sig = signer.sign(text)
    assert signer.verify(sig, text) and not signer.verify(sig, text + " ") and not other.verify(sig, text)
    assert not signer.verify(sig.removeprefix("csig1_"), text)
    sealed = signer.seal(text)
    assert signer.unseal(sealed) == text and text not in sealed
    for bad in (sealed[:-4], sealed + "AAAA", "csrc1_!!!", sig, "csrc1_", other.seal(text)):
        with pytest.raises(ReasoningSignatureError):
            signer.unseal(bad)
    assert ReasoningSigner.from_key(None).random_key and ReasoningSigner.from_key(None).sign(text) != sig
    with pytest.raises(ValueError):
        ReasoningSigner.from_key("")
