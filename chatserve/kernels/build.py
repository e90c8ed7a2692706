"""One way to compile a C++ kernel extension: torch's cpp_extension, cached per source hash and tier.

Why one helper: every extension (the AVX512-BF16 kernels, the quantized matmul, each tiered family)
needs the same things: a build folder named by a hash of its sources, headers and flags (torch
rebuilds on source changes but not on header or flag changes, and checkouts sharing one name would
rebuild over each other), an flock so one process builds while the others wait (and a lock left by
a killed builder is not waited on forever), and a build that cannot happen (no compiler, no ninja)
reported once and answered with None, so callers fall back to torch ops.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

# -fopenmp: at::parallel_for is inlined from headers and is serial without it.
# -ffp-contract=off: no multiply fuses with an add unless the source says so, so a kernel's
# arithmetic is the same in every place it is inlined (batch invariance, issue 20).
COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")


def build_root() -> Path:
    """Where torch's cpp_extension would build (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<py>_cpu)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """One builder at a time, and no stale lock from a builder that died.

    Why: torch's own build lock is a plain file that a killed process leaves behind, and every
    later process then waits on it forever (a test's server killed at its startup timeout while
    compiling stalled the rest of CI). An flock is released by the kernel when its holder dies;
    holding it, nobody else is building, so a leftover torch lock is stale and is removed.
    """
    import fcntl

    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sources_hash(paths: Sequence[Path], flags: Sequence[str] = ()) -> str:
    """A hash of the checkout's path, the files' bytes and the flags: the build folder's identity."""
    digest = hashlib.sha1(str(CSRC.resolve()).encode())
    for path in paths:
        digest.update(path.read_bytes())
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:10]


@functools.cache
def _build_cached(stem: str, sources: tuple[Path, ...], headers: tuple[Path, ...], cflags: tuple[str, ...]) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load
    except ImportError as exc:
        logger.warning("C++ kernels %s not built (%s); using torch ops", stem, exc)
        return None
    name = f"{stem}_{sources_hash(sources + headers, cflags)}"
    build_dir = build_root() / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_build(build_dir):
            return load(name=name, build_directory=str(build_dir), sources=[str(p) for p in sources],
                        extra_cflags=[*COMMON_CFLAGS, *cflags], extra_include_paths=[str(CSRC)],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, unusual platform: the slower path still works
        logger.warning("C++ kernels %s could not be built (%s); using torch ops", stem,
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


def build_extension(stem: str, sources: Sequence[Path], *, cflags: Sequence[str], headers: Sequence[Path] = ()) -> ModuleType | None:
    """The compiled extension `stem` (built once per hash of sources, headers and flags, then
    imported from the cache), or None with one log line when it cannot be built."""
    return _build_cached(stem, tuple(sources), tuple(headers), tuple(cflags))
