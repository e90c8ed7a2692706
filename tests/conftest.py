"""Shared fixtures: the default model (ours and transformers'), and tiny random checkpoints."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The converted GGUF metadata (models/loader.py gguf_metadata_folder) of this run only, shared by
# every process the tests start: the first load converts, later ones (and servers) read it.
if "CHATSERVE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["CHATSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="chatserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CHATSERVE_CACHE_DIR"], ignore_errors=True)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Compile the C++ kernels (every tier this CPU runs, bf16 and quantized) once, here, before
    any test starts a server.

    A server building them itself counts the compile (minutes on 2 cores) against its startup
    timeout; built here, every server finds them ready. The tiers build side by side, one thread
    each: every extension is one translation unit, so one compile uses one core, and the builds
    run in ninja subprocesses (the GIL is free while they compile).
    """
    from concurrent.futures import ThreadPoolExecutor

    from chatserve.kernels.cpu import load_cpu_kernels
    from chatserve.kernels.cpu_quant import load_quant_kernels

    build_dir = PROCESS_ENGINE_ARGS.kernel_build_dir  # ($TORCH_EXTENSIONS_DIR), where the servers look

    def build(tier: str) -> None:
        load_cpu_kernels(tier=tier, build_dir=build_dir)
        load_quant_kernels(tier, build_dir)  # the default model's GGUF blocks run on these (quantization "auto")

    with ThreadPoolExecutor(max_workers=max(1, min(len(KERNEL_TIERS), os.cpu_count() or 1))) as pool:
        list(pool.map(build, KERNEL_TIERS))


def _process_engine_args():
    """What this run's environment sets for every engine (`EngineArgs.from_env`): the tier cap
    ($CHATSERVE_MAX_CPU_TIER: the suite run as an AVX2-only host would) and the kernels' folder."""
    from chatserve.config import EngineArgs

    return EngineArgs.from_env()


PROCESS_ENGINE_ARGS = _process_engine_args()


def _kernel_tiers() -> list[str]:
    from chatserve.kernels.tiers import tested_tiers

    return [t.name for t in tested_tiers(PROCESS_ENGINE_ARGS.max_cpu_tier)]


# Every kernel tier this CPU runs, best first: the host's own and each lower one it can be forced to
# (an AVX512-BF16 host also tests the AVX512-VNNI and AVX2 tiers). Empty without AVX2.
KERNEL_TIERS = _kernel_tiers()


# The engine-level invariance tests (determinism, speculative decoding, MoE): the host's tier and the
# lowest (AVX2) in `make test`, every tier between (AVX512-VNNI, AVX2 + AVX-VNNI) in `make test-all`.
FAST_ENGINE_TIERS = list(dict.fromkeys([KERNEL_TIERS[0], KERNEL_TIERS[-1]])) if KERNEL_TIERS else []
ENGINE_TIER_PARAMS = [pytest.param(t, marks=() if t in FAST_ENGINE_TIERS else pytest.mark.slow) for t in KERNEL_TIERS]


def require_kernels(tier: str):
    """The proven C++ kernels of `tier`, a tier this CPU runs. A tier whose kernels do not build, fail
    a start-up self-check, or whose batch-invariant matmul fails its own (the engine would then run
    torch / oneDNN ops and its determinism promise would not hold) fails the test: never a skip."""
    from chatserve.kernels.cpu import kernel_problem, load_cpu_kernels

    problem = kernel_problem(tier)
    if problem is not None:
        pytest.fail(f"{tier}: {problem}", pytrace=False)
    return load_cpu_kernels(tier=tier)


