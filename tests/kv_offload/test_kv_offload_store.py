"""The KV tiers' store on its own (no engine, no torch): codec, disk tier, Redis tier, the writer's back-pressure."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Sequence

import pytest
import redis

from chatserve.kv_offload import (
    FORMAT_VERSION,
    DecodeError,
    DiskTier,
    KVFingerprint,
    KVOffloadStore,
    RedisTier,
    TierSecret,
    WriteJob,
    block_keys,
    decode_entry,
    encode_entry,
    kv_code_hash,
    library_versions,
)
from chatserve.kv_offload.tier import Tier
from tests.helpers.redis_server import redis_answers

BS = 4
FP = b"\x01" * 16
OTHER_FP = b"\x02" * 16
PAYLOAD = 64


def _tokens(n_blocks: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i * 7) % 50000 for i in range(n_blocks * BS)]


def _jobs(store: KVOffloadStore, tokens: list[int], n: int, start: int = 0) -> list[WriteJob]:
    keys = block_keys(tokens, BS, n, store.fingerprint)
    return [WriteJob(store.name_of(keys[i]), keys[i], tuple(tokens[i * BS : (i + 1) * BS]), bytes([i % 256]) * PAYLOAD)
            for i in range(start, n)]


def _block_tokens(tokens: list[int], n: int) -> list[list[int]]:
    return [tokens[i * BS : (i + 1) * BS] for i in range(n)]


# ---- keys, fingerprint, codec ------------------------------------------------------------------


def test_keys_chain_the_whole_prefix_and_the_fingerprint() -> None:
    a = _tokens(3)
    b = list(a)
    b[1] += 1  # differs in block 0 only
    ka, kb = block_keys(a, BS, 3, FP), block_keys(b, BS, 3, FP)
    assert all(x != y for x, y in zip(ka, kb)), "a block's key names its whole prefix"
    assert block_keys(a, BS, 3, FP) == ka, "deterministic"
    assert all(x != y for x, y in zip(ka, block_keys(a, BS, 3, OTHER_FP))), "another model, other names"
    with pytest.raises(ValueError, match="need 16 tokens"):
        block_keys(a[:10], BS, 4, FP)


def test_fingerprint_changes_with_anything_that_changes_bytes() -> None:
    base = dict(model_hash="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                kv_layout="cpu", kernels="avx512_bf16", device_type="cpu")
    d0 = KVFingerprint(**base).digest
    assert KVFingerprint(**base).digest == d0
    for field, other in [("model_hash", "n"), ("dtype", "float32"), ("block_size", 32), ("kv_layout", "torch"),
                         ("kernels", "avx2"), ("head_dim", 32)]:
        assert KVFingerprint(**{**base, field: other}).digest != d0, field


def test_codec_round_trip_and_every_failure_is_a_named_reason() -> None:
    tokens = list(range(BS))
    key = block_keys(tokens, BS, 1, FP)[0]
    entry = encode_entry(key, FP, tokens, b"\xab" * PAYLOAD)
    assert bytes(decode_entry(entry, key=key, fingerprint=FP, token_ids=tokens, payload_len=PAYLOAD)) == b"\xab" * PAYLOAD
    cases = {
        "truncated": entry[: len(entry) - 9],
        "foreign": encode_entry(key, OTHER_FP, tokens, b"\xab" * PAYLOAD),
        "corrupt": entry[:55] + bytes([entry[55] ^ 1]) + entry[56:],  # a token id
    }
    flipped = bytearray(entry)
    flipped[-20] ^= 0xFF  # inside the payload
    cases["corrupt_payload"] = bytes(flipped)
    for name, data in cases.items():
        with pytest.raises(DecodeError) as info:
            decode_entry(data, key=key, fingerprint=FP, token_ids=tokens, payload_len=PAYLOAD)
        assert info.value.reason == name.split("_")[0], name
    other_key = block_keys([9] * BS, BS, 1, FP)[0]
    with pytest.raises(DecodeError, match="mismatch"):
        decode_entry(entry, key=other_key, fingerprint=FP)
    with pytest.raises(DecodeError, match="mismatch"):
        decode_entry(entry, key=key, fingerprint=FP, token_ids=[5] * BS)
    with pytest.raises(DecodeError, match="foreign"):
        decode_entry(entry, key=key, fingerprint=FP, payload_len=PAYLOAD * 2)
    with pytest.raises(DecodeError, match="foreign"):
        decode_entry(b"x" * 200, key=key, fingerprint=FP)


# ---- the disk tier -----------------------------------------------------------------------------


def test_disk_tier_round_trip_survives_a_restart_and_refuses_bad_entries(tmp_path) -> None:
    tokens = _tokens(6)
    store = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD)
    assert store.submit(_jobs(store, tokens, 6)) == 6
    assert store.flush()
    store.close()
    assert not list(tmp_path.rglob("*.tmp")), "writes are temp file + rename: nothing half-written is left"

    again = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD)  # a new process: the index is rebuilt
    keys = block_keys(tokens, BS, 6, FP)
    run = again.load_run(keys, _block_tokens(tokens, 6))
    assert run.stop == "complete" and run.tiers == ["disk"] * 6
    assert [bytes(p)[:1] for p in run.payloads] == [bytes([i]) for i in range(6)]

    disk = again.tiers[0]
    assert isinstance(disk, DiskTier)
    paths = [disk.path_of(again.name_of(k)) for k in keys]
    with open(paths[2], "r+b") as f:  # corrupt block 2
        f.seek(-12, os.SEEK_END)
        f.write(b"\x00\xff\x00")
    run = again.load_run(keys, _block_tokens(tokens, 6))
    assert len(run.payloads) == 2 and run.stop == "invalid:corrupt"
    assert again.stats["disk"].invalid["corrupt"] == 1
    assert not os.path.exists(paths[2]), "an invalid entry is deleted"
    with open(paths[1], "r+b") as f:  # truncate block 1
        f.truncate(30)
    # a foreign model's entry where block 0's should be
    foreign = KVOffloadStore([DiskTier(tmp_path / "other", 1 << 20)], OTHER_FP, PAYLOAD)
    fkey = keys[0]
    with open(paths[0], "wb") as f:
        f.write(encode_entry(fkey, OTHER_FP, tokens[:BS], b"\x07" * PAYLOAD))
    foreign.close()
    run = again.load_run(keys, _block_tokens(tokens, 6))
    assert run.payloads == [] and run.stop == "invalid:foreign"
    assert again.stats["disk"].invalid["foreign"] == 1
    run = again.load_run(keys[1:], _block_tokens(tokens, 6)[1:])
    assert run.payloads == [] and run.stop == "invalid:truncated"
    assert again.stats["disk"].invalid["truncated"] == 1
    again.close()


def test_disk_tier_is_bounded_least_recently_used_first(tmp_path) -> None:
    tokens = _tokens(8)
    entry_bytes = len(encode_entry(b"k" * 16, FP, tokens[:BS], b"x" * PAYLOAD))
    disk = DiskTier(tmp_path, 3 * entry_bytes)  # room for three entries
    store = KVOffloadStore([disk], FP, PAYLOAD)
    keys = block_keys(tokens, BS, 8, FP)
    store.submit(_jobs(store, tokens, 3))
    store.flush()
    assert store.load_run(keys[:1], _block_tokens(tokens, 1)).stop == "complete"  # block 0 is now the newest
    store.submit(_jobs(store, tokens, 5, start=3))  # blocks 3, 4
    store.flush()
    assert disk.total_bytes <= disk.max_bytes and disk.num_evicted == 2
    names = [store.name_of(k) for k in keys]
    present = [os.path.exists(disk.path_of(n)) for n in names[:5]]
    assert present == [True, False, False, True, True], "blocks 1 and 2 were the least recently used"
    store.close()
    assert DiskTier(tmp_path, 3 * entry_bytes).total_bytes == 3 * entry_bytes  # the bound holds across restarts


def test_disk_write_errors_are_counted_never_raised(tmp_path) -> None:
    (tmp_path / FP.hex()[:16]).write_text("a file where the model's folder should be")
    store = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD)
    tokens = _tokens(3)
    assert store.submit(_jobs(store, tokens, 3)) == 3
    assert store.flush()
    disk = store.tiers[0]
    assert disk.write_errors == 3 and store.stats["disk"].written_blocks == 0
    assert store.load_run(block_keys(tokens, BS, 3, FP), _block_tokens(tokens, 3)).stop == "absent"
    store.close()


# ---- back-pressure -----------------------------------------------------------------------------


class _StuckTier(Tier):
    """A tier whose writes hang until released: a disk or Redis that stopped keeping up."""

    name = "disk"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.stored: dict[str, bytes] = {}

    def get_run(self, names: Sequence[str]) -> list[bytes]:
        out = []
        for n in names:
            if n not in self.stored:
                break
            out.append(self.stored[n])
        return out

    def count_run(self, names: Sequence[str]) -> int:
        return len(self.get_run(names))

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        self.entered.set()
        self.release.wait(30)
        self.stored.update(items)
        return sum(len(v) for _, v in items)

    def delete(self, name: str) -> None:
        self.stored.pop(name, None)


def test_a_full_write_queue_drops_and_counts_never_blocks() -> None:
    tier = _StuckTier()
    store = KVOffloadStore([tier], FP, PAYLOAD, max_queue_bytes=3 * PAYLOAD, batch_blocks=1)
    tokens = _tokens(10)
    jobs = _jobs(store, tokens, 10)
    assert store.submit(jobs[:1]) == 1
    assert tier.entered.wait(10)  # the writer holds block 0 (it still counts in the queue's bytes)
    accepted = store.submit(jobs[1:])  # returns at once
    assert accepted == 2 and store.dropped_blocks == 7 and store.dropped_bytes == 7 * PAYLOAD
    assert store.room_for(5) == 0
    tier.release.set()
    assert store.flush()
    assert len(tier.stored) == 3 and store.room_for(5) == 3
    store.close()


# ---- the Redis tier ----------------------------------------------------------------------------


@pytest.fixture
def redis_db9() -> Iterator[tuple[str, str]]:
    url = "redis://127.0.0.1:6379/9"
    if not redis_answers(url):
        pytest.skip(f"no Redis at {url}")
    prefix = f"chatserve-test-kv-{uuid.uuid4().hex}:"
    yield url, prefix
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)


def test_redis_tier_shared_bounded_and_expiring(redis_db9) -> None:
    url, prefix = redis_db9
    tokens = _tokens(6)
    entry_bytes = len(encode_entry(b"k" * 16, FP, tokens[:BS], b"x" * PAYLOAD))
    writer = KVOffloadStore([RedisTier(url, prefix=prefix, ttl_s=60, max_bytes=4 * entry_bytes)], FP, PAYLOAD)
    writer.submit(_jobs(writer, tokens, 3))
    writer.flush()
    reader = KVOffloadStore([RedisTier(url, prefix=prefix, ttl_s=60)], FP, PAYLOAD)  # another replica
    keys = block_keys(tokens, BS, 6, FP)
    run = reader.load_run(keys, _block_tokens(tokens, 6))
    assert run.tiers == ["redis"] * 3 and run.stop == "absent"
    with redis.Redis.from_url(url) as client:
        ttl = client.pttl(f"{prefix}{FP.hex()}:{keys[0].hex()}")
        assert 0 < ttl <= 60_000
    writer.submit(_jobs(writer, tokens, 6, start=3))
    writer.flush()
    with redis.Redis.from_url(url) as client:
        assert len([k for k in client.scan_iter(f"{prefix}*") if not k.endswith(b":lru")]) == 4, "size bound"
    # a corrupted value is a counted miss and is deleted
    with redis.Redis.from_url(url) as client:
        client.set(f"{prefix}{FP.hex()}:{keys[5].hex()}", b"garbage" * 20)
    run = reader.load_run(keys[5:], _block_tokens(tokens, 6)[5:])
    assert run.payloads == [] and reader.stats["redis"].invalid["foreign"] == 1
    writer.close()
    reader.close()


def test_redis_down_is_a_miss_and_a_dropped_write() -> None:
    from tests.helpers.net import free_port

    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, retry_after_s=60)
    store = KVOffloadStore([tier], FP, PAYLOAD)
    tokens = _tokens(2)
    store.submit(_jobs(store, tokens, 2))
    store.flush()
    assert tier.write_errors == 2 and not tier.available()
    run = store.load_run(block_keys(tokens, BS, 2, FP), _block_tokens(tokens, 2))
    assert run.payloads == [] and run.stop == "unavailable"
    store.close()


# ---- issue 51: what the fingerprint covers, one format version, the secret -----------------------


def test_fingerprint_covers_rope_code_libraries_kv_dtype_and_salt() -> None:
    base = dict(model_hash="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                kv_layout="cpu", kernels="avx512_bf16", device_type="cpu")
    fp = KVFingerprint(**base)
    assert fp.code_hash == kv_code_hash() and fp.libraries == library_versions(), "filled for the running process"
    assert (fp.rope, fp.rope_max_positions, fp.kv_dtype, fp.salt_domain, fp.format_version) == ("", 0, "", "", FORMAT_VERSION)
    for field, other in [("rope", '{"rotary":{}}'), ("rope_max_positions", 4096), ("code_hash", "0" * 64),
                         ("libraries", "torch=0"), ("kv_dtype", "fp8_e4m3"), ("salt_domain", "tenant-a"),
                         ("format_version", FORMAT_VERSION - 1)]:
        assert KVFingerprint(**base, **{field: other}).digest != fp.digest, field
    tables = {"rotary": {"parameters": {"rope_type": "longrope"}, "max_positions": 128, "inv_freq_sha256": "ab"}}
    roped = fp.with_rope(tables)
    assert roped.rope_max_positions == 128 and roped.digest != fp.digest
    assert fp.with_rope({"rotary": {**tables["rotary"], "max_positions": 64}}).digest != roped.digest


def test_the_format_version_is_one_number_in_every_entry() -> None:
    import struct

    entry = encode_entry(b"k" * 16, FP, list(range(BS)), b"x" * PAYLOAD)
    assert struct.unpack_from("<4sH", entry)[1] == FORMAT_VERSION
    old = bytearray(entry)
    struct.pack_into("<H", old, 4, FORMAT_VERSION - 1)
    with pytest.raises(DecodeError, match="foreign"):
        decode_entry(bytes(old), key=b"k" * 16, fingerprint=FP)


def test_the_code_hash_changes_with_one_byte_of_a_kernel_source(tmp_path) -> None:
    from tests.helpers.kv_code import copy_kv_code, edited_kv_code

    assert kv_code_hash(str(copy_kv_code(tmp_path / "same"))) == kv_code_hash(), "the same sources, the same hash"
    assert kv_code_hash(str(edited_kv_code(tmp_path / "edited"))) != kv_code_hash()


def test_library_versions_are_read_without_importing_the_libraries() -> None:
    import subprocess
    import sys

    code = ("import sys; from chatserve.kv_offload.fingerprint import library_versions as v; s = v(); "
            "assert 'torch=' in s and 'transformers=' in s, s; "
            "assert not {'torch', 'transformers', 'gguf'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_secret_keys_the_mac_and_every_other_entry_is_refused() -> None:
    tokens = list(range(BS))
    key = block_keys(tokens, BS, 1, FP)[0]
    s1, s2 = TierSecret.from_secret("s" * 32), TierSecret.from_secret("t" * 32)
    assert TierSecret.from_secret(None) is None and TierSecret.from_secret("") is None
    assert "s" * 32 not in repr(s1) and s1.mac_key not in repr(s1).encode()
    mine = encode_entry(key, FP, tokens, b"\xab" * PAYLOAD, s1.mac_key)
    assert bytes(decode_entry(mine, key=key, fingerprint=FP, token_ids=tokens, mac_key=s1.mac_key)) == b"\xab" * PAYLOAD
    refused = {
        "written without the secret": (encode_entry(key, FP, tokens, b"\xab" * PAYLOAD), s1.mac_key, "foreign"),
        "written with another secret": (encode_entry(key, FP, tokens, b"\xab" * PAYLOAD, s2.mac_key), s1.mac_key, "corrupt"),
        "a reader without the secret": (mine, None, "foreign"),
        "one payload byte forged": (mine[:-40] + bytes([mine[-40] ^ 1]) + mine[-39:], s1.mac_key, "corrupt"),
        "the MAC cut off": (mine[:-24], s1.mac_key, "truncated"),
    }
    for what, (data, mac_key, reason) in refused.items():
        with pytest.raises(DecodeError) as info:
            decode_entry(data, key=key, fingerprint=FP, token_ids=tokens, mac_key=mac_key)
        assert info.value.reason == reason, what


def test_under_a_secret_names_cannot_be_guessed_and_forged_entries_are_misses(tmp_path) -> None:
    tokens = _tokens(3)
    secret = TierSecret.from_secret("a-kv-offload-secret-of-32-chars!")
    plain = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD)
    keyed = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD, secret=secret)
    other = KVOffloadStore([DiskTier(tmp_path, 1 << 20)], FP, PAYLOAD, secret=TierSecret.from_secret("b" * 32))
    keys = block_keys(tokens, BS, 3, FP)
    names = [keyed.name_of(k) for k in keys]
    assert not {k.hex() for k in keys} & {n.split("/")[1] for n in names}, "a chain key (computable from a guess) is no name"
    assert not set(names) & {other.name_of(k) for k in keys}, "another secret, other names"
    # entries written without the secret and with another one, planted under the keyed names
    disk = keyed.tiers[0]
    for store in (plain, other):
        for i, job in enumerate(_jobs(store, tokens, 3)):
            os.makedirs(os.path.dirname(disk.path_of(names[i])), exist_ok=True)
            with open(disk.path_of(names[i]), "wb") as f:
                f.write(encode_entry(store.stored_key(job.key), FP, job.token_ids, job.payload, store._mac_key))
        run = keyed.load_run(keys, _block_tokens(tokens, 3))
        assert run.payloads == [] and run.stop.startswith("invalid:"), run.stop
    assert keyed.stats["disk"].invalid["foreign"] == 1 and keyed.stats["disk"].invalid["corrupt"] == 1
    for name in names:  # (a reader deletes the first invalid entry of a run; the tier keeps what it holds)
        disk.delete(name)
    assert keyed.submit(_jobs(keyed, tokens, 3)) == 3 and keyed.flush()
    run = keyed.load_run(keys, _block_tokens(tokens, 3))
    assert run.stop == "complete" and [bytes(p) for p in run.payloads] == [bytes([i]) * PAYLOAD for i in range(3)]
    assert plain.load_run(keys, _block_tokens(tokens, 3)).stop == "absent", "the keyed entries are not under plain names"
    for store in (plain, keyed, other):
        store.close()
