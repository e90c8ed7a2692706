"""The native-peer benchmark's pieces (#57), without building or running any engine: the random
Llama 3 GGUF writer (benchmarks/models/make_random_gguf.py) writes a file of each preset's family,
at tiny dimensions through the same code, that both chatserve's GGUF reader and the `gguf` package
read with the right metadata and valid blocks; build_native.sh never asks for -march=native where
the CPU lists AMX; bench_native.py reads the binaries' output formats."""

from __future__ import annotations

import importlib.util
import math
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
SMOLLM2_VOCAB = 49152


def _load(path: str):
    if str(BENCHMARKS) not in sys.path:  # bench_native imports bench_common
        sys.path.insert(0, str(BENCHMARKS))
    name = "_test_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def writer():
    return _load("models/make_random_gguf.py")


@pytest.fixture(scope="module")
def tokenizer_gguf():
    from chatserve.models.loader import default_model_path

    return default_model_path()


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_each_family_writes_a_gguf_both_readers_agree_on(writer, tokenizer_gguf, tmp_path, preset, qtype):
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    from chatserve.models.gguf_header import read_array, read_gguf_header
    from chatserve.models.loader import load_hf_config, resolve_model

    real = writer.PRESETS[preset]
    shape = writer.tiny(real, vocab=SMOLLM2_VOCAB + 40)
    path = writer.write_llama_gguf(tmp_path / f"{preset}-{qtype}.gguf", shape, writer.TYPES[qtype], tokenizer_gguf)

    # chatserve's own header reader: metadata, the padded vocabulary, the tensor table
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = read_gguf_header(buf)
        md = header.metadata
        tokens = read_array(buf, md["tokenizer.ggml.tokens"])
    assert md["general.architecture"] == "llama"
    assert (md["llama.block_count"], md["llama.embedding_length"], md["llama.feed_forward_length"]) == (
        shape.layers, shape.hidden, shape.ffn)
    assert (md["llama.attention.head_count"], md["llama.attention.head_count_kv"]) == (shape.heads, shape.kv_heads)
    assert md["llama.rope.freq_base"] == real.rope_theta == 500000.0
    assert md["llama.vocab_size"] == len(tokens) == shape.vocab
    assert tokens[-1] == writer.PAD_TOKEN.format(39)
    names = {t.name: t for t in header.tensors}
    assert ("output.weight" in names) == (not real.tied)
    assert names["token_embd.weight"].shape[0] == shape.vocab
    qt = GGMLQuantizationType[qtype.upper()]
    assert names["blk.1.ffn_down.weight"].ggml_type == qt
    assert len(names) == 2 + (not real.tied) + 9 * shape.layers + 1  # embd, norm, [output], rope, 9 per layer

    # the gguf package: the same tensors, valid blocks of a sane magnitude, llama.cpp's rope factors
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(names)
    w = dequantize(tensors["blk.0.ffn_up.weight"].data, qt)
    assert w.shape == (shape.ffn, shape.hidden) and np.isfinite(w).all()
    expected_std = 0.5 / math.sqrt(shape.hidden)
    assert 0.5 * expected_std < w.std() < 2 * expected_std
    freqs = tensors["rope_freqs.weight"].data
    assert freqs.shape == (shape.head_dim // 2,)
    assert freqs[0] == 1.0 and freqs[-1] == pytest.approx(real.rope.factor)  # fast ones kept, slow ones scaled
    assert np.all(np.diff(freqs) >= 0)

    # what chatserve builds its model from
    config = load_hf_config(resolve_model(str(path), cache_dir=tmp_path / "cache"))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads)
    assert config.vocab_size == shape.vocab
    assert bool(getattr(config, "tie_word_embeddings", True)) == real.tied


def test_presets_are_the_real_models_sizes(writer):
    """Parameter counts of the published models (1.24B, 3.21B, 8.03B)."""
    sizes = {name: shape.params() / 1e9 for name, shape in writer.PRESETS.items()}
    assert sizes["llama-3.2-1b"] == pytest.approx(1.236, abs=0.005)
    assert sizes["llama-3.2-3b"] == pytest.approx(3.213, abs=0.005)
    assert sizes["llama-3.1-8b"] == pytest.approx(8.030, abs=0.005)


