"""CPU kernel tiers: which instruction sets a build targets, chosen once from the CPU's flags.

A tier is a name, the /proc/cpuinfo flags it needs, and the compiler flags its sources are built
with: every tier compiles the same kernel sources (csrc/tier_kernels.cpp and what it includes), its
flags and one CHATSERVE_* macro choosing vec.h's section. The tiers, best first:

- ``avx512_bf16``: the AVX512 tier plus AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4): the
  same sources at 16 lanes with CHATSERVE_BF16, which adds vec.h's bf16 operations (vdpbf16ps in
  the matmul's micro-kernel) and the AMX tile matmul (csrc/amx_gemm.cpp, used where AMX exists).
- ``avx512_vnni``: AVX512F/BW/VL/DQ + AVX512-VNNI, no BF16 (Ice Lake, Zen 4 without BF16 enabled):
  the kernel sources (csrc/tier_*.cpp over csrc/vec.h) at 16 lanes.
- ``avx2_vnni``: AVX2 + FMA + F16C + AVX-VNNI (Alder Lake and later client cores, Zen 5 desktop):
  the tiered sources at 8 lanes with vpdpbusd.
- ``avx2``: AVX2 + FMA + F16C (Haswell and later, Zen 1-3): the tiered sources at 8 lanes, int8 dot
  products from vpmaddubsw + vpmaddwd.

A lower tier can be forced where the CPU supports it (`EngineArgs.cpu_kernel_tier`), so every tier a
host can run is tested on it; a cap (`EngineArgs.max_cpu_tier`, passed here as `cap`) leaves the tiers
above it out of everything this module chooses. Nothing here reads the environment: the cap and the
build folder arrive as arguments (`EngineArgs.from_env` is where $CHATSERVE_MAX_CPU_TIER is read).

Within a tier every kernel keeps one fixed reduction order per output element (batch invariance);
results differ between tiers (a different lane count is a different order), so determinism is a
promise per tier, not across tiers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from chatserve.kernels.build import CSRC, build_extension


@dataclass(frozen=True)
class KernelTier:
    name: str
    cpu_flags: tuple[str, ...]  # every one must be in /proc/cpuinfo's flags
    cflags: tuple[str, ...]  # compiler flags of the kernel sources for this tier
    lanes: int  # fp32 lanes of the tier's vector type
    description: str


_AVX2 = ("-mavx2", "-mfma", "-mf16c", "-DCHATSERVE_TIER_AVX2")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c", "-DCHATSERVE_TIER_AVX512")
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c")
# -mamx-*: only csrc/amx_gemm.cpp's functions use tile instructions; they run only where amx_available()
_AVX512_BF16 = (*_AVX512, "-mavx512bf16", "-DCHATSERVE_BF16", "-mamx-tile", "-mamx-bf16")

# Best first.
TIERS: dict[str, KernelTier] = {t.name: t for t in (
    KernelTier("avx512_bf16", (*_AVX512_FLAGS, "avx512_bf16"), _AVX512_BF16, 16,
               "AVX512 + VNNI + BF16, 16 lanes (vdpbf16ps, AMX where present)"),
    KernelTier("avx512_vnni", _AVX512_FLAGS, _AVX512, 16, "AVX512 + VNNI, 16 lanes"),
    KernelTier("avx2_vnni", ("avx2", "fma", "f16c", "avx_vnni"), (*_AVX2, "-mavxvnni", "-DCHATSERVE_VNNI"), 8,
               "AVX2 + FMA + AVX-VNNI, 8 lanes"),
    KernelTier("avx2", ("avx2", "fma", "f16c"), _AVX2, 8, "AVX2 + FMA, 8 lanes (vpmaddubsw int8 dots)"),
)}
TIER_CHOICES = ("auto", *TIERS)
TIERED_FAMILIES = ("fused", "gemm", "attention", "quant")  # csrc/tier_<family>.cpp


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first flags line (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def tier_cap(name: str | None) -> KernelTier | None:
    """The best tier a process may use (`EngineArgs.max_cpu_tier`, a tier name), or None: no cap.

    Why a cap, as oneDNN's ONEDNN_MAX_CPU_ISA: greedy output is bit-exact per tier, so a fleet of
    mixed hosts capped at one tier answers the same on every host; and a machine with AVX512 runs the
    whole suite as an AVX2-only host would (with ATEN_CPU_CAPABILITY=avx2 for torch's own kernels).
    """
    if name is None:
        return None
    if name not in TIERS:
        raise ValueError(f"max_cpu_tier must be one of {', '.join(TIERS)}; got {name!r}")
    return TIERS[name]


def supported_tiers(flags: frozenset[str] | None = None, cap: str | None = None) -> list[KernelTier]:
    """The tiers this CPU (or a hypothetical one with `flags`) can run, best first, those above `cap`
    (a tier name, `EngineArgs.max_cpu_tier`) left out."""
    have = cpu_flags() if flags is None else flags
    tiers = [t for t in TIERS.values() if set(t.cpu_flags) <= have]
    limit = tier_cap(cap)
    if limit is not None:
        ranked = list(TIERS.values())
        tiers = [t for t in tiers if ranked.index(t) >= ranked.index(limit)]
    return tiers


def tested_tiers(cap: str | None = None) -> list[KernelTier]:
    """The tiers the test suite exercises on this host: every one it supports up to `cap` (auto's
    first, then each lower one forced), so a lower tier is checked on any machine that can run it."""
    return supported_tiers(cap=cap)


def select_tier(requested: str = "auto", flags: frozenset[str] | None = None, cap: str | None = None) -> KernelTier | None:
    """The tier to build for: the best the CPU runs up to `cap` (auto) or the one asked for; None
    where the CPU runs none of them (no AVX2: torch ops). Asking for a tier the CPU lacks, or one above
    the cap, is an error naming the field."""
    if requested not in TIER_CHOICES:
        raise ValueError(f"cpu_kernel_tier must be one of {', '.join(TIER_CHOICES)}; got {requested!r}")
    supported = supported_tiers(flags, cap)
    if requested == "auto":
        return supported[0] if supported else None
    tier = TIERS[requested]
    if tier not in supported:
        missing = sorted(set(tier.cpu_flags) - (cpu_flags() if flags is None else flags))
        if not missing:
            raise ValueError(f"cpu_kernel_tier={requested!r} is above max_cpu_tier={cap!r} "
                             f"(allowed here: {', '.join(t.name for t in supported) or 'none'})")
        raise ValueError(f"cpu_kernel_tier={requested!r} needs CPU flags this machine lacks: {', '.join(missing)} "
                         f"(supported here: {', '.join(t.name for t in supported) or 'none'})")
    return tier


def tier_source(family: str) -> Path:
    return CSRC / f"tier_{family}.cpp"


def build_tier_module(tier: KernelTier, build_dir: str | Path | None = None) -> ModuleType | None:
    """Every tiered family compiled for `tier` as one extension (csrc/tier_kernels.cpp: the family
    sources in one translation unit, plus the decoder-layer runner), cached per hash of the files it
    includes and the flags; None with one log line where it cannot be built. One extension, not one per family:
    each extra translation unit re-parses torch's headers (~40 s on 2 cores). `build_dir`: the
    folder the builds live in (`EngineArgs.kernel_build_dir`; None: torch's default, kernels/build.py);
    build.py caches the module per folder, so a second call is a dictionary lookup."""
    return build_extension(f"chatserve_tier_{tier.name}", [CSRC / "tier_kernels.cpp"], cflags=tier.cflags,
                           build_dir=build_dir)


def build_tier_family(family: str, tier: KernelTier, build_dir: str | Path | None = None) -> ModuleType | None:
    """The extension holding csrc/tier_<family>.cpp's functions for `tier` (build_tier_module's),
    or None where it cannot be built."""
    if family not in TIERED_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; one of {', '.join(TIERED_FAMILIES)}")
    return build_tier_module(tier, build_dir)
