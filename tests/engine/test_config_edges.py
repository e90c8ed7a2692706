"""The environment is read at the edges only (the design map: configuration travels as explicit objects).

`EngineArgs.from_env` and the CLI turn $CHATSERVE_MAX_CPU_TIER, $TORCH_EXTENSIONS_DIR,
$CHATSERVE_CACHE_DIR and $XDG_CACHE_HOME into fields (`max_cpu_tier`, `kernel_build_dir`, `cache_dir`);
below them each value is an argument. These tests check both halves: a scan of chatserve/
for any environment access outside the named edges (so the rule cannot silently come back), and the
inner functions doing what their arguments say while the environment says otherwise.
"""

from __future__ import annotations

import ast
import importlib.util
import typing
from pathlib import Path

import pytest
import torch

from chatserve import config
from chatserve.cli import engine_args_from, parse_args
from chatserve.config import EngineArgs
from chatserve.kernels.tiers import TIERS
from tests.helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "chatserve"
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

# (module, enclosing function) -> why the environment is touched there. None: anywhere in the module.
EDGES: dict[tuple[str, str | None], str] = {
    ("chatserve/cli.py", None): "the command line: $CHATSERVE_<FIELD> flag defaults, and EngineArgs.from_env",
    ("chatserve/config.py", "EngineArgs.from_env"): "the one reader below the CLI (LLM and in-process engines)",
    ("chatserve/cluster.py", "run_cluster"): "the replicas' child-process environment",
    ("chatserve/bench/serve.py", "run_benchmark"): "the benchmark client's $OPENAI_API_KEY, as vLLM's",
    ("chatserve/attention/triton_backend.py", "load_triton_kernels"):
        "writes $TRITON_INTERPRET, which Triton reads at import; the decision is the worker's (the device)",
}


def environment_accesses(source: str) -> list[tuple[str, int]]:
    """(enclosing function's qualified name, or "" at module level; line) of each `os.environ`,
    `os.getenv`, ... (under any alias of os) and each `from os import environ/getenv`."""
    tree = ast.parse(source)
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname for a in node.names if a.name == "os" and a.asname}
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id in os_names:
            found.append((scope, node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in ENV_NAMES for a in node.names):
            found.append((scope, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return found


def test_the_scan_sees_every_spelling():
    src = ("import os\nimport os as o\nfrom os import getenv\n"
           "class A:\n    def f(self):\n        return os.environ.get('X'), o.getenv('Y')\n"
           "def g():\n    '''os.environ in a docstring is text'''\n    os.environ['Z'] = '1'\n")
    assert environment_accesses(src) == [("", 3), ("A.f", 6), ("A.f", 6), ("g", 9)]


def test_only_the_edges_read_the_environment():
    """Every environment access in chatserve/ is at a named edge; a new one deep inside fails here
    (pass the value in from EngineArgs instead: configuration travels as explicit objects)."""
    deep = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).as_posix()
        for scope, line in environment_accesses(path.read_text()):
            if (module, None) not in EDGES and (module, scope) not in EDGES:
                deep.append(f"{module}:{line} ({scope or 'module level'})")
    assert deep == [], "environment read deep inside: " + ", ".join(deep)
    for module, _ in EDGES:  # an edge that moved or went away is dropped from the list
        assert (PACKAGE.parent / module).is_file(), module


def test_from_env_fills_the_unset_fields_and_explicit_values_win():
    env = {"CHATSERVE_MAX_CPU_TIER": "avx2", "TORCH_EXTENSIONS_DIR": "/k", "CHATSERVE_CACHE_DIR": "/c",
           "XDG_CACHE_HOME": "/x"}
    args = EngineArgs.from_env(env, max_num_seqs=3)
    assert (args.max_cpu_tier, args.kernel_build_dir, args.cache_dir, args.max_num_seqs) == ("avx2", "/k", "/c", 3)
    mine = EngineArgs.from_env(env, max_cpu_tier="avx512_vnni", kernel_build_dir="/mine", cache_dir="/m")
    assert (mine.max_cpu_tier, mine.kernel_build_dir, mine.cache_dir) == ("avx512_vnni", "/mine", "/m")
    assert EngineArgs.from_env({"XDG_CACHE_HOME": "/x"}).cache_dir == str(Path("/x/chatserve"))
    assert EngineArgs.from_env({}) == EngineArgs()  # nothing set: the fields' own defaults
    assert set(config.ENVIRONMENT_FIELDS) <= EngineArgs.field_names()
    assert typing.get_args(config.TierName) == tuple(TIERS)  # the flag's choices are the tiers


def test_the_cli_reads_the_same_variables():
    """`chatserve serve`: $CHATSERVE_MAX_CPU_TIER / $CHATSERVE_CACHE_DIR are the flags'
    own $CHATSERVE_<FIELD> defaults; $TORCH_EXTENSIONS_DIR and $XDG_CACHE_HOME fill what the flags leave
    unset (engine_args_from); a flag wins over each."""
    env = {"CHATSERVE_MAX_CPU_TIER": "avx2", "TORCH_EXTENSIONS_DIR": "/k", "XDG_CACHE_HOME": "/x"}
    args = engine_args_from(parse_args(["serve"], environ=env), env)
    assert (args.max_cpu_tier, args.kernel_build_dir, args.cache_dir) == ("avx2", "/k", str(Path("/x/chatserve")))
    flags = ["serve", "--max-cpu-tier", "avx512_vnni", "--kernel-build-dir", "/f", "--cache-dir", "/d"]
    args = engine_args_from(parse_args(flags, environ=env), env)
    assert (args.max_cpu_tier, args.kernel_build_dir, args.cache_dir) == ("avx512_vnni", "/f", "/d")
    with pytest.raises(ValueError, match=r"\$CHATSERVE_MAX_CPU_TIER: expected one of avx512_bf16, .*got 'avx1'"):
        parse_args(["serve"], environ={"CHATSERVE_MAX_CPU_TIER": "avx1"})


def test_llm_takes_the_process_environment(monkeypatch):
    """`LLM(...)` is an edge: a variable set for the process reaches its EngineArgs; its own kwargs win."""
    import chatserve.llm as llm_module

    built: list[EngineArgs] = []
    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: built.append(args))
    monkeypatch.setenv("CHATSERVE_MAX_CPU_TIER", "avx2")
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", "/from-env")
    llm_module.LLM(max_num_seqs=2)
    llm_module.LLM(max_num_seqs=2, max_cpu_tier="avx512_vnni", cache_dir="/given")
    assert [(a.max_cpu_tier, a.cache_dir) for a in built] == [("avx2", "/from-env"), ("avx512_vnni", "/given")]


def test_inner_functions_follow_their_arguments_not_the_environment(monkeypatch, tmp_path):
    from chatserve.kernels import tiers
    from chatserve.kernels.build import build_root
    from chatserve.layers.linear import TorchLinearMethod, select_linear_method
    from chatserve.models.loader import metadata_cache_root, resolve_model
    from chatserve.models.weight_cache import WeightCacheConfig

    monkeypatch.setenv("CHATSERVE_MAX_CPU_TIER", "avx2")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "env-builds"))
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"})
    monkeypatch.setattr(tiers, "cpu_flags", lambda: flags)
    assert tiers.select_tier("auto").name == "avx512_bf16"  # no cap passed: none applies
    assert tiers.select_tier("auto", cap="avx512_vnni").name == "avx512_vnni"
    assert build_root(tmp_path / "mine") == tmp_path / "mine"
    assert build_root() == Path.home() / ".cache" / "torch_extensions" / build_root().name  # torch's default, not the env's
    assert isinstance(select_linear_method(torch.float32, torch.device("cpu"), None), TorchLinearMethod)

    source = resolve_model(None, cache_dir=tmp_path / "given")
    assert source.cache_dir == str(tmp_path / "given")
    assert metadata_cache_root(source.cache_dir) == tmp_path / "given"
    assert metadata_cache_root() == Path.home() / ".cache" / "chatserve"
    assert resolve_model(None).cache_dir is None
    weights = WeightCacheConfig(cache_dir=str(tmp_path / "given"))
    assert weights.resolved_dir() == tmp_path / "given" / "repacked-weights"
    assert WeightCacheConfig(directory=str(tmp_path / "w"), cache_dir="/ignored").resolved_dir() == tmp_path / "w"


