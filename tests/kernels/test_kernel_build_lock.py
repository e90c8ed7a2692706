"""The kernel build lock: one builder at a time, and a lock left by a killed builder never stalls the next."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from chatserve.kernels.build import exclusive_build as _exclusive_build


def test_a_stale_torch_lock_is_removed_and_the_build_is_exclusive(tmp_path):
    build_dir = tmp_path / "chatserve_cpu_kernels_x"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # what torch's FileBaton leaves when its process is killed
    with _exclusive_build(build_dir):
        assert not (build_dir / "lock").exists()
        probe = (f"import fcntl,sys; f=open({str(build_dir.parent / (build_dir.name + '.flock'))!r},'w')\n"
                 "try:\n fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); sys.exit(0)\n"
                 "except BlockingIOError:\n sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 3  # another builder waits
    with open(build_dir.parent / f"{build_dir.name}.flock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit


def test_a_builder_that_dies_releases_the_lock(tmp_path):
    build_dir = tmp_path / "chatserve_cpu_kernels_y"
    build_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from pathlib import Path; from chatserve.kernels.build import exclusive_build\n"
                               f"cm = exclusive_build(Path({str(build_dir)!r})); cm.__enter__()\n"
                               "print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (build_dir / "lock").write_text("")
        holder.kill()
        holder.wait(timeout=60)
        with _exclusive_build(build_dir):  # returns: the dead holder's flock is gone, and so is its torch lock
            assert not (build_dir / "lock").exists()
    finally:
        holder.kill()


def test_the_build_is_named_by_content_not_by_checkout(tmp_path):
    """A clean clone or a worktree with the same kernel sources gets the same build folder name (so it
    loads the build instead of compiling every tier again); any changed byte or flag is another build."""
    import shutil

    from chatserve.kernels.build import CSRC, build_files, extension_name

    files = build_files([CSRC / "tier_kernels.cpp"])
    assert {p.name for p in files} >= {"tier_kernels.cpp", "vec.h", "amx_gemm.cpp", "tier_gemm.cpp"}
    other = tmp_path / "another-checkout" / "csrc"
    shutil.copytree(CSRC, other)
    copies = build_files([other / "tier_kernels.cpp"])
    assert [p.name for p in copies] == [p.name for p in files]
    name = extension_name("chatserve_tier_avx2", files, [CSRC / "tier_kernels.cpp"], ["-mavx2"], "2.13.0")
    assert extension_name("chatserve_tier_avx2", copies, [other / "tier_kernels.cpp"], ["-mavx2"], "2.13.0") == name
    assert extension_name("chatserve_tier_avx2", copies, [other / "tier_kernels.cpp"], ["-mavx2"], "2.14.0") != name
    assert extension_name("chatserve_tier_avx2", copies, [other / "tier_kernels.cpp"], ["-mavx512f"], "2.13.0") != name
    (other / "vec.h").write_bytes((other / "vec.h").read_bytes() + b"\n// changed\n")
    assert extension_name("chatserve_tier_avx2", copies, [other / "tier_kernels.cpp"], ["-mavx2"], "2.13.0") != name


def test_an_edit_renames_only_the_builds_that_include_the_file(tmp_path):
    """A build's name covers its sources and the local files they include, transitively, and nothing
    else of the folder: editing a kernel rebuilds only the extensions that include it."""
    from chatserve.kernels.build import build_files, extension_name

    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.cpp").write_text('#include "x.h"\nint a();\n')
    (csrc / "b.cpp").write_text('#include <vector>\n  #  include "y.h"\nint b();\n')
    (csrc / "y.h").write_text('#pragma once\n#if defined(ONLY_SOME_TIERS)\n#include "z.cpp"\n#endif\n')
    for name in ("x.h", "z.cpp", "unused.h"):
        (csrc / name).write_text(f"// {name}\n")
    (csrc / "cycle.h").write_text('#include "cycle.h"\n')  # an include cycle ends

    def names() -> dict[str, str]:
        return {src: extension_name(src, build_files([csrc / src]), [csrc / src], [], "2.13.0")
                for src in ("a.cpp", "b.cpp")}

    assert [p.name for p in build_files([csrc / "b.cpp"])] == ["b.cpp", "y.h", "z.cpp"]
    assert [p.name for p in build_files([csrc / "cycle.h"])] == ["cycle.h"]
    before = names()
    for edited, renamed in (("z.cpp", {"b.cpp"}), ("x.h", {"a.cpp"}), ("unused.h", set()), ("y.h", {"b.cpp"})):
        (csrc / edited).write_text((csrc / edited).read_text() + "// edited\n")
        after = names()
        assert {src for src in before if after[src] != before[src]} == renamed, edited
        before = after


def test_staged_sources_are_rewritten_only_when_they_change(tmp_path):
    """The copies the extension is compiled from keep their mtimes while equal (ninja then has nothing
    to redo) and follow the checkout when a file changes."""
    import os

    from chatserve.kernels.build import stage_sources

    checkout = tmp_path / "csrc"
    checkout.mkdir()
    (checkout / "a.cpp").write_text("int a() { return 1; }\n")
    (checkout / "v.h").write_text("#pragma once\n")
    files = [checkout / "a.cpp", checkout / "v.h"]
    src = stage_sources(tmp_path / "build", files)
    assert sorted(p.name for p in src.iterdir()) == ["a.cpp", "v.h"]
    for p in src.iterdir():
        os.utime(p, ns=(1, 1))
    stage_sources(tmp_path / "build", files)
    assert [p.stat().st_mtime_ns for p in sorted(src.iterdir())] == [1, 1]
    (checkout / "a.cpp").write_text("int a() { return 2; }\n")
    stage_sources(tmp_path / "build", files)
    assert (src / "a.cpp").read_text() == "int a() { return 2; }\n" and (src / "v.h").stat().st_mtime_ns == 1


def test_the_session_built_kernels_from_staged_copies():
    """The kernels this run built (tests/conftest.py) were compiled from their build folder's copies:
    the ninja file names no path of this checkout."""
    import pytest

    from chatserve.kernels.build import CSRC
    from chatserve.kernels.tiers import TIERS, build_tier_module, tested_tiers
    from tests.conftest import PROCESS_ENGINE_ARGS as run

    tiers = tested_tiers(run.max_cpu_tier)
    if not tiers:
        pytest.skip("no kernel tier on this CPU")
    module = build_tier_module(TIERS[tiers[-1].name], run.kernel_build_dir)
    if module is None:
        pytest.fail("the kernels of a tier this CPU runs could not be built")
    from pathlib import Path

    build_dir = Path(module.__file__).parent
    ninja = (build_dir / "build.ninja").read_text()
    assert str(CSRC.resolve()) not in ninja and str(build_dir / "src") in ninja


_TINY_EXTENSION = r"""
#include <Python.h>
#define CHATSERVE_CONCAT2(a, b) a##b
#define CHATSERVE_CONCAT(a, b) CHATSERVE_CONCAT2(a, b)
#define CHATSERVE_STR2(a) #a
#define CHATSERVE_STR(a) CHATSERVE_STR2(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, CHATSERVE_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CHATSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


