"""dtype="auto": bfloat16 only where the hardware computes in it, float32 on other CPUs."""

from __future__ import annotations

import pytest
import torch

from chatserve import config


@pytest.mark.parametrize(("native", "device", "expected"), [
    (True, "cpu", torch.bfloat16),
    (False, "cpu", torch.float32),  # bf16 would be widened to f32 in every matmul: slower, not faster
    (False, "cuda", torch.bfloat16),
])
def test_auto_dtype_follows_the_hardware(monkeypatch, native, device, expected):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    assert config.resolve_dtype("auto", torch.device(device)) == expected


def test_explicit_dtypes_are_kept_and_unknown_ones_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert config.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert config.resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        config.resolve_dtype("float8", torch.device("cpu"))
