"""Compile a tiered kernel source (csrc/tier_<family>.cpp) for a tier this CPU cannot run, without
loading it: importing an AVX512 build on an AVX2 host dies of SIGILL in its static initialisers, so
the check stops at the object file (the same flags torch's cpp_extension passes, plus the tier's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from chatserve.kernels.build import COMMON_CFLAGS, CSRC
from chatserve.kernels.tiers import TIERS, KernelTier, supported_tiers, tier_source


def compile_tier_object(family: str, tier: KernelTier, out_dir: Path) -> subprocess.CompletedProcess[str] | None:
    """The compiler's run on tier_<family>.cpp with `tier`'s flags (None where there is no compiler)."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return None
    includes = [f"-I{CSRC}"]
    for path in [*include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", path]
    cmd = [cxx, "-DTORCH_EXTENSION_NAME=tier_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
           "-fPIC", "-std=c++20", *COMMON_CFLAGS, *tier.cflags, "-c", str(tier_source(family)),
           "-o", str(out_dir / f"tier_{family}_{tier.name}.o")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def unrunnable_tiers(cap: str | None = None) -> list[str]:
    """The tiers none of whose compiled code this CPU runs: every tier whose CHATSERVE_* macros (the
    vec.h sections and per-tier branches it selects) no supported tier also defines (AVX512 and its
    BF16 section on an AVX2 host, AVX-VNNI on a plain AVX2 one), with the tiers above `cap` counted as
missing. Compiled, not run, by the slow tests."""
    def macros(tier: KernelTier) -> set[str]:
        return {f for f in tier.cflags if f.startswith("-DCHATSERVE_")}

    runnable = [macros(t) for t in supported_tiers(cap=cap)]
    return [t.name for t in TIERS.values() if not any(macros(t) <= have for have in runnable)]
