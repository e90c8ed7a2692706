"""The repacked-weight cache (models/weight_cache.py, issue #33): the first start writes the processed
weights, later starts map them read-only; what they map is bit for bit what a cold load builds, an
entry that no longer matches its source or is damaged is rebuilt (never used, never a crash), each
kernel tier and dtype has its own entry, and two processes starting at once build it once.

The weights are compared as the model holds them after loading (every parameter and every Linear's
packed or quantized layout, byte for byte), which is what every forward reads; one end-to-end test
compares greedy tokens and logprobs too. A tiny GGUF of mixed types (Q4_0, Q6_K in the fused qkv,
an F16 tensor that stays bf16) covers every segment kind of the quantized layers.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from chatserve import LLM, SamplingParams
from chatserve.config import CacheConfig, EngineArgs
from chatserve.layers.ops import select_layer_ops
from chatserve.models.config import ModelConfig
from chatserve.models.loader import load_hf_config, resolve_model
from chatserve.models.weight_cache import ENTRY_SUFFIX, WeightCacheConfig, capture
from chatserve.worker.model_runner import ModelRunner
from tests.helpers import prefork
from tests.helpers.tiny_gguf import Q4_0, Q6_K, write_tiny_gguf

pytest.importorskip("gguf")

F16 = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_gguf) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf", str(default_gguf),
                           {"attn_v": Q6_K, "attn_k": F16}, Q4_0)


@pytest.fixture(scope="module")
def hf_config(tiny):
    """The tiny file's architecture, stated here rather than converted from its metadata by transformers
    (which parses the 49k-token vocabulary: tens of seconds on a busy 2-core host). Every load in this
    module gets the same config, so cold and warm loads differ only by the cache."""
    from transformers import LlamaConfig

    from tests.helpers.tiny_gguf import FF, HEAD_DIM, HEADS, KV_HEADS, LAYERS, H

    return LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       architectures=["LlamaForCausalLM"])


def _runner(path: Path, hf_config, cache_dir: Path | None, tier: str | None, quantization: str = "auto",
            max_bytes: int = 2**40) -> ModelRunner:
    """A model runner as the engine builds one; tier None: float32 through torch (no kernels)."""
    dtype = torch.float32 if tier is None else torch.bfloat16
    cfg = ModelConfig.from_hf(hf_config)
    source = resolve_model(path)
    ops = select_layer_ops(dtype=dtype, device=torch.device("cpu"), attention_backend="auto", cpu_kernels=tier is not None,
                           amx=True, head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           quantization=quantization, is_gguf=source.is_gguf, cpu_kernel_tier=tier or "auto")
    cache = WeightCacheConfig(cache_dir is not None, str(cache_dir) if cache_dir is not None else None, max_bytes)
    return ModelRunner(source, hf_config, cfg, CacheConfig(16, 8), dtype, torch.device("cpu"),
                       max_model_len=64, ops=ops, weight_cache=cache)


def _state(runner: ModelRunner) -> tuple[dict, list[torch.Tensor]]:
    captured = capture(runner.model)
    assert not isinstance(captured, str), captured
    return captured.layout, captured.tensors


def _assert_same_weights(a: ModelRunner, b: ModelRunner) -> None:
    (layout_a, tensors_a), (layout_b, tensors_b) = _state(a), _state(b)
    assert layout_a == layout_b
    assert len(tensors_a) == len(tensors_b) > 0
    for i, (x, y) in enumerate(zip(tensors_a, tensors_b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"tensor {i} differs"


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    target = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(target):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _assert_backed_by(runner: ModelRunner, entry: Path) -> None:
    """Every weight tensor the model holds is a view of a mapping of the entry file (nothing copied)."""
    ranges = _mapped_ranges(entry)
    assert ranges, f"{entry} is not mapped"
    _, tensors = _state(runner)
    for t in tensors:
        if t.numel():
            start = t.data_ptr()
            assert any(lo <= start and start + t.numel() * t.element_size() <= hi for lo, hi in ranges), t.shape


def _tier_params() -> list:
    from tests.conftest import KERNEL_TIERS

    return [*KERNEL_TIERS, None]


@pytest.mark.parametrize("tier", _tier_params(), ids=lambda t: t or "float32")
def test_warm_start_maps_the_entry_and_equals_a_cold_load(tier, tiny, hf_config, tmp_path):
    cold = _runner(tiny, hf_config, None, tier)
    assert cold.weight_cache.status == "off"
    built = _runner(tiny, hf_config, tmp_path, tier)
    assert built.weight_cache.status == "built", built.weight_cache
    entry = built.weight_cache.path
    assert entry is not None and entry.parent == tmp_path and entry.name.endswith(ENTRY_SUFFIX)
    _assert_backed_by(built, entry)  # the builder maps what it wrote, too: its repacked copy is freed
    warm = _runner(tiny, hf_config, tmp_path, tier)
    assert warm.weight_cache.status == "hit" and warm.weight_cache.path == entry, warm.weight_cache
    _assert_backed_by(warm, entry)
    assert _mapped_ranges(tiny) == []  # the GGUF itself is not read at a warm start
    _assert_same_weights(cold, warm)
    _assert_same_weights(cold, built)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [entry.name]  # no temp left


@pytest.mark.parametrize(("arch", "quantization"), [("qwen2", "none"), ("qwen3", "int8")])
def test_a_safetensors_folder_is_cached_too(arch, quantization, tiny_checkpoint, tmp_path):
    """bf16 panels with QKV biases (qwen2), int8 per channel with q/k norms and an untied head (qwen3);
    a changed safetensors file rebuilds the entry."""
    folder = tmp_path / arch
    shutil.copytree(tiny_checkpoint(arch), folder)
    hf = load_hf_config(resolve_model(folder))
    tier = _best_tier()
    cold = _runner(folder, hf, None, tier, quantization)
    built = _runner(folder, hf, tmp_path / "cache", tier, quantization)
    warm = _runner(folder, hf, tmp_path / "cache", tier, quantization)
    assert (built.weight_cache.status, warm.weight_cache.status) == ("built", "hit")
    _assert_backed_by(warm, warm.weight_cache.path)
    _assert_same_weights(cold, warm)
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = _runner(folder, hf, tmp_path / "cache", tier, quantization).weight_cache
    assert touched.status == "built" and weights.name in touched.reason, touched


def test_each_tier_and_dtype_has_its_own_entry(tiny, hf_config, tmp_path):
    from tests.conftest import KERNEL_TIERS

    tiers = [*KERNEL_TIERS[:1], *KERNEL_TIERS[-1:], None]  # the best tier, the lowest (avx2) and float32
    tiers = list(dict.fromkeys(tiers))
    entries = [_runner(tiny, hf_config, tmp_path, t).weight_cache for t in tiers]
    assert [e.status for e in entries] == ["built"] * len(tiers)
    assert len({e.path for e in entries}) == len(tiers)
    for tier, first in zip(tiers, entries):
        again = _runner(tiny, hf_config, tmp_path, tier).weight_cache
        assert (again.status, again.path) == ("hit", first.path)


def test_the_cache_folder_is_bounded_least_recently_used_first(tiny, hf_config, tmp_path):
    """Three models' entries in a folder bounded to two and a half of them: the least recently used
    (by mtime, which a hit refreshes) goes, never the one just written; an entry larger than the
    whole bound is not written and that start keeps its weights in memory, correct."""
    sources = []
    for name in "abc":
        copy = tmp_path / f"{name}.gguf"
        shutil.copyfile(tiny, copy)
        sources.append(copy)
    cache = tmp_path / "cache"
    first = _runner(sources[0], hf_config, cache, None)
    size = first.weight_cache.path.stat().st_size
    bound = int(2.5 * size)
    paths = [first.weight_cache.path]
    for src in sources[1:]:
        for j, p in enumerate(paths):
            os.utime(p, (1_000_000 + j, 1_000_000 + j))  # a, then b: oldest first, whatever the clock's resolution
        built = _runner(src, hf_config, cache, None, max_bytes=bound).weight_cache
        assert built.status == "built"
        paths.append(built.path)
    a, b, c = paths
    assert not a.exists() and b.exists() and c.exists()  # a was the least recently used
    assert not (a.parent / f"{a.name}.lock").exists()
    os.utime(b, (1_000_000, 1_000_000))
    os.utime(c, (1_000_001, 1_000_001))
    assert _runner(sources[1], hf_config, cache, None, max_bytes=bound).weight_cache.status == "hit"  # b used now
    again = _runner(sources[0], hf_config, cache, None, max_bytes=bound).weight_cache
    assert again.status == "built" and a.exists() and b.exists() and not c.exists()  # c was, after the hit on b

    too_small = _runner(sources[2], hf_config, cache, None, max_bytes=size // 2)
    assert too_small.weight_cache.status == "not-written" and "weight-cache-max-gb" in too_small.weight_cache.reason
    assert not c.exists() and a.exists() and b.exists()  # nothing was evicted for an entry that was not written
    _assert_same_weights(too_small, _runner(sources[2], hf_config, None, None))


def _best_tier() -> str | None:
    from tests.conftest import KERNEL_TIERS

    return KERNEL_TIERS[0] if KERNEL_TIERS else None


def test_an_entry_that_no_longer_matches_its_source_is_rebuilt(tiny, hf_config, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny.read_bytes())
    cache = tmp_path / "cache"
    tier = _best_tier()
    first = _runner(source, hf_config, cache, tier)
    assert first.weight_cache.status == "built"
    assert _runner(source, hf_config, cache, tier).weight_cache.status == "hit"

    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    touched = _runner(source, hf_config, cache, tier).weight_cache
    assert touched.status == "built" and "mtime" in touched.reason, touched

    # One byte of the header changed, size and mtime kept: only the header's hash tells.
    data = bytearray(source.read_bytes())
    key = b"llama.attention.layer_norm_rms_epsilon"
    at = data.index(key) + len(key) + 4  # the key, its value type (u32), then the float32 value
    assert struct.unpack_from("<f", data, at)[0] == pytest.approx(1e-5)
    struct.pack_into("<f", data, at, 2e-5)
    st = source.stat()
    source.write_bytes(bytes(data))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = _runner(source, hf_config, cache, tier).weight_cache
    assert changed.status == "built" and "header sha256" in changed.reason, changed
    assert _runner(source, hf_config, cache, tier).weight_cache.status == "hit"
    assert len(list(cache.glob(f"*{ENTRY_SUFFIX}"))) == 1  # rebuilt in place: no stale entries pile up


def _flip_data_byte(entry: Path) -> None:
    header = _header(entry)
    rec = max(header["tensors"], key=lambda r: r["nbytes"])
    with open(entry, "r+b") as f:
        at = header["_data_start"] + rec["offset"] + rec["nbytes"] // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def _header(entry: Path) -> dict:
    raw = entry.read_bytes()
    n = struct.unpack_from("<Q", raw, 16)[0]
    header = json.loads(raw[24 : 24 + n])
    header["_data_start"] = -(-(24 + n) // 4096) * 4096
    return header


DAMAGE = {
    "one data byte flipped": (_flip_data_byte, "tensor checksum"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size - 4096), "truncated"),
    "cut inside the header": (lambda p: os.truncate(p, 40), "truncated header"),
    "empty": (lambda p: os.truncate(p, 0), "truncated"),
    "header byte changed": (lambda p: _patch(p, 30, b"#"), "header checksum"),
    "not ours": (lambda p: _patch(p, 0, b"GGUF\0\0\0\0"), "not a weight cache file"),
    "another format version": (lambda p: _patch(p, 8, struct.pack("<I", 999)), "format version 999"),
}


def _patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_a_damaged_entry_is_rebuilt_not_used(tiny, hf_config, tmp_path):
    """Each damage in turn, on the same entry put back whole before each. (Damaged in place here, on
    purpose: the cache itself never writes into an entry, it renames a new file over it, so a process
    that maps the old one keeps its bytes.)"""
    tier = _best_tier()
    cold = _runner(tiny, hf_config, None, tier)
    entry = _runner(tiny, hf_config, tmp_path, tier).weight_cache.path
    whole = entry.read_bytes()
    for damage, (damage_fn, reason) in DAMAGE.items():
        entry.write_bytes(whole)
        damage_fn(entry)
        again = _runner(tiny, hf_config, tmp_path, tier)
        assert again.weight_cache.status == "built" and reason in again.weight_cache.reason, (damage, again.weight_cache)
        _assert_same_weights(cold, again)
        assert entry.read_bytes() == whole, damage  # rebuilt as it was
    assert _runner(tiny, hf_config, tmp_path, tier).weight_cache.status == "hit"


def test_a_layout_that_cannot_be_saved_loads_without_the_cache(tiny, hf_config, tmp_path):
    """oneDNN's packed weights (bf16 without our kernels) are opaque: the model loads as before."""
    cfg = ModelConfig.from_hf(hf_config)
    ops = select_layer_ops(dtype=torch.bfloat16, device=torch.device("cpu"), attention_backend="auto", cpu_kernels=False,
                           amx=False, head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           quantization="auto", is_gguf=True)
    runner = ModelRunner(resolve_model(tiny), hf_config, cfg, CacheConfig(16, 8), torch.bfloat16, torch.device("cpu"),
                         max_model_len=64, ops=ops, weight_cache=WeightCacheConfig(True, str(tmp_path)))
    if "oneDNN" not in ops.linear.description:
        assert runner.weight_cache.status == "built"  # F.linear over plain weights: cacheable
    else:
        assert runner.weight_cache.status == "unsupported" and "cannot be saved" in runner.weight_cache.reason
        assert list(tmp_path.glob(f"*{ENTRY_SUFFIX}")) == []


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
PROMPTS = ["The quick brown fox", "Once upon a time there was"]

