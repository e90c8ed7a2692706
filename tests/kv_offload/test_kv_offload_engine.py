"""The KV tiers below the radix tree through the engine: restarts, replicas, outages, bad entries, aborts.

Every check that matters for a user is "tokens after a tier load are bit for bit a cold run's": greedy
tokens *and* their logprobs (floats compared exactly) equal an engine that has no tiers at all.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator

import pytest
import redis

from chatserve import LLM, SamplingParams
from chatserve.cache.kv_events import event_hashes
from chatserve.core.session_kv import SessionKV
from chatserve.kv_offload import DiskTier, block_keys
from chatserve.server.chat.cache_usage import prefix_cache_report
from tests.helpers.redis_server import REDIS_SERVER, RedisProcess, redis_answers

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)


def _prompt(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """Engines a test builds; closed (threads stopped, tiers flushed) however the test ends."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.engine.close()


def _make(made: list[LLM], folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_num_seqs", 4)
    llm = LLM(None if folder is None else str(folder), block_size=BS, **kw)
    made.append(llm)
    return llm


def _run(llm: LLM, ids: list[int], **kw):
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, **kw)[0]
    c = out.outputs[0]
    return out, (list(c.token_ids), [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])


def _written_and_closed(made: list[LLM], folder, directory, ids: list[int]) -> LLM:
    """An engine that served `ids` writing through to the disk tier at `directory`, then closed (its
    process gone, as far as the next engine on that directory can tell)."""
    llm = _make(made, folder, kv_offload_dir=str(directory), kv_offload_policy="write_through")
    _run(llm, ids)
    llm.engine.close()
    made.remove(llm)
    return llm


def _full_blocks(ids: list[int]) -> int:
    return (len(ids) - 1) // BS * BS


def _assert_idle_and_whole(llm: LLM) -> None:
    e = llm.engine
    e.check_integrity()
    s = e.block_manager.cache.stats()
    assert s.locked == 0 and s.free + s.evictable == s.total, s
    assert not e.waiting_for_kv and not e.requests


@pytest.fixture(scope="module")
def cold(tiny):
    """Greedy tokens + logprobs of each prompt on an engine without tiers (the reference)."""
    llm = LLM(str(tiny), block_size=BS, num_kv_blocks=64)
    cache: dict[tuple[int, str], tuple] = {}

    def get(seed: int, dtype: str = "auto", kv_cache_dtype: str = "auto"):
        if (seed, dtype, kv_cache_dtype) not in cache:
            ref = llm if (dtype, kv_cache_dtype) == ("auto", "auto") else LLM(
                str(tiny), block_size=BS, num_kv_blocks=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
            assert ref.engine.reset_prefix_cache()
            cache[(seed, dtype, kv_cache_dtype)] = _run(ref, _prompt(seed))[1]
        return cache[(seed, dtype, kv_cache_dtype)]

    return get


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_restart_is_warm_from_disk_and_bit_identical(tiny, tmp_path, engines, cold, policy) -> None:
    ids = _prompt(1)
    first = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy=policy)
    out, got = _run(first, ids)
    assert out.num_cached_tokens == 0 and got == cold(1)
    first.engine.close()  # write-back: the tree goes to disk now
    engines.remove(first)

    second = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy=policy)
    out, got = _run(second, ids)
    assert out.num_cached_tokens == _full_blocks(ids) == out.stats.num_disk_cached_tokens
    assert out.stats.kv_tier_stop == "complete"
    assert got == cold(1), "tokens and logprobs after a disk load equal a cold run's, bit for bit"
    report = prefix_cache_report(out.stats)
    assert report["tiers"] == {"memory": 0, "disk": _full_blocks(ids), "redis": 0, "tier_miss_reason": "complete"}
    _assert_idle_and_whole(second)
    out, _ = _run(second, ids)  # now a plain memory hit: no lookup
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop is None
    assert prefix_cache_report(out.stats)["tiers"]["memory"] == _full_blocks(ids)


def test_restart_warm_on_the_default_model(tmp_path, engines) -> None:
    """The shipped GGUF on this host's kernels (quantized matmuls, the CPU attention's own K/V layout)."""
    ids = _prompt(2, 100)
    first = _make(engines, None, num_kv_blocks=32, max_model_len=256, kv_offload_dir=str(tmp_path),
                  kv_offload_policy="write_through")
    out, want = _run(first, ids)  # a cold run (the tiers only copy blocks out)
    assert out.num_cached_tokens == 0
    first.engine.close()
    second = _make(engines, None, num_kv_blocks=32, max_model_len=256, kv_offload_dir=str(tmp_path))
    out, got = _run(second, ids)
    assert out.stats.num_disk_cached_tokens == _full_blocks(ids) and got == want


