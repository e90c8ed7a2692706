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
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
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


def test_max_cpu_tier_caps_this_machines_tiers(monkeypatch):
    """$CHATSERVE_MAX_CPU_TIER drops the tiers above it from this CPU's (auto then picks the cap or
    lower; forcing one above it is an error naming the variable); explicit flags stay uncapped."""
    from chatserve.kernels import tiers

    monkeypatch.delenv("CHATSERVE_MAX_CPU_TIER", raising=False)
    monkeypatch.setattr(tiers, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                                "avx512dq", "avx512_vnni", "avx512_bf16"}))
    assert [t.name for t in tiers.supported_tiers()] == ["avx512_bf16", "avx512_vnni", "avx2"]
    monkeypatch.setenv("CHATSERVE_MAX_CPU_TIER", "avx512_vnni")
    assert [t.name for t in tiers.supported_tiers()] == ["avx512_vnni", "avx2"]
    assert tiers.select_tier("auto").name == "avx512_vnni"
    with pytest.raises(ValueError, match="above CHATSERVE_MAX_CPU_TIER='avx512_vnni'"):
        tiers.select_tier("avx512_bf16")
    assert tiers.select_tier("auto", tiers.cpu_flags()).name == "avx512_bf16"  # a hypothetical CPU: no cap
    monkeypatch.setenv("CHATSERVE_MAX_CPU_TIER", "avx1")
    with pytest.raises(ValueError, match="CHATSERVE_MAX_CPU_TIER must be one of"):
        tiers.supported_tiers()


def test_explicit_dtypes_are_kept_and_unknown_ones_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert config.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert config.resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        config.resolve_dtype("float8", torch.device("cpu"))