def test_random_blocks_reject_a_width_that_is_not_whole_blocks(writer):
    with pytest.raises(ValueError, match="cols=40"):
        writer.random_quant_blocks(2, 4, 40, 0.01, np.random.default_rng(0))


def _isa_args(flags: str) -> str:
    script = BENCHMARKS / "peers" / "build_native.sh"
    out = subprocess.run(["bash", "-c", f'source "{script}"; isa_cmake_args "$1"', "_", flags],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_build_native_never_asks_for_march_native_where_amx_is_listed():
    amx = _isa_args("fpu sse avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_NATIVE=ON" not in amx
    assert "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_BF16=ON" in amx
    assert all(f"-DGGML_AMX_{x}=OFF" in amx for x in ("TILE", "INT8", "BF16"))
    assert "AMX_TILE=ON" not in amx
    # amx_tile alone is enough to rule out the native build
    assert "-DGGML_NATIVE=OFF" in _isa_args("avx avx2 fma amx_tile")
    # without AMX, the compiler's -march=native (every extension this CPU has)
    assert _isa_args("fpu sse avx avx2 fma f16c avx512f avx512_bf16") == "-DGGML_NATIVE=ON"


def test_sourcing_build_native_builds_nothing():
    """The test above sources the script: sourcing must only define its functions."""
    script = BENCHMARKS / "peers" / "build_native.sh"
    out = subprocess.run(["bash", "-c", f'source "{script}"; type -t build_engine'], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "function" and "[build_native]" not in out.stderr


def test_bench_native_reads_the_binaries_output():
    bench = _load("peers/bench_native.py")
    batched = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |    128 |    1 |    144 |    0.120 |   133.33 |    3.000 |    42.67 |    3.120 |    46.15 |
|    16 |    128 |    8 |   1152 |    0.900 |   142.22 |    8.000 |   128.00 |    8.900 |   129.44 |

llama_perf_context_print:        load time =     100.00 ms
"""
    assert bench.parse_batched_bench(batched) == {1: 42.67, 8: 128.0}
    text = 'build: 1 (x)\n[\n  {"n_prompt": 512, "n_gen": 0, "avg_ts": 256.0},\n  {"n_prompt": 0, "n_gen": 128, "avg_ts": 40.5}\n]\n'
    rows = bench.parse_llama_bench_json(text)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(512, 0), (0, 128)]
    with pytest.raises(ValueError, match="no JSON"):
        bench.parse_llama_bench_json("error: failed to load model")


def test_a_workers_peak_rss_is_its_own_not_its_parents():
    """bench_common.peak_rss_mib in a process started by one holding 256 MiB more: that process's own
    peak (ru_maxrss would carry the parent's pages across fork + exec: the 2,309 MiB every worker
    of a bench_native run reported, whatever model it loaded)."""
    held = np.ones(64 * 2**20, dtype=np.float32)  # 256 MiB, touched
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_common as bc; "
            "import numpy as np; a = np.ones(16 * 2**20, dtype=np.float32); print(bc.peak_rss_mib())")
    out = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, check=True)
    own = float(out.stdout.split()[-1])
    assert 64 <= own < 200, own  # its own 64 MiB array and an interpreter, not the parent's 256 MiB
    assert held[-1] == 1.0


def test_the_bandwidth_probe_compiles_and_reads(tmp_path, monkeypatch):
    """read_bandwidth.c, built by bench_native into the native cache (once: a second call reuses it),
    prints one positive GiB/s figure; a wrong argument count is refused with its usage."""
    monkeypatch.setenv("NATIVE_CACHE", str(tmp_path))
    bench = _load("peers/bench_native.py")
    probe = bench._bandwidth_probe()
    if probe is None:
        pytest.skip("no C compiler")
    assert probe.parent == tmp_path and bench._bandwidth_probe() == probe
    gib_s = bench.read_bandwidth_gib_s(1, gib=0.03, repeats=1)
    assert 0.1 < gib_s < 10_000
    bad = subprocess.run([str(probe)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
