"""`chatserve serve` flags are generated from EngineArgs / ServerSettings / ServeOptions: every field
has a flag with the field's default, `$CHATSERVE_<FIELD>` sets that default, a flag wins over it, and
vLLM's spellings map onto our fields. Parsing only: no server starts and no model loads."""

from __future__ import annotations

import dataclasses

import pytest

from chatserve.cli import ServeOptions, build_parser, flag_specs, options_from_args, parse_args
from chatserve.config import EngineArgs
from chatserve.server.settings import ServerSettings

OPTION_CLASSES = (EngineArgs, ServerSettings, ServeOptions)


def _serve(*argv: str, env: dict[str, str] | None = None):
    return parse_args(["serve", *argv], environ=env or {})


def _serve_parser(env: dict[str, str] | None = None):
    parser = build_parser(env or {})
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def _all_fields():
    return [(cls, f) for cls in OPTION_CLASSES for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls,f", _all_fields(), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_every_field_has_a_flag_with_the_field_default(cls, f):
    options = _serve_parser()._option_string_actions
    flag = "--" + f.name.replace("_", "-")
    assert flag in options, f"{cls.__name__}.{f.name} has no {flag}"
    assert options[flag].dest == f.name
    assert getattr(_serve(), f.name) == f.default
    if isinstance(f.default, bool):
        assert "--no-" + f.name.replace("_", "-") in options


def test_namespace_builds_the_dataclass_defaults():
    args = _serve()
    for cls in OPTION_CLASSES:
        assert options_from_args(cls, args) == cls()


def test_llm_defaults_are_engine_args_defaults():
    import inspect

    from chatserve.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    assert set(params) == {"self", "model", "kwargs"}  # no second copy of any default
    with pytest.raises(TypeError, match="unknown_option.*valid:.*max_num_seqs"):
        LLM(unknown_option=1)


def test_types_choices_and_optionals():
    args = _serve("--max-num-seqs", "8", "--kv-cache-memory-gb", "1.5", "--dtype", "float32",
                  "--attention-backend", "torch", "--no-enable-prefix-caching", "--no-cpu-kernels", "--no-amx",
                  "--served-model-name", "m", "--max-model-len", "none", "--sse-keepalive-s", "0.5")
    engine = options_from_args(EngineArgs, args)
    assert (engine.max_num_seqs, engine.kv_cache_memory_gb, engine.dtype) == (8, 1.5, "float32")
    assert (engine.attention_backend, engine.enable_prefix_caching, engine.cpu_kernels, engine.amx) == (
        "torch", False, False, False)
    assert engine.max_model_len is None
    settings = options_from_args(ServerSettings, args)
    assert settings.served_model_name == engine.served_model_name == "m"  # one flag feeds both
    assert settings.sse_keepalive_s == 0.5
    for bad in (["--dtype", "float8"], ["--max-num-seqs", "many"], ["--block-size", "1.5"]):
        with pytest.raises(SystemExit):
            _serve(*bad)


def test_server_only_flags():
    args = _serve("--host", "0.0.0.0", "--port", "9000", "--redis-url", "redis://h:1/0", "--log-level", "debug",
                  "--shutdown-grace-s", "3", "--no-web", "--api-key", "k")
    assert options_from_args(ServeOptions, args) == ServeOptions("0.0.0.0", 9000, "redis://h:1/0", "debug", 3.0)
    settings = options_from_args(ServerSettings, args)
    assert (settings.serve_web, settings.api_key) == (False, "k")
    assert _serve("--api-key", "").api_key is None


def test_env_sets_the_default_and_a_flag_wins():
    env = {"CHATSERVE_MAX_NUM_SEQS": "8", "CHATSERVE_ENABLE_PREFIX_CACHING": "0", "CHATSERVE_AMX": "off",
           "CHATSERVE_KV_CACHE_MEMORY_GB": "2", "CHATSERVE_API_KEY": "secret", "CHATSERVE_REDIS_URL": "redis://x/0",
           "CHATSERVE_ATTENTION_BACKEND": "torch", "CHATSERVE_MAX_QUEUE_LEN": "3", "CHATSERVE_PORT": "9001"}
    args = _serve(env=env)
    assert (args.max_num_seqs, args.enable_prefix_caching, args.amx, args.kv_cache_memory_gb) == (8, False, False, 2.0)
    assert (args.api_key, args.redis_url, args.attention_backend, args.max_queue_len, args.port) == (
        "secret", "redis://x/0", "torch", 3, 9001)
    args = _serve("--max-num-seqs", "4", "--enable-prefix-caching", "--amx", "--api-key", "other", "--port", "1",
                  env=env)
    assert (args.max_num_seqs, args.enable_prefix_caching, args.amx, args.api_key, args.port) == (4, True, True, "other", 1)
    # an empty value unsets an optional field; a flag can unset an env default too
    assert _serve(env={"CHATSERVE_API_KEY": ""}).api_key is None
    assert _serve("--num-kv-blocks", "none", env={"CHATSERVE_NUM_KV_BLOCKS": "64"}).num_kv_blocks is None


@pytest.mark.parametrize("var,value", [("CHATSERVE_MAX_NUM_SEQS", "lots"), ("CHATSERVE_AMX", "maybe"),
                                       ("CHATSERVE_DTYPE", "float8"), ("CHATSERVE_SSE_KEEPALIVE_S", "soon")])
def test_bad_env_value_is_an_error_naming_the_variable(var, value):
    with pytest.raises(ValueError, match=rf"\${var}: expected .*{value!r}"):
        build_parser({var: value})


def test_main_reports_a_bad_env_value(capsys):
    from chatserve.cli import main

    assert main(["serve", "--help"], environ={"CHATSERVE_MAX_NUM_SEQS": "lots"}) == 2
    assert "$CHATSERVE_MAX_NUM_SEQS" in capsys.readouterr().err


def test_vllm_aliases():
    assert _serve("--num-gpu-blocks-override", "128").num_kv_blocks == 128
    assert _serve("--kv-cache-memory-bytes", str(3 * 2**30)).kv_cache_memory_gb == 3.0
    assert _serve("--kv-cache-memory-bytes", "512M").kv_cache_memory_gb == 0.5
    assert _serve("--kv-cache-memory-bytes", "2g").kv_cache_memory_gb == pytest.approx(2e9 / 2**30)
    assert _serve("--uvicorn-log-level", "warning").log_level == "warning"
    assert _serve("/models/x").model == "/models/x"  # `vllm serve MODEL`
    assert _serve("/models/x", "--model", "/models/y").model == "/models/x"
    assert _serve("--max-num-batched-tokens", "16").max_num_batched_tokens == 16
    assert _serve().kv_cache_memory_gb is None  # the bytes flag does not shadow the default
    assert _serve(env={"CHATSERVE_KV_CACHE_MEMORY_GB": "1"}).kv_cache_memory_gb == 1.0
    with pytest.raises(SystemExit):
        _serve("--kv-cache-memory-bytes", "lots")


def test_help_lists_every_help_text(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--help"], environ={"CHATSERVE_API_KEY": "s3cret", "CHATSERVE_MAX_N": "4"})
    assert exc.value.code == 0
    # undo argparse's line wrapping (which also breaks lines after a hyphen: "X-" / "Chatserve-Instance")
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for cls in OPTION_CLASSES:
        for spec in flag_specs(cls):
            if cls is ServerSettings and spec.name in EngineArgs.field_names():
                continue  # one flag for both; EngineArgs' help text is the one shown
            assert " ".join(spec.help.split()).replace("- ", "-") in out, spec.name
    assert "[default: 4 from $CHATSERVE_MAX_N]" in out
    assert "s3cret" not in out  # secrets from the environment are not echoed
    assert "--no-web" in out and "--num-gpu-blocks-override" in out and "--kv-cache-memory-bytes" in out


def test_a_field_without_help_or_flag_type_is_refused():
    @dataclasses.dataclass(frozen=True)
    class NoHelp:
        x: int = 1

    @dataclasses.dataclass(frozen=True)
    class BadType:
        x: list = dataclasses.field(default_factory=list, metadata={"help": "h"})

    with pytest.raises(TypeError, match="help"):
        flag_specs(NoHelp)
    with pytest.raises(TypeError, match="default"):
        flag_specs(BadType)


def test_quantization_flag(capsys):
    """`--quantization` (issue #21): one of auto/none/gguf/int8, default auto; a bad value names the flag."""
    assert options_from_args(EngineArgs, _serve()).quantization == "auto"
    assert options_from_args(EngineArgs, _serve("--quantization", "int8")).quantization == "int8"
    assert options_from_args(EngineArgs, _serve(env={"CHATSERVE_QUANTIZATION": "none"})).quantization == "none"
    with pytest.raises(SystemExit):
        _serve("--quantization", "q4")
    err = capsys.readouterr().err
    assert "--quantization" in err and "q4" in err and "gguf" in err


def test_kv_cache_dtype_flag(capsys):
    """`--kv-cache-dtype` (issue 56): auto/bf16/int8, default auto, in serve and the offline benchmarks."""
    assert options_from_args(EngineArgs, _serve()).kv_cache_dtype == "auto"
    assert options_from_args(EngineArgs, _serve("--kv-cache-dtype", "int8")).kv_cache_dtype == "int8"
    assert options_from_args(EngineArgs, _serve(env={"CHATSERVE_KV_CACHE_DTYPE": "bf16"})).kv_cache_dtype == "bf16"
    assert parse_args(["bench", "latency", "--kv-cache-dtype", "int8"], environ={}).kv_cache_dtype == "int8"
    assert parse_args(["bench", "throughput", "--kv-cache-dtype", "int8"], environ={}).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        _serve("--kv-cache-dtype", "fp8")
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8" in err and "int8" in err


def test_the_cli_imports_no_torch_until_a_command_needs_it() -> None:
    """`chatserve bench serve` (an HTTP client) and every `--help` build their flags from EngineArgs
    and ServerSettings without importing torch, the engine or the app (~2.5 s of imports before)."""
    import subprocess
    import sys

    code = ("import sys, chatserve.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'xgrammar', 'chatserve.server.app') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_serve_parses_without_the_other_commands_modules_and_they_still_parse() -> None:
    """`chatserve serve` builds only its own flags (the cluster's and the benchmarks' modules import httpx,
    rich and the datasets: part of every server start); the other commands parse as before."""
    import subprocess
    import sys

    code = ("import sys; from chatserve.cli import parse_args; a = parse_args(['serve', '--port', '9']); "
            "print(a.command, a.port, sorted(m for m in ('httpx', 'chatserve.cluster', 'chatserve.bench.serve') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "serve 9 []", out.stdout + out.stderr
    assert parse_args(["cluster", "--replicas", "3"]).replicas == 3
    assert parse_args(["bench", "serve", "--num-prompts", "5"]).bench_command == "serve"