_START = """
import json, sys
from chatserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], weight_cache_dir=sys.argv[2], max_model_len=64, num_kv_blocks=16, num_threads=1)
out = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
print(json.dumps({"status": llm.engine.runner.weight_cache.status,
                  "tokens": [list(o.outputs[0].token_ids) for o in out],
                  "logprobs": [[c[t].logprob for c, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in out]}))
"""


def _outputs(outputs) -> tuple[list, list]:
    return ([list(o.outputs[0].token_ids) for o in outputs],
            [[c[t].logprob for c, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs])


def test_two_processes_starting_together_build_once_and_answer_as_a_cold_load(default_gguf, tmp_path):
    """On the default model (its metadata is converted once per test session, and every process reads it)."""
    cold = LLM(model=str(default_gguf), weight_cache=False, max_model_len=64, num_kv_blocks=16)
    expected_tokens, expected_logprobs = _outputs(cold.generate(PROMPTS, GREEDY))
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # two processes of their own, started together (forks of the worker's warm fork server where it can:
    # tests/helpers/prefork.py; nothing of the weights or the cache is in the fork server's memory)
    argv = ["-c", _START, str(default_gguf), str(cache), json.dumps(PROMPTS)]
    outs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs = [prefork.start(argv, env=env, cwd=tmp_path, stdout=out, stderr=err) for out, err in outs]
    try:
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for code, (out, err) in zip(codes, outs):
        assert code == 0, err.read_text()[-3000:]
        results.append(json.loads(out.read_text().strip().splitlines()[-1]))
    assert sorted(r["status"] for r in results) == ["built", "hit"]  # one built while the other waited, then mapped
    for r in results:
        assert r["tokens"] == expected_tokens
        assert r["logprobs"] == expected_logprobs  # the same bits: the same weights, the same kernels
    assert len(list(cache.glob(f"*{ENTRY_SUFFIX}"))) == 1 and not list(cache.glob(".*.tmp"))
    warm = LLM(model=str(default_gguf), weight_cache_dir=str(cache), max_model_len=64, num_kv_blocks=16)
    assert warm.engine.runner.weight_cache.status == "hit"
    assert _outputs(warm.generate(PROMPTS, GREEDY)) == (expected_tokens, expected_logprobs)


def test_bad_weight_cache_dir_is_an_error_naming_the_field(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for value in (str(a_file), str(a_file / "below"), ""):
        with pytest.raises(ValueError, match="weight_cache_dir"):
            EngineArgs(weight_cache_dir=value)
    for gb in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="weight_cache_max_gb"):
            EngineArgs(weight_cache_max_gb=gb)
    with pytest.raises(ValueError, match="weight_cache_dir.*weight_cache is off"):
        EngineArgs(weight_cache=False, weight_cache_dir=str(tmp_path))
    EngineArgs(weight_cache_dir=str(tmp_path / "new" / "folder"))  # made at load
    EngineArgs(weight_cache=False)


def test_the_flags_reach_the_engine_args():
    from chatserve.cli import options_from_args, parse_args

    args = options_from_args(EngineArgs, parse_args(["serve", "--no-weight-cache"], environ={}))
    assert args.weight_cache is False and args.weight_cache_dir is None
    args = options_from_args(EngineArgs, parse_args(["serve", "--weight-cache-max-gb", "2.5"], environ={}))
    assert args.weight_cache_max_gb == 2.5
    args = options_from_args(EngineArgs, parse_args(["serve", "--weight-cache-dir", "/tmp/x"], environ={}))
    assert args.weight_cache_dir == "/tmp/x" and args.weight_cache is True
    env = {"CHATSERVE_WEIGHT_CACHE": "0"}
    assert options_from_args(EngineArgs, parse_args(["serve"], environ=env)).weight_cache is False
