"""dtype="auto": bfloat16 where the hardware computes in it or our CPU kernels run (a kernel tier),
float32 on other CPUs; a forced kernel tier is checked against the CPU and the other options."""

from __future__ import annotations

import pytest
import torch

from chatserve import config


@pytest.mark.parametrize(("native", "kernels", "device", "expected"), [
    (True, False, "cpu", torch.bfloat16),
    (False, True, "cpu", torch.bfloat16),  # an AVX2 tier: bf16 in memory, fp32 in registers, int8 for GGUF blocks
    (False, False, "cpu", torch.float32),  # torch alone would widen bf16 to f32 in every matmul: slower, not faster
    (False, False, "cuda", torch.bfloat16),
])
def test_auto_dtype_follows_the_hardware(monkeypatch, native, kernels, device, expected):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda cap=None: native)
    assert config.resolve_dtype("auto", torch.device(device), cpu_kernels=kernels) == expected


def test_kernel_tier_choices_are_checked():
    from chatserve.kernels.tiers import select_tier

    with pytest.raises(ValueError, match="cpu_kernel_tier must be one of"):
        config.EngineArgs(cpu_kernel_tier="sse4")
    with pytest.raises(ValueError, match="cpu_kernels is off"):
        config.EngineArgs(cpu_kernel_tier="avx2", cpu_kernels=False)
    avx2_only = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    assert select_tier("auto", avx2_only).name == "avx2"
    assert select_tier("auto", avx2_only | {"avx_vnni"}).name == "avx2_vnni"
    zen4 = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    assert select_tier("auto", zen4).name == "avx512_bf16"
    assert select_tier("avx2", zen4).name == "avx2"  # a lower tier can be forced
    assert select_tier("auto", frozenset({"sse4_2"})) is None  # no AVX2: torch ops
    assert select_tier("avx2", avx2_only).name == "avx2"  # forcing works
    with pytest.raises(ValueError, match="avx512_vnni.*lacks: avx512_vnni, avx512bw, avx512dq, avx512f, avx512vl"):
        select_tier("avx512_vnni", avx2_only)


ZEN4_LIKE = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"})


def test_max_cpu_tier_caps_this_machines_tiers(monkeypatch):
    """A cap (EngineArgs.max_cpu_tier, passed as `cap`) drops the tiers above it from this CPU's (auto
    then picks the cap or lower; forcing one above it is an error naming the field); no cap, none dropped."""
    from chatserve.kernels import tiers

    monkeypatch.setattr(tiers, "cpu_flags", lambda: ZEN4_LIKE)
    assert [t.name for t in tiers.supported_tiers()] == ["avx512_bf16", "avx512_vnni", "avx2"]
    assert [t.name for t in tiers.supported_tiers(cap="avx512_vnni")] == ["avx512_vnni", "avx2"]
    assert [t.name for t in tiers.tested_tiers("avx2")] == ["avx2"]
    assert tiers.select_tier("auto", cap="avx512_vnni").name == "avx512_vnni"
    assert tiers.select_tier("avx2", cap="avx512_vnni").name == "avx2"  # below the cap: allowed
    with pytest.raises(ValueError, match="cpu_kernel_tier='avx512_bf16' is above max_cpu_tier='avx512_vnni'"):
        tiers.select_tier("avx512_bf16", cap="avx512_vnni")
    assert tiers.select_tier("auto").name == "avx512_bf16"  # no cap
    # a hypothetical CPU's flags with the same cap: the cap applies to it too
    assert tiers.select_tier("auto", ZEN4_LIKE, cap="avx2").name == "avx2"
    with pytest.raises(ValueError, match="max_cpu_tier must be one of"):
        tiers.supported_tiers(cap="avx1")


def test_max_cpu_tier_caps_native_bf16(monkeypatch):
    """Below the AVX512-BF16 tier there is no native bf16 (dtype auto then follows the kernels alone)."""
    monkeypatch.setattr(config, "cpu_flags", lambda: ZEN4_LIKE)
    assert config.cpu_has_native_bf16() and config.cpu_has_native_bf16("avx512_bf16")
    assert config.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    for cap in ("avx512_vnni", "avx2_vnni", "avx2"):
        assert config.cpu_has_native_bf16(cap) is False
        assert config.resolve_dtype("auto", torch.device("cpu"), max_cpu_tier=cap) == torch.float32


def test_max_cpu_tier_field_and_its_variable_at_the_edge():
    """EngineArgs.max_cpu_tier is checked naming the field; $CHATSERVE_MAX_CPU_TIER reaches it only
    through EngineArgs.from_env (the CLI and LLM), checked naming the variable."""
    with pytest.raises(ValueError, match="max_cpu_tier must be one of avx512_bf16, avx512_vnni, avx2_vnni, avx2"):
        config.EngineArgs(max_cpu_tier="avx1")
    assert config.EngineArgs().max_cpu_tier is None  # no environment read by the constructor
    assert config.EngineArgs.from_env({"CHATSERVE_MAX_CPU_TIER": "avx2"}).max_cpu_tier == "avx2"
    assert config.EngineArgs.from_env({"CHATSERVE_MAX_CPU_TIER": " "}).max_cpu_tier is None
    assert config.EngineArgs.from_env({"CHATSERVE_MAX_CPU_TIER": "avx2"}, max_cpu_tier="avx512_vnni").max_cpu_tier == "avx512_vnni"
    with pytest.raises(ValueError, match="CHATSERVE_MAX_CPU_TIER must be one of"):
        config.EngineArgs.from_env({"CHATSERVE_MAX_CPU_TIER": "avx1"})


def test_explicit_dtypes_are_kept_and_unknown_ones_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda cap=None: False)
    assert config.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert config.resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        config.resolve_dtype("float8", torch.device("cpu"))


# ---- kv_cache_dtype: auto (the model's dtype), bf16, int8 (the CPU attention paths only) -------------
@pytest.mark.parametrize(("name", "model", "expected"), [
    ("auto", torch.bfloat16, torch.bfloat16),
    ("auto", torch.float32, torch.float32),  # no kernel tier: float32 K/V
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("int8", torch.bfloat16, torch.int8),
    ("int8", torch.float32, torch.int8),  # quantized from the float32 values
])
def test_kv_cache_dtype_resolves_on_the_cpu(name, model, expected):
    assert config.resolve_kv_cache_dtype(name, torch.device("cpu"), model) == expected


def test_int8_kv_on_cuda_or_triton_is_a_start_up_error_naming_the_field():
    """The Triton kernels read bf16 caches only: no GPU is needed to check the refusal."""
    for device, backend in (("cuda", "auto"), ("cuda:1", "torch"), ("cpu", "triton")):
        with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*Triton"):
            config.resolve_kv_cache_dtype("int8", torch.device(device), torch.bfloat16, backend)
    assert config.resolve_kv_cache_dtype("auto", torch.device("cuda"), torch.float16, "triton") == torch.float16


def test_bad_kv_cache_dtypes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bf16, int8; got 'fp8'"):
        config.EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        config.resolve_kv_cache_dtype("q8_0", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype='bf16' needs a bfloat16 engine.*float32"):
        config.resolve_kv_cache_dtype("bf16", torch.device("cpu"), torch.float32)
    assert config.EngineArgs(kv_cache_dtype="int8").kv_cache_dtype == "int8"
