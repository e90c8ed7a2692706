"""KV cache events (blocks stored / removed / all cleared) in vLLM's wire format, for vllm-router's
kv_aware policy: what the radix tree records, what the engine publishes over ZMQ, what the
worker endpoints tell a router.

The stream is checked the way a subscriber uses it: replayed in order into a model of "which
blocks does this replica hold", which must equal the tree's own contents at every checkpoint
(nothing stored that the tree does not hold, nothing evicted that was never removed), and must
be empty after a reset.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable

import msgpack
import pytest
import zmq

from chatserve import LLM, SamplingParams
from chatserve.cache import AllBlocksCleared, BlockAllocator, BlockRemoved, BlockStored, KVEventLog, RadixPrefixCache
from chatserve.cache.kv_events import event_hashes
from chatserve.engine.kv_event_publisher import KVEventsConfig
from chatserve.server.kv_events import connect_address
from tests.helpers.asgi import app_client
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.net import wait_until

U64 = 1 << 64
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}


def tree_hashes(cache: RadixPrefixCache) -> set[int]:
    """Every block the tree holds, named the way the event stream names it (computed from the tree)."""
    out: set[int] = set()
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            tokens = prefix + child.key
            hashes = event_hashes(tokens, cache.block_size, len(tokens) // cache.block_size)
            out.update(hashes[len(hashes) - len(child.block_ids):])
            stack.append((child, tokens))
    return out


class Holdings:
    """A subscriber's view: which blocks (by hash) a replica holds, and each one's whole prefix."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefix: dict[int, tuple[int, ...]] = {}
        self.num_cleared = 0

    def apply_stored(self, hashes: list[int], parent: int | None, tokens: list[int], block_size: int) -> None:
        bs = self.block_size
        assert block_size == bs and len(tokens) == len(hashes) * bs and hashes
        assert parent is None or parent in self.prefix, f"stored under parent {parent} that is not held"
        prefix = self.prefix[parent] if parent is not None else ()
        for i, h in enumerate(hashes):
            assert 0 <= h < U64
            assert h not in self.prefix, f"block {h} stored twice without a removal"
            prefix = prefix + tuple(tokens[i * bs:(i + 1) * bs])
            # the hash names the block's whole prefix: a subscriber may trust parent links
            assert event_hashes(prefix, bs, len(prefix) // bs)[-1] == h
            self.prefix[h] = prefix

    def apply_removed(self, hashes: list[int]) -> None:
        for h in hashes:
            assert h in self.prefix, f"removal of block {h} that was never stored (or removed twice)"
            del self.prefix[h]

    def apply(self, events: Iterable[object]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.apply_stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
            elif isinstance(e, BlockRemoved):
                self.apply_removed(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.prefix.clear()
                self.num_cleared += 1
            else:
                raise AssertionError(f"unknown event {e!r}")

    def apply_wire(self, payload: bytes) -> None:
        """One published batch, checked against the shape vllm-router 0.1.17 decodes."""
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 3, batch  # [ts, events, data_parallel_rank]
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 0 and rank == 0
        assert 0 < len(events) <= 4096
        for e in events:
            assert isinstance(e, dict), e
            kind = e["type"]
            if kind == "BlockStored":
                assert set(e) == STORED_KEYS, e.keys()
                assert e["medium"] == "GPU" and e["lora_id"] is None and e["lora_name"] is None
                self.apply_stored(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"])
            elif kind == "BlockRemoved":
                assert set(e) == {"type", "block_hashes", "medium"} and e["medium"] == "GPU" and e["block_hashes"]
                self.apply_removed(e["block_hashes"])
            else:
                assert e == {"type": "AllBlocksCleared"}, e
                self.prefix.clear()
                self.num_cleared += 1


# ---- the tree's record -------------------------------------------------------------------------------
def test_the_tree_records_every_block_it_takes_and_frees() -> None:
    rng = random.Random(3)
    bs = 4
    alloc = BlockAllocator(48)
    log = KVEventLog(bs)
    cache = RadixPrefixCache(alloc, bs, kv_events=log)
    seen = Holdings(bs)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for step in range(300):
        if rng.random() < 0.75:
            tokens = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 14))]
            match = cache.match_prefix(tokens)
            cache.lock(match.node)
            alloc.incref(match.block_ids)
            need = len(tokens) // bs - len(match.block_ids)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            if alloc.num_free >= need:
                table = match.block_ids + alloc.allocate(need)
                result = cache.insert(tokens, table)
                cache.lock(result.node)
                cache.unlock(result.node)
                alloc.decref(table)
            else:
                alloc.decref(match.block_ids)
            cache.unlock(match.node)
        else:
            cache.evict(rng.randrange(1, 6))
        seen.apply(log.drain())
        if step % 25 == 0:
            assert set(seen.prefix) == tree_hashes(cache), f"step {step}: the stream and the tree disagree"
    cache.check_integrity()
    assert set(seen.prefix) == tree_hashes(cache)
    assert log.num_removed_blocks > 0, "the workload never evicted: it tests too little"
    cache.reset()
    seen.apply(log.drain())
    assert seen.prefix == {} and seen.num_cleared == 1
    assert log.num_stored_blocks == log.num_removed_blocks  # every stored block was removed once


def test_no_log_records_nothing_and_hashes_nothing() -> None:
    cache = RadixPrefixCache(BlockAllocator(8), 4)
    alloc = cache.allocator
    table = alloc.allocate(2)
    cache.insert(list(range(8)), table)
    alloc.decref(table)
    assert cache.kv_events is None and cache.evict(2) == 2


# ---- the engine's stream over ZMQ -------------------------------------------------------------------
def _replay(endpoint: str, start: int = 0, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
    """Every buffered batch from `start`, through the replay socket (vLLM's protocol)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(timeout_ms), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            out.append((n, payload))
    finally:
        sock.close()


def _two_free_ports() -> tuple[int, int]:
    """Two distinct ports free now (held open together while picked, so they cannot coincide)."""
    import socket

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


@pytest.fixture()
def publishing_llm(tiny_checkpoint):
    ports = _two_free_ports()
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=40, max_model_len=512,
              kv_events_endpoint=f"tcp://127.0.0.1:{ports[0]}", kv_events_replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
              kv_events_topic="kv")
    yield llm, ports
    llm.engine.close()


def _settle(llm: LLM) -> None:
    pub = llm.engine.kv_event_publisher
    wait_until(lambda: pub.num_sent_steps == pub.num_queued_steps, 30, "the publisher to send what is queued")


def test_the_engine_publishes_each_steps_blocks_in_vllms_format(publishing_llm) -> None:
    llm, (pub_port, replay_port) = publishing_llm
    engine = llm.engine
    bs = engine.block_manager.block_size
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    rng = random.Random(11)
    stems = [[rng.randrange(100, 30000) for _ in range(rng.randrange(40, 120))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seen = Holdings(bs)
    try:
        for round_ in range(3):  # 40 blocks of 16: the later rounds must evict the earlier ones
            prompts = [{"prompt_token_ids": s + [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 40))]}
                       for s in stems]
            llm.generate(prompts, params)
            # an aborted request gives its computed blocks to the tree too: they are published
            engine.add_request(f"abort-{round_}", {"prompt_token_ids": stems[round_] + list(range(500, 560))}, params)
            for _ in range(2):
                engine.step()
            engine.abort_request(f"abort-{round_}")
            _settle(llm)
            batches = _replay(f"tcp://127.0.0.1:{replay_port}")
            assert [n for n, _ in batches] == list(range(len(batches))), "sequence numbers skip or repeat"
            seen = Holdings(bs)
            for _, payload in batches:
                seen.apply_wire(payload)
            assert set(seen.prefix) == tree_hashes(engine.block_manager.cache), f"round {round_}: stream != tree"
        assert engine.block_manager.cache.num_evicted_blocks > 0, "nothing was evicted: the pool is too big"
        assert engine.reset_prefix_cache()
        _settle(llm)
        batches = _replay(f"tcp://127.0.0.1:{replay_port}")
        seen = Holdings(bs)
        for _, payload in batches:
            seen.apply_wire(payload)
        assert seen.prefix == {} and seen.num_cleared == 1  # nothing leaked: every stored block was removed
        # the live subscriber got the same messages (the first may predate its connection)
        live = {}
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live[int.from_bytes(seq, "big")] = payload
        assert live and len(batches) - 1 in live, "the live subscriber missed the last batch"
        assert all(payload == batches[n][1] for n, payload in live.items())
        # a replay from the middle starts there
        tail = _replay(f"tcp://127.0.0.1:{replay_port}", start=len(batches) - 2)
        assert [n for n, _ in tail] == [len(batches) - 2, len(batches) - 1]
    finally:
        sub.close()


def test_bad_kv_event_endpoints_are_refused_naming_the_field() -> None:
    from chatserve.config import EngineArgs

    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "tcp://host:0", "ipc:///tmp/x"):
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            EngineArgs(kv_events_endpoint=bad)
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        EngineArgs(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    EngineArgs(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://*:5558")


# ---- what a router asks a worker --------------------------------------------------------------------
def test_connect_address_names_the_host_the_caller_reached() -> None:
    assert connect_address("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert connect_address("tcp://0.0.0.0:5557", "replica-1") == "tcp://replica-1:5557"
    assert connect_address("tcp://127.0.0.1:5557", "10.0.0.7") == "tcp://127.0.0.1:5557"


def test_worker_endpoints_tell_the_router_block_size_and_event_sources(smollm_tokenizer) -> None:
    async def run() -> None:
        engine = FakeEngine(smollm_tokenizer, block_size=32)
        async with app_client(engine, instance_id="replica-a") as client:
            info = (await client.get("/get_server_info")).json()
            assert info["kv_block_size"] == 32 and info["model_id"] == "fake-model"
            assert info["instance_id"] == "replica-a" and info["enable_kv_cache_events"] is False
            assert (await client.get("/kv_event_sources")).json() == {}
            engine.kv_events_config = KVEventsConfig("tcp://*:6001", "tcp://*:6002", "kv")
            sources = (await client.get("/kv_event_sources")).json()
            assert sources == {"0": {"publisher": "zmq", "enable_kv_cache_events": True,
                                     "endpoint": "tcp://test:6001", "replay_endpoint": "tcp://test:6002",
                                     "topic": "kv", "hwm": 100_000, "buffer_steps": 10_000}}

    asyncio.run(run())


# ---- the cluster launcher's wiring --------------------------------------------------------------------
def test_kv_aware_cluster_gives_each_replica_its_own_sockets_and_the_router_static_sources() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from chatserve.cluster import ClusterSpec, replica_command, router_command

    class Info(BaseHTTPRequestHandler):  # a replica's /get_server_info, on a real loopback socket
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps({"model_id": "m", "kv_block_size": 32}).encode()
            self.send_response(200 if self.path == "/get_server_info" else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        spec = ClusterSpec(replicas=2, first_replica_port=port, policy="kv_aware", kv_events_first_port=7000)
        flags = [replica_command(spec, i) for i in range(2)]
        for i, cmd in enumerate(flags):
            assert cmd[cmd.index("--kv-events-endpoint") + 1] == f"tcp://127.0.0.1:{7000 + 2 * i}"
            assert cmd[cmd.index("--kv-events-replay-endpoint") + 1] == f"tcp://127.0.0.1:{7001 + 2 * i}"
        cmd = router_command(spec, 9999)
        urls = spec.replica_urls()
        assert cmd[cmd.index("--kv-event-block-size") + 1] == "32" and cmd[cmd.index("--kv-event-model") + 1] == "m"
        sources = [cmd[k + 1] for k, a in enumerate(cmd) if a == "--kv-event-source"]
        replays = [cmd[k + 1] for k, a in enumerate(cmd) if a == "--kv-event-replay-source"]
        assert sources == [f"{urls[0]}=tcp://127.0.0.1:7000", f"{urls[1]}=tcp://127.0.0.1:7002"]
        assert replays == [f"{urls[0]}=tcp://127.0.0.1:7001", f"{urls[1]}=tcp://127.0.0.1:7003"]
        # other policies: no event sockets unless asked
        plain = ClusterSpec(replicas=2, first_replica_port=port, policy="cache_aware")
        assert "--kv-events-endpoint" not in replica_command(plain, 0)
        assert "--kv-event-source" not in router_command(plain, 9999)
    finally:
        server.shutdown()