def test_a_finished_build_is_imported_not_compiled_again(tmp_path, monkeypatch):
    """A checkout whose torch lives in another virtualenv (a clean clone) imports the build its
    folder holds: torch's `load` would compile it again (its ninja file names the other torch's
    include paths). A folder without the finished-build mark, or whose library does not import,
    goes to torch's `load` as before."""
    import torch
    import torch.utils.cpp_extension

    from chatserve.kernels import build

    root = build.build_root(tmp_path / "builds")  # EngineArgs.kernel_build_dir
    source = tmp_path / "tiny.cpp"
    source.write_text(_TINY_EXTENSION)
    build_once = build._build_cached.__wrapped__  # past the per-process cache: each call is a new process's
    first = build_once("chatserve_test_tiny", (source,), (), (), root)
    assert first is not None and first.answer() == 42
    build_dir = Path(first.__file__).parent
    assert (build_dir / build.BUILT_MARKER).is_file()

    calls = []

    def compile_again(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("compiled again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_again)
    again = build_once("chatserve_test_tiny", (source,), (), (), root)
    assert again is not None and again.answer() == 42 and calls == []

    (build_dir / build.BUILT_MARKER).unlink()  # a folder an unfinished (or older) build left
    assert build_once("chatserve_test_tiny", (source,), (), (), root) is None and len(calls) == 1

    # a marked folder whose library does not import (a damaged file): torch's `load` again. (Another
    # source, so another name: this process has the first library loaded, which a re-import reuses.)
    other = tmp_path / "other.cpp"
    other.write_text(_TINY_EXTENSION + "// another build\n")
    name = build.extension_name("chatserve_test_tiny", build.build_files([other]), [other], [], torch.__version__)
    damaged = root / name
    damaged.mkdir(parents=True)
    (damaged / f"{name}.so").write_bytes(b"not a shared library")
    (damaged / build.BUILT_MARKER).write_text(f"{name}\n")
    assert build_once("chatserve_test_tiny", (other,), (), (), root) is None and calls[-1] == name and len(calls) == 2