@contextlib.contextmanager
def compute_threads(n: int):
    """torch's compute threads, which the C++ kernels split their work over too (at::get_num_threads),
    set to `n` for the block whatever the process had (`make test` runs each worker with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        assert torch.get_num_threads() == n
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session", params=KERNEL_TIERS or ["none"])
def kernels(request):
    """The compiled C++ kernels of each tier this CPU runs (one test per tier), or a skip where the
    CPU has no tier (no AVX2); kernels that do not build or fail a self-check fail the test."""
    if request.param == "none":
        pytest.skip("no kernel tier on this CPU (needs AVX2 + FMA): the engine uses torch ops instead")
    return require_kernels(request.param)


@pytest.fixture(scope="session")
def shared_server():
    """One live `chatserve serve` (default model and dtype, block size 16, API key) for the whole session.

    The default dtype: bf16 on the host's kernel tier (float32 only without one), the fast path of
    every host, so these tests cost on an AVX2 host what they cost elsewhere; what they check (tool
    calls, structured outputs, clients) holds in any dtype.

    A server start is the most expensive thing a live test does (a model load: over a minute on a
    busy 2-core box, most of it transformers parsing the GGUF metadata), so modules whose tests need
    no flag of their own share this one instead of starting their own: tests/clients/test_client_compat_tools.py
    and the HTTP burst of tests/cache/test_prefix_burst.py. Tests on it must leave it idle (no running
    request, no locked block) and must not depend on what earlier modules left in its prefix cache.
    """
    from .helpers.server import SHARED_API_KEY, start_server

    srv = start_server("--max-model-len", "2048", "--max-num-seqs", "20", "--block-size", "16",
                       api_key=SHARED_API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from chatserve.models.loader import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def llm_default():
    """Our engine on the default model as a user gets it (default dtype, quantization and kernel tier),
    for tests of a mechanism rather than of numerics: on every host the fast path (float32 torch
    decodes ~10x slower), and the path the server runs."""
    from chatserve import LLM

    return LLM(max_model_len=2048)


@pytest.fixture(scope="session")
def llm_fp32():
    """Our engine on the default model in float32 (for exactness against transformers)."""
    from chatserve import LLM

    return LLM(dtype="float32", max_model_len=2048)


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own model and tokenizer from the same GGUF file, float32. Their metadata reads
    (config, tokenizer) get transformers' parse of the file's skeleton plus the tokenizer arrays
    (`_gguf_metadata_via_skeleton`: the very dict of a whole parse, tests/models/test_gguf_metadata_cache.py),
    once; the weights are transformers' own reading of the file."""
    import mmap

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatserve.models.gguf_header import read_gguf_header
    from chatserve.models.loader import _gguf_metadata_via_skeleton

    path = default_gguf.resolve()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = read_gguf_header(buf)
    with _gguf_metadata_via_skeleton(path, header), _tensor_name_map_built_once():
        tok = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
        model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    return model.eval(), tok


@contextlib.contextmanager
def _tensor_name_map_built_once():
    """Within the block, gguf's `get_tensor_name_map(arch, n_blocks)` builds each table once.

    Why: transformers' `get_gguf_hf_weights_map` recurses over every module of the model and asks
    gguf for the whole name table at each one (397 times for SmolLM2: ~3.5 s of the reference
    model's ~9 s load, all Python). The table is a pure function of its arguments and transformers
    only reads it, so the weights and names it loads are the same."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@pytest.fixture(scope="session")
def smollm_tokenizer(default_gguf):
    """The real SmolLM2 tokenizer alone (no model): tiny checkpoints reuse it. Read as the engine reads
    it, from the session's converted GGUF metadata (one parse of the file for the whole run; that it
    equals transformers' own reading of the GGUF is tests/models/test_gguf_metadata_cache.py's business)."""
    from chatserve.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(default_gguf))


TINY_ARCHS = {
    # name: (config class name, extra config kwargs)
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
}


def write_tiny_checkpoint(folder: Path, arch: str, tokenizer, *, shard: bool = False) -> Path:
    """A random model with the real SmolLM2 tokenizer, saved by transformers itself (its added
    tokens listed in tokenizer_config.json, as a hub repository's are)."""
    import transformers

    from chatserve.models.loader import save_tokenizer

    cls_name, extra = TINY_ARCHS[arch]
    config_cls = getattr(transformers, cls_name)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.2,
        **extra,
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # make the QKV biases non-trivial so the test sees them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": "1MB"} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    save_tokenizer(tokenizer, folder)  # the added tokens listed, as a hub repository's are
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, smollm_tokenizer):
    """Factory: arch name -> folder with a tiny random checkpoint (cached per session)."""
    made: dict[tuple[str, bool], Path] = {}

    def make(arch: str, shard: bool = False) -> Path:
        key = (arch, shard)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}{'-sharded' if shard else ''}")
            made[key] = write_tiny_checkpoint(folder, arch, smollm_tokenizer, shard=shard)
        return made[key]

    return make


