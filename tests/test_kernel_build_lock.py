"""The kernel build lock: one builder at a time, and a lock left by a killed builder never stalls the next."""

from __future__ import annotations

import fcntl
import subprocess
import sys

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