@pytest.fixture
def redis9() -> Iterator[dict]:
    url = "redis://127.0.0.1:6379/9"
    if not redis_answers(url):
        pytest.skip(f"no Redis at {url}")
    prefix = f"chatserve-test-kv-{uuid.uuid4().hex}:"
    yield {"kv_offload_redis_url": url, "kv_offload_redis_prefix": prefix}
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
        assert not list(client.scan_iter(f"{prefix}*"))


def test_second_replica_is_warm_from_redis(tiny, engines, cold, redis9) -> None:
    ids = _prompt(3)
    a = _make(engines, tiny, kv_offload_policy="write_through", **redis9)
    _, got = _run(a, ids)
    assert got == cold(3)
    assert a.engine.kv_tiering.store.flush()
    b = _make(engines, tiny, **redis9)  # never saw the prompt; shares only Redis
    out, got = _run(b, ids)
    assert out.stats.num_redis_cached_tokens == _full_blocks(ids) == out.num_cached_tokens
    assert got == cold(3)
    _assert_idle_and_whole(b)
    st = b.engine.stats()["kv_offload"]["tiers"]["redis"]
    assert st["hit_blocks"] == _full_blocks(ids) // BS and st["read_bytes"] > 0


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_redis_down_mid_run_the_engine_goes_on_with_memory_and_disk(tiny, tmp_path, engines, cold) -> None:
    server = RedisProcess()
    server.start()
    try:
        args = dict(kv_offload_dir=str(tmp_path), kv_offload_redis_url=server.url, kv_offload_policy="write_through")
        a = _make(engines, tiny, **args)
        _, got = _run(a, _prompt(4))
        assert got == cold(4)
        assert a.engine.kv_tiering.store.flush()
        server.freeze()  # connections stay open, nothing answers: timeouts
        _, got = _run(a, _prompt(5))  # a new prompt: its lookup asks Redis, which times out
        assert got == cold(5)
        assert a.engine.kv_tiering.store.flush(30)
        redis_stats = a.engine.stats()["kv_offload"]["tiers"]["redis"]
        assert redis_stats["available"] is False and redis_stats["read_errors"] + redis_stats["write_errors"] > 0
        server.kill()
        a.engine.close()
        engines.remove(a)
        b = _make(engines, tiny, **args)  # restart with Redis gone: disk still serves
        for seed in (4, 5):
            out, got = _run(b, _prompt(seed))
            assert out.stats.num_disk_cached_tokens == _full_blocks(_prompt(seed)) and got == cold(seed)
        _assert_idle_and_whole(b)
    finally:
        server.kill()


def test_a_full_disk_bounds_the_tier_and_costs_only_hits(tiny, tmp_path, engines, cold) -> None:
    ids = _prompt(6)
    a = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy="write_through",
              kv_offload_max_gb=3.5 * 4300 / 2**30)  # about three of this model's blocks
    _, got = _run(a, ids)
    assert got == cold(6)
    assert a.engine.kv_tiering.store.flush()
    disk = a.engine.kv_tiering.store.tiers[0]
    assert isinstance(disk, DiskTier) and disk.total_bytes <= disk.max_bytes and disk.num_evicted > 0
    a.engine.close()
    engines.remove(a)
    b = _make(engines, tiny, kv_offload_dir=str(tmp_path))
    out, got = _run(b, ids)  # the first blocks were evicted first: no run starts at block 0
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "absent" and got == cold(6)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / b.engine.kv_tiering.fingerprint.hex[:16]).write_text("a file where the model's folder belongs")
    c = _make(engines, tiny, kv_offload_dir=str(broken), kv_offload_policy="write_through")
    _, got = _run(c, ids)
    assert got == cold(6)
    assert c.engine.kv_tiering.store.flush()
    assert c.engine.stats()["kv_offload"]["tiers"]["disk"]["write_errors"] == _full_blocks(ids) // BS