def test_the_worker_config_carries_the_fields():
    from chatserve.worker.setup import WorkerConfig

    args = EngineArgs(max_cpu_tier="avx2", kernel_build_dir="/k", cache_dir="/c")
    worker = WorkerConfig.from_engine_args(args)
    assert (worker.max_cpu_tier, worker.kernel_build_dir) == ("avx2", "/k")
    assert worker.weight_cache.resolved_dir() == Path("/c/repacked-weights")
    for bad, match in (({"max_cpu_tier": "avx1"}, "max_cpu_tier must be one of"),
                       ({"cache_dir": " "}, "cache_dir must be a folder path"),
                       ({"kernel_build_dir": ""}, "kernel_build_dir must be a folder path")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**bad)


def test_a_capped_engine_loads_the_capped_tier_whatever_the_environment(monkeypatch):
    """The cap reaches the kernels as an argument: the layer ops of an engine capped at AVX2 run the
    AVX2 tier, and with the variable set but no cap passed, the CPU's best tier."""
    from chatserve.kernels.tiers import TIERS, supported_tiers
    from chatserve.layers.ops import select_layer_ops

    here = supported_tiers()
    if TIERS["avx2"] not in here or len(here) < 2:
        pytest.skip("needs a CPU with the AVX2 tier and a better one")
    monkeypatch.setenv("CHATSERVE_MAX_CPU_TIER", "avx2")
    shape = dict(dtype=torch.bfloat16, device=torch.device("cpu"), attention_backend="auto", cpu_kernels=True,
                 amx=False, head_dim=64, num_heads=4, num_kv_heads=2)
    assert select_layer_ops(**shape, max_cpu_tier="avx2").cpu.tier == "avx2"
    assert select_layer_ops(**shape).cpu.tier == here[0].name


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_runs_interpreted_exactly_on_the_cpu():
    """The TRITON_INTERPRET decision is the worker's (its device), passed in, never read back."""
    from chatserve.attention.triton_backend import load_triton_kernels

    with pytest.raises(ValueError, match="Triton on cpu runs interpreted; got interpret=False"):
        load_triton_kernels(torch.device("cpu"), interpret=False)