# --- two workers (`make test` runs pytest-xdist with -n 2) ----------------------------------------------
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per worker and per process it starts (servers, docs examples, benchmarks):
    # two workers on two cores, not each of them and its servers asking for every core.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Session fixtures worth building once (transformers' reference model: ~10-25 s; the shared server):
# every module that uses one runs in that fixture's group, so one worker builds it.
SHARED_FIXTURES = ("hf_default", "shared_server")
TESTS_DIR = Path(__file__).resolve().parent
MODULE_SECONDS_KEY = "chatserve/module_seconds"
# Each module's test time from a clean clone's two-worker run (last: an AMX host, after tests moved into
# folders by layer): the order of a clean clone (CI), where pytest's cache is empty. To refresh it from this checkout's last
# run: python -c "import json; d = json.load(open('.pytest_cache/v/chatserve/module_seconds'));
# json.dump(d, open('tests/module_seconds.json', 'w'), indent=0, sort_keys=True)"
MODULE_SECONDS_FILE = TESTS_DIR / "module_seconds.json"


@functools.cache
def _module_group(module_path: str) -> str:
    """The xdist unit a test module runs in: the shared fixture it uses, else the module itself.

    Cached: the scheduler asks again at every finished test, and its bookkeeping breaks if the answer
    changes (a test file edited while the suite runs)."""
    source = (TESTS_DIR.parent / module_path).read_text(encoding="utf-8")
    for name in SHARED_FIXTURES:
        if re.search(rf"\b{name}\b", source):
            return name
    return module_path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker, the most expensive first.

    Why whole modules: a module's fixtures (its server, its Redis database, its engine) are built
    once and its tests may assume nothing else touches them; two workers running one module's tests
    would each build them and clean up the other's keys. (`--dist loadgroup` would say the same with
    markers, but pytest-xdist 3.8 writes the group into a node id attribute that pytest 9 no longer
    reads, so its groups are silently ignored.) Largest first, by the module times the last run on
    this checkout saved in pytest's cache, else those of tests/module_seconds.json (a clean clone),
    else by number of tests, so no long module starts last.
    """
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    cache = getattr(config, "cache", None)  # (none under -p no:cacheprovider)
    seconds: dict[str, float] = json.loads(MODULE_SECONDS_FILE.read_text()) if MODULE_SECONDS_FILE.exists() else {}
    seconds.update(cache.get(MODULE_SECONDS_KEY, {}) if cache is not None else {})

    class ModuleScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _module_group(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            if not self._ordered and seconds:
                cost = {scope: sum(seconds.get(m, 0.0) for m in {n.split("::", 1)[0] for n in work})
                        for scope, work in self.workqueue.items()}
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda kv: -cost[kv[0]]))
            self._ordered = True
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Per-module test time (setup + call + teardown), for the next run's order of modules."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        module = report.nodeid.split("::", 1)[0]
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    cache = getattr(session.config, "cache", None)  # (none under -p no:cacheprovider)
    if _module_seconds and cache is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        known = cache.get(MODULE_SECONDS_KEY, {})
        cache.set(MODULE_SECONDS_KEY, {**known, **{m: round(s, 1) for m, s in _module_seconds.items()}})