def test_corrupted_truncated_and_foreign_entries_are_counted_misses(tiny, tmp_path, engines, cold) -> None:
    ids = _prompt(7)
    a = _written_and_closed(engines, tiny, tmp_path, ids)
    tiering = a.engine.kv_tiering
    disk = tiering.store.tiers[0]
    keys = block_keys(ids[:-1], BS, _full_blocks(ids) // BS, tiering.fp)
    paths = [disk.path_of(tiering.store.name_of(k)) for k in keys]
    with open(paths[3], "r+b") as f:  # a flipped byte in block 3's KV
        f.seek(os.path.getsize(paths[3]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(paths[6], "r+b") as f:
        f.truncate(100)

    b = _make(engines, tiny, kv_offload_dir=str(tmp_path))
    out, got = _run(b, ids)
    assert out.stats.num_disk_cached_tokens == 3 * BS and out.stats.kv_tier_stop == "invalid:corrupt"
    assert got == cold(7), "blocks 0-2 loaded, the rest recomputed: same tokens"
    assert b.engine.stats()["kv_offload"]["tiers"]["disk"]["invalid_entries"]["corrupt"] == 1
    _assert_idle_and_whole(b)

    # another dtype is another model as far as KV bytes go: its own names, and an entry of ours copied
    # under its name is refused as foreign
    f32 = _make(engines, tiny, dtype="float32", kv_offload_dir=str(tmp_path))
    t32 = f32.engine.kv_tiering
    assert t32.fp != tiering.fp
    k32 = block_keys(ids[:-1], BS, 1, t32.fp)[0]
    p32 = t32.store.tiers[0].path_of(t32.store.name_of(k32))
    os.makedirs(os.path.dirname(p32), exist_ok=True)
    with open(paths[0], "rb") as src, open(p32, "wb") as dst:
        dst.write(src.read())
    out, got = _run(f32, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:foreign"
    assert got == cold(7, "float32")
    assert f32.engine.stats()["kv_offload"]["tiers"]["disk"]["invalid_entries"]["foreign"] == 1


def test_abort_during_a_load_frees_everything(tiny, tmp_path, engines) -> None:
    ids = _prompt(8)
    _written_and_closed(engines, tiny, tmp_path, ids)
    b = _make(engines, tiny, kv_offload_dir=str(tmp_path), max_num_seqs=1)
    e = b.engine
    # 1. aborted while its lookup runs (or right after it landed, before its blocks were taken)
    e.add_request("r1", {"prompt_token_ids": ids}, GREEDY)
    assert "r1" in e.waiting_for_kv
    e.abort_request("r1")
    _assert_idle_and_whole(b)
    assert e.block_manager.cache.stats().evictable == 0, "nothing was loaded for an aborted lookup"

    # 2. aborted after its blocks were loaded and locked, while it waits for a slot in the batch
    e.add_request("busy", {"prompt_token_ids": _prompt(9, 40)}, SamplingParams(temperature=0.0, max_tokens=30))
    e.step()
    req = e.add_request("r2", {"prompt_token_ids": ids}, GREEDY)
    req.kv_load_future.result(timeout=30)
    e.step()  # the load lands: blocks into the tree, r2 waits behind "busy" (max_num_seqs=1)
    seq = req.seqs[0]
    assert seq.prefetch_node is not None and not seq.block_table
    assert e.block_manager.cache.stats().locked >= _full_blocks(ids) // BS
    e.check_integrity()
    e.abort_request("r2")
    assert seq.prefetch_node is None
    e.abort_request("busy")
    _assert_idle_and_whole(b)
    assert e.block_manager.cache.stats().evictable >= _full_blocks(ids) // BS, "the loaded blocks stay cached"


def test_a_lookup_landing_during_the_last_idle_step_still_wakes_the_async_loop(tiny, tmp_path, engines, cold) -> None:
    """The lost wake-up (seen as a session turn that never answered after a restart, one run in four on
    one thread): the lookup lands while the loop's last idle step is in flight, its wake-up sets the
    loop's event then, and the loop, going idle right after that step, clears the event and sleeps.
    Here the lookup is made to land exactly there; the request must still be served."""
    import asyncio
    import concurrent.futures

    from chatserve import AsyncLLMEngine, EngineArgs
    from chatserve.engine import async_engine

    ids = _prompt(10)
    _written_and_closed(engines, tiny, tmp_path, ids)
    aengine = AsyncLLMEngine.from_engine_args(EngineArgs.from_env(model=str(tiny), block_size=BS, num_kv_blocks=64,
                                                                  max_num_seqs=4, kv_offload_dir=str(tmp_path)))
    tiers = aengine.engine.kv_tiering
    assert tiers is not None
    land: list = []

    def submit_lookup(prompt, tree_tokens):  # the real lookup, run when the test says so
        future: concurrent.futures.Future = concurrent.futures.Future()
        land.append(lambda: future.set_result(tiers._lookup(list(prompt[:-1]), tree_tokens // BS)))
        return future

    tiers.submit_lookup = submit_lookup
    real_step, idle_steps = aengine._step, []

    def step():
        outputs = real_step()
        if land and aengine.engine.waiting_for_kv:
            idle_steps.append(1)
            if len(idle_steps) == async_engine._MAX_IDLE_STEPS:  # the step after which the loop goes idle
                land.pop()()
        return outputs

    aengine._step = step

    async def serve():
        outputs = [out async for out in aengine.generate({"prompt_token_ids": ids}, GREEDY)]
        await aengine.shutdown()
        return outputs[-1]

    try:
        out = asyncio.run(asyncio.wait_for(serve(), 60))
    finally:
        aengine.engine.close()
    assert len(idle_steps) == async_engine._MAX_IDLE_STEPS and not land
    c = out.outputs[0]
    assert out.stats.num_disk_cached_tokens == _full_blocks(ids)
    assert (list(c.token_ids), [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs]) == cold(10)


def test_a_burst_after_a_restart_reads_the_prefix_once(tiny, tmp_path, engines, cold) -> None:
    ids = _prompt(12)
    _written_and_closed(engines, tiny, tmp_path, ids)
    b = _make(engines, tiny, kv_offload_dir=str(tmp_path), max_num_seqs=1)  # (one at a time: outputs comparable bit for bit)
    e = b.engine
    for i in range(4):
        e.add_request(f"r{i}", {"prompt_token_ids": ids}, GREEDY)
    assert e.kv_tiering.num_lookups == 1, "followers share the leader's lookup"
    e.abort_request("r0")  # the leader goes: r1 takes its lookup over
    outs = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                outs[out.request_id] = out
    assert sorted(outs) == ["r1", "r2", "r3"] and e.kv_tiering.num_lookups == 1
    for out in outs.values():
        c = out.outputs[0]
        assert out.num_cached_tokens == _full_blocks(ids)
        assert (list(c.token_ids), [{t: lp.logprob for t, lp in x.items()} for x in c.logprobs]) == cold(12)
    assert outs["r1"].stats.num_disk_cached_tokens == _full_blocks(ids)
    _assert_idle_and_whole(b)


def test_a_full_write_queue_drops_writes_and_counts_them(tiny, tmp_path, engines, cold) -> None:
    a = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy="write_through",
              kv_offload_queue_mb=0.001)  # smaller than one block: every write is dropped
    _, got = _run(a, _prompt(10))
    assert got == cold(10)
    assert a.engine.kv_tiering.store.flush()
    st = a.engine.stats()["kv_offload"]
    assert st["dropped_blocks"] == _full_blocks(_prompt(10)) // BS and st["tiers"]["disk"]["written_blocks"] == 0


def test_events_sessions_and_metrics_see_the_tiers(tiny, tmp_path, engines) -> None:
    from prometheus_client import generate_latest

    from chatserve.server.metrics import ServerMetrics

    ids = _prompt(11)
    a = _make(engines, tiny, kv_offload_dir=str(tmp_path))  # write-back: only the session's lease writes through
    a.engine.kv_tiering.record_events = True  # (what --kv-events-endpoint turns on; drained below instead of published)
    a.engine.add_request("s-turn", {"prompt_token_ids": ids}, GREEDY, session=SessionKV("sess-1", lease_seconds=60))
    while a.engine.has_unfinished_requests():
        a.engine.step()
    assert a.engine.kv_tiering.store.flush()
    history = ids  # the stored history of the session: its prompt (and reply)
    report = a.engine.session_cache_report("sess-1", history)
    assert report["tiers"] == {"memory": _full_blocks(ids) + BS * (len(ids) % BS == 0), "disk": len(ids) // BS * BS}
    events = a.engine.kv_tiering.stored_events()
    n = len(ids) // BS
    assert [e.medium for e in events] == ["DISK"] * n
    assert [e.block_hashes[0] for e in events] == event_hashes(ids, BS, n)
    text = generate_latest(ServerMetrics(a.engine.stats, "tiny").registry).decode()
    assert 'chatserve:kv_offload_written_blocks_total{medium="disk",model_name="tiny"}' in text
    assert "chatserve:kv_offload_dropped_blocks_total" in text


def test_tier_flags_are_checked() -> None:
    from chatserve.config import EngineArgs

    with pytest.raises(ValueError, match="kv_offload_policy"):
        EngineArgs(kv_offload_dir="/tmp/x", kv_offload_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_offload_max_gb"):
        EngineArgs(kv_offload_dir="/tmp/x", kv_offload_max_gb=0)
    with pytest.raises(ValueError, match="kv_offload_redis_url"):
        EngineArgs(kv_offload_redis_url="localhost:6379")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(kv_offload_dir="/tmp/x", enable_prefix_caching=False)


# ---- issue 56: 8-bit KV blocks go to the tiers as they are; a bf16 engine's blocks are never an int8 one's ----

def test_int8_blocks_restart_from_disk_and_replicate_through_redis_bit_identical(tiny, tmp_path, engines, cold,
                                                                                 redis9) -> None:
    """An int8 engine writes its 8-bit blocks (quants and scales, head_dim + 4 bytes a row) through to
    disk and Redis; a restarted engine (disk only) and a second replica (Redis only) load them and
    answer as a cold int8 engine does, tokens and logprobs bit for bit."""
    ids = _prompt(21)
    want = cold(21, kv_cache_dtype="int8")
    assert want != cold(21), "the 8-bit cache changes the logprobs at least (else this test tests nothing)"
    first = _make(engines, tiny, kv_cache_dtype="int8", kv_offload_dir=str(tmp_path),
                  kv_offload_policy="write_through", **redis9)
    info = first.engine_info()
    assert info.kv_cache_dtype == "int8"
    assert info.kv_bytes_per_block == 2 * 2 * BS * 2 * (16 + 4)  # layers, K and V, slots, KV heads, head_dim + 4
    assert first.engine.kv_tiering.fingerprint.kv_dtype == "int8"
    out, got = _run(first, ids)
    assert out.num_cached_tokens == 0 and got == want
    assert first.engine.kv_tiering.store.flush()
    first.engine.close()
    engines.remove(first)
    entry = next(p for p in tmp_path.rglob("*.kv"))
    assert info.kv_bytes_per_block < entry.stat().st_size < info.kv_bytes_per_block + 512  # the 8-bit payload and a header

    restarted = _make(engines, tiny, kv_cache_dtype="int8", kv_offload_dir=str(tmp_path))
    out, got = _run(restarted, ids)
    assert out.num_cached_tokens == _full_blocks(ids) == out.stats.num_disk_cached_tokens
    assert got == want, "tokens and logprobs after an int8 disk load equal a cold int8 run's"
    replica = _make(engines, tiny, kv_cache_dtype="int8", **redis9)
    out, got = _run(replica, ids)
    assert out.num_cached_tokens == _full_blocks(ids) == out.stats.num_redis_cached_tokens
    assert got == want
    _assert_idle_and_whole(replica)


def test_a_bf16_writers_blocks_are_never_read_by_an_int8_reader(tiny, tmp_path, engines, cold) -> None:
    """The KV dtype is in the fingerprint: other names, and an entry planted under the int8 engine's
    names is refused as foreign (its payload would even have the wrong size); the reverse alike."""
    ids = _prompt(22)
    n = _full_blocks(ids) // BS
    bf16 = _written_and_closed(engines, tiny, tmp_path / "kv", ids)
    int8 = _make(engines, tiny, kv_cache_dtype="int8", kv_offload_dir=str(tmp_path / "kv"))
    bt, it = bf16.engine.kv_tiering, int8.engine.kv_tiering
    assert (bt.fingerprint.kv_dtype, it.fingerprint.kv_dtype) == ("", "int8") and bt.fp != it.fp
    out, got = _run(int8, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "absent"
    assert got == cold(22, kv_cache_dtype="int8")
    _plant(bt, it, ids, n)
    assert int8.engine.reset_prefix_cache()
    out, got = _run(int8, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:foreign"
    assert got == cold(22, kv_cache_dtype="int8")


# ---- issue 51: entries of another rope, other kernel sources or without the secret are refused ------

SECRET = "0123456789abcdef-kv-offload-secret"


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, smollm_tokenizer):
    """Phi-3 with long-rope past 64 positions (tests/helpers/tiny_families.py)."""
    from tests.helpers.tiny_families import write_family_checkpoint

    return write_family_checkpoint(tmp_path_factory.mktemp("phi3-longrope"), "phi3", smollm_tokenizer)


def _plant(src, dst, ids: list[int], n: int) -> None:
    """Copy the disk entries of blocks 0..n-1 of `ids` that tiering `src` stored to the names tiering
    `dst` looks them up by: what a replica of another configuration (or a forger who learnt the
    names) leaves where this one reads."""
    for ks, kd in zip(src.keys_of(ids[:-1], n), dst.keys_of(ids[:-1], n)):
        a = src.store.tiers[0].path_of(src.store.name_of(ks))
        b = dst.store.tiers[0].path_of(dst.store.name_of(kd))
        assert a != b, "the two configurations name the block alike"
        os.makedirs(os.path.dirname(b), exist_ok=True)
        with open(a, "rb") as fa, open(b, "wb") as fb:
            fb.write(fa.read())


def test_a_phi3_long_rope_entry_written_at_one_max_model_len_is_refused_at_another(phi3, tmp_path, engines) -> None:
    """Long-rope's factors are chosen by max_model_len (long ones past original_max_position_embeddings,
    64 here): a block written at 128 holds keys rotated by other frequencies than at 64, so it must be a
    miss there (its name differs, and planted under this engine's name it is refused as foreign)."""
    ids = _prompt(11, 50)
    n = _full_blocks(ids) // BS
    long = _make(engines, phi3, max_model_len=128, kv_offload_dir=str(tmp_path), kv_offload_policy="write_through")
    _run(long, ids)
    long.engine.close()
    _, want = _run(_make(engines, phi3, max_model_len=64), ids)  # a cold run at 64 (the short factors)
    short = _make(engines, phi3, max_model_len=64, kv_offload_dir=str(tmp_path))
    out, got = _run(short, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "absent" and got == want
    lt, st = long.engine.kv_tiering, short.engine.kv_tiering
    assert (lt.fingerprint.rope_max_positions, st.fingerprint.rope_max_positions) == (128, 64)
    assert lt.fp != st.fp
    _plant(lt, st, ids, n)
    assert short.engine.reset_prefix_cache()
    out, got = _run(short, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:foreign"
    assert got == want, "recomputed with the short factors, never the long ones' blocks"


def test_an_entry_written_by_other_kernel_sources_is_refused(tiny, tmp_path, engines, cold, monkeypatch) -> None:
    """An upgrade that changes a kernel (its rounding, the paged layout) is another fingerprint: old
    replicas' entries in a shared tier are misses for the new code, however they are named."""
    from chatserve.kv_offload import fingerprint
    from tests.helpers.kv_code import edited_kv_code

    ids = _prompt(12)
    old = _written_and_closed(engines, tiny, tmp_path / "kv", ids)
    # (raising=False: on code without the attribute the test fails below, by loading the old entries)
    monkeypatch.setattr(fingerprint, "PACKAGE_ROOT", str(edited_kv_code(tmp_path / "upgraded")), raising=False)
    new = _make(engines, tiny, kv_offload_dir=str(tmp_path / "kv"))
    out, got = _run(new, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "absent" and got == cold(12)
    ot, nt = old.engine.kv_tiering, new.engine.kv_tiering
    assert ot.fingerprint.code_hash != nt.fingerprint.code_hash and ot.fp != nt.fp
    _plant(ot, nt, ids, _full_blocks(ids) // BS)
    assert new.engine.reset_prefix_cache()
    out, got = _run(new, ids)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:foreign"
    assert got == cold(12)
    assert new.engine.stats()["kv_offload"]["tiers"]["disk"]["invalid_entries"]["foreign"] == 1


def test_under_a_secret_forged_entries_are_refused_and_its_own_are_served(tiny, tmp_path, engines, cold) -> None:
    """With --kv-offload-secret, entries written without it or with another secret are misses (never
    errors, never their tokens), even planted under the names this engine reads; its own entries load."""
    from chatserve.kv_offload import TierSecret, encode_entry

    ids = _prompt(13)
    n = _full_blocks(ids) // BS
    plain = _written_and_closed(engines, tiny, tmp_path, ids)  # an engine without the secret
    keyed = _make(engines, tiny, kv_offload_dir=str(tmp_path), kv_offload_policy="write_through",
                  kv_offload_secret=SECRET)
    pt, kt = plain.engine.kv_tiering, keyed.engine.kv_tiering
    assert kt.fp == pt.fp, "the same model: only the names and the MACs differ"
    out, got = _run(keyed, ids)  # (written through under its own names as it goes)
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "absent", "other names"
    assert got == cold(13)

    def reread() -> tuple:
        kt.store.flush()
        assert keyed.engine.reset_prefix_cache()
        return _run(keyed, ids)

    out, got = reread()  # its own entries: their MACs verify
    assert out.stats.num_disk_cached_tokens == n * BS and out.stats.kv_tier_stop == "complete" and got == cold(13)

    _plant(pt, kt, ids, n)  # written without the secret, under our names
    out, got = reread()
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:foreign" and got == cold(13)
    other = TierSecret.from_secret("another-secret-of-some-length")
    disk, keys = kt.store.tiers[0], kt.keys_of(ids[:-1], n)
    for i, key in enumerate(keys):  # written with another secret, under our names
        path = disk.path_of(kt.store.name_of(key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(encode_entry(other.stored_key(key), kt.fp, ids[i * BS : (i + 1) * BS], b"\0" * kt.store.payload_bytes,
                                 other.mac_key))
    out, got = reread()
    assert out.stats.num_disk_cached_tokens == 0 and out.stats.kv_tier_stop == "invalid:corrupt" and got == cold(13)
    invalid = keyed.engine.stats()["kv_offload"]["tiers"]["disk"]["invalid_entries"]
    assert (invalid["foreign"], invalid["corrupt"]) == (1, 1)


def test_the_secret_comes_from_the_environment_and_is_never_shown(capsys) -> None:
    from chatserve.cli import build_parser, options_from_args, parse_args
    from chatserve.config import EngineArgs

    env = {"CHATSERVE_KV_OFFLOAD_SECRET": SECRET}
    args = options_from_args(EngineArgs, parse_args(["serve"], environ=env))
    assert args.kv_offload_secret == SECRET and SECRET not in repr(args)
    with pytest.raises(SystemExit):
        build_parser(env).parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--kv-offload-secret" in help_text and SECRET not in help_text and "CHATSERVE_KV_OFFLOAD_SECRET" in help_text
    with pytest.raises(ValueError, match="at least 16 characters"):
        EngineArgs(kv_offload_dir="/tmp/x", kv_offload_secret="short")


def test_the_rope_fields_follow_the_resolved_rope_and_max_model_len_only_where_it_matters() -> None:
    """Default rope: one table whatever max_model_len (blocks shared across lengths); long-rope and
    dynamic NTK: per length; a changed theta or scaling: another table."""
    import transformers

    from chatserve.models.llama import resolved_rope
    from tests.helpers.tiny_families import hf_config

    def llama(**kw):
        return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=128, **kw)

    plain = resolved_rope(llama(rope_theta=10_000.0), 32, 256)
    assert plain == resolved_rope(llama(rope_theta=10_000.0), 32, 4096) and plain["max_positions"] is None
    assert plain["parameters"]["rope_theta"] == 10_000.0
    assert resolved_rope(llama(rope_theta=500_000.0), 32, 256) != plain
    linear = resolved_rope(llama(rope_scaling={"rope_type": "linear", "factor": 8.0}), 32, 256)
    assert linear["parameters"]["factor"] == 8.0 and linear["inv_freq_sha256"] != plain["inv_freq_sha256"]
    dynamic = llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert resolved_rope(dynamic, 32, 512)["max_positions"] == 512
    assert resolved_rope(dynamic, 32, 512) != resolved_rope(dynamic, 32, 1024)
    phi3 = hf_config("phi3", 256, 1, 2)  # long-rope past 64 positions
    short, long = resolved_rope(phi3, 32, 64), resolved_rope(phi3, 32, 128)
    assert (short["max_positions"], long["max_positions"]) == (64, 128)
    assert short["inv_freq_sha256"] != long["inv_freq_sha256"], "the short factors, then the long ones"
    gemma3 = hf_config("gemma3", 256, 1, 2)
    local = resolved_rope(gemma3, 32, 256, "sliding_attention")
    global_ = resolved_rope(gemma3, 32, 256, "full_attention")
    assert (local["parameters"]["rope_theta"], global_["parameters"]["rope_theta"]) == (10_000.0, 1_000_000.0)
    assert global_["parameters"]["rope_type"] == "linear"
