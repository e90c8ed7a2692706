"""One way to compile a C++ kernel extension: torch's cpp_extension, cached per source hash and tier.

Why one helper: every extension (the AVX512-BF16 kernels, the quantized matmul, each tiered family)
needs the same things: a build folder named by a hash of its sources, the local files they include
(transitively) and the flags (torch rebuilds on source changes but not on header or flag changes), compiled from copies of the sources
inside that folder (so any checkout with the same sources reuses the build: `stage_sources`), an
flock so one process builds while the others wait (and a lock left by a killed builder is not waited
on forever), and a build that cannot happen (no compiler, no ninja) reported once and answered with
None, so callers fall back to torch ops.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
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


def build_root(build_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder the extensions are built in: `build_dir` (`EngineArgs.kernel_build_dir`, which
    `EngineArgs.from_env` fills from $TORCH_EXTENSIONS_DIR), else torch's own default,
    ~/.cache/torch_extensions/py<major><minor>_cpu. We pass it to torch as `build_directory`, so
    torch never looks for one itself and nothing here reads the environment."""
    if build_dir:
        return Path(build_dir).expanduser()
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
    """A hash of the files' names and bytes and of the flags: the build folder's identity (not the
    checkout's path: two checkouts with the same kernel sources share one build)."""
    digest = hashlib.sha1()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:10]


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def build_files(sources: Sequence[Path], headers: Sequence[Path] = ()) -> list[Path]:
    """`sources`, `headers` and every local file they `#include "..."`, transitively (a .cpp may
    include another .cpp), in name order: what an extension is compiled from, so what its build
    folder's name hashes.

    Why the closure and not every file of csrc/: an edit then rebuilds only the extensions that
    include the edited file (each tier's build takes minutes on 2 cores). An include is followed
    whatever #if surrounds it, so a file included under one tier's macro counts for every tier (a
    rebuild too many, never one too few); <...> includes are the system's and torch's, whose
    version is in the name already."""
    found: dict[Path, None] = {}
    todo = [Path(p) for p in [*sources, *headers]]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found[path] = None
        for name in _LOCAL_INCLUDE.findall(path.read_text(errors="replace")):
            included = path.parent / name
            if included.is_file():
                todo.append(included)
    return sorted(found, key=lambda p: (p.name, str(p)))


def stage_sources(build_dir: Path, files: Sequence[Path]) -> Path:
    """Copies of `files` in `build_dir`/src, the folder the extension is compiled from; returns it.

    Why copies: torch's JIT build writes the absolute source paths and include folders into its
    ninja file and its version check, so compiling a checkout's own csrc/ makes every checkout (a
    clean clone in CI, a git worktree) rebuild every tier, minutes on 2 cores. Compiled from a copy
    inside a folder named by the content, identical sources in any checkout are one build, loaded
    at once. A copy is written only where missing or different (the caller holds the build's flock),
    so an up-to-date build's sources keep their mtimes and ninja has nothing to redo.
    """
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for path in files:
        data = path.read_bytes()
        dest = src / path.name
        if not dest.is_file() or dest.read_bytes() != data:
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
    return src


def extension_name(stem: str, files: Sequence[Path], sources: Sequence[Path], cflags: Sequence[str], torch_version: str) -> str:
    """The build folder's (and module's) name: the stem and a hash of every staged file, which of
    them are compiled, the flags and torch's version (an extension links against the libtorch it
    was built with). Nothing of the checkout's path."""
    return f"{stem}_{sources_hash([*files, *sources], [*cflags, torch_version])}"


# Written into a build folder once its extension was built and imported.
BUILT_MARKER = "chatserve-built"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The extension an earlier build left in `build_dir`, imported as torch's `load` imports it, or
    None (never built here, or it does not import: then torch builds it again).

    Why not torch's `load` every time: its ninja file holds the absolute include paths of the torch
    that builds, so a checkout with another virtualenv (every clean clone, as CI makes one)
    recompiled every kernel (~3 minutes of a 2-core host's `make test`) although the folder's name
    (the hash of the sources, headers, flags and torch's version) says the build is the same one."""
    import importlib.util

    library = build_dir / f"{name}.so"
    if not (build_dir / BUILT_MARKER).is_file() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        logger.warning("C++ kernels %s: the cached build does not import (%s); building again", name, exc)
        return None
    return module


@functools.cache
def _build_cached(stem: str, sources: tuple[Path, ...], headers: tuple[Path, ...], cflags: tuple[str, ...],
                  root: Path) -> ModuleType | None:
    try:
        import torch
    except ImportError as exc:
        logger.warning("C++ kernels %s not built (%s); using torch ops", stem, exc)
        return None
    files = build_files(sources, headers)
    name = extension_name(stem, files, sources, cflags, torch.__version__)
    build_dir = root / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_build(build_dir):
            built = _import_built(name, build_dir)
            if built is not None:
                return built
            # Only a build needs torch's cpp_extension (it imports setuptools: ~0.13 s of every start).
            from torch.utils.cpp_extension import load

            src = stage_sources(build_dir, files)
            module = load(name=name, build_directory=str(build_dir), sources=[str(src / p.name) for p in sources],
                          extra_cflags=[*COMMON_CFLAGS, *cflags], extra_include_paths=[str(src)],
                          extra_ldflags=["-fopenmp"], verbose=False)
            (build_dir / BUILT_MARKER).write_text(f"{name}\n")
            return module
    except Exception as exc:  # no compiler, no ninja, unusual platform: the slower path still works
        logger.warning("C++ kernels %s could not be built (%s); using torch ops", stem,
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


def build_extension(stem: str, sources: Sequence[Path], *, cflags: Sequence[str], headers: Sequence[Path] = (),
                    build_dir: str | os.PathLike[str] | None = None) -> ModuleType | None:
    """The compiled extension `stem` (built once per hash of its files (`build_files`) and flags, under
    `build_root(build_dir)`, then imported from there), or None with one log line when it cannot be
    built. Cached per process and per build folder: two engines with different folders each get their own."""
    return _build_cached(stem, tuple(sources), tuple(headers), tuple(cflags), build_root(build_dir))
