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
from chatserve.kernels.tiers import KernelTier, tier_source


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
