"""`cache_control` and `prompt_cache_key` over HTTP, on a real engine: a tiny random Llama with a
24-block KV pool, so a flood of a dozen one-off prompts evicts everything unleased in seconds.
A leased prefix is still a hit after the flood within its TTL and a miss after it; the TTL runs on
the engine's injected clock (no sleeps, no wall-clock assertions). The engine-level mechanism is
tests/cache/test_prefix_leases.py's; this checks the APIs hand it the right prefixes.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers.asgi import app_client

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
BLOCK = 16
HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def _engine(tiny: str, clock: Clock):
    from chatserve import EngineArgs
    from chatserve.engine.async_engine import AsyncLLMEngine
    from chatserve.engine.llm_engine import LLMEngine

    args = EngineArgs.from_env(model=tiny, dtype="float32", block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2, max_model_len=384)
    return AsyncLLMEngine(LLMEngine(args, clock=clock))


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "heron"])
                    for _ in range(n))


async def _flood(client, tag: int) -> None:
    """Twelve one-off 64-token prompts through the 24-block pool: every unleased block is evicted."""
    for i in range(12):
        rng = random.Random(tag * 100 + i)
        r = await client.post("/v1/completions", json={"prompt": [rng.randrange(100, 30000) for _ in range(64)],
                                                       "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text


async def _message(client, system: str, question: str, control: dict | None) -> dict:
    block = {"type": "text", "text": system, **({"cache_control": control} if control else {})}
    r = await client.post("/v1/messages", headers=HEADERS, json={
        "model": "m", "max_tokens": 2, "temperature": 0, "system": [block],
        "messages": [{"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


async def _chat(client, system: str, question: str, **fields) -> int:
    r = await client.post("/v1/chat/completions", json={
        "max_tokens": 2, "temperature": 0, **fields,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_cache_control_keeps_its_prefix_through_a_flood_within_its_ttl_and_not_after(tiny) -> None:
    clock = Clock()
    engine = _engine(tiny, clock)
    system, other = _words(1, 60), _words(2, 60)
    async with app_client(engine, lifespan=True, served_model_name="m") as client:
        first = await _message(client, system, "first question", {"type": "ephemeral"})
        leased = first["cache_creation_input_tokens"]  # the breakpoint: the system turn
        assert leased >= 3 * BLOCK
        await _message(client, other, "first question", None)  # the same shape, unleased
        await _flood(client, 1)
        hit = await _message(client, system, "second question", None)
        assert hit["cache_read_input_tokens"] >= leased // BLOCK * BLOCK  # the hit renewed the lease too
        assert (await _message(client, other, "second question", None))["cache_read_input_tokens"] < BLOCK
        clock.t += 301  # past the renewed lease's five minutes
        await _flood(client, 2)
        gone = await _message(client, system, "third question", None)
        assert gone["cache_read_input_tokens"] < BLOCK


async def test_prompt_cache_key_leases_the_whole_prompt_for_its_retention(tiny) -> None:
    clock = Clock()
    engine = _engine(tiny, clock)
    system = _words(3, 60)
    async with app_client(engine, lifespan=True, served_model_name="m") as client:
        assert await _chat(client, system, "q", prompt_cache_key="agent-1", prompt_cache_retention="24h") == 0
        clock.t += 3600  # an hour later: still leased (24 h)
        await _flood(client, 3)
        cached = await _chat(client, system, "q")
        assert cached >= 4 * BLOCK
        # a salt never shares: the same prompt under a salt reads nothing the unsalted one cached
        assert await _chat(client, system, "q", cache_salt="tenant-b") == 0
