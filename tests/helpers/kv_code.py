"""A copy of the code the KV fingerprint hashes (kv_offload/fingerprint.py: KV_CODE_PATHS), with one
kernel source changed: what an upgrade that changes a kernel's rounding looks like to the hash."""

from __future__ import annotations

import shutil
from pathlib import Path


def copy_kv_code(dst: Path) -> Path:
    """The chatserve package's sources (what the fingerprint hashes among them) copied to `dst`."""
    import chatserve

    shutil.copytree(Path(chatserve.__file__).parent, dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dst


def edited_kv_code(dst: Path, kernel: str = "kernels/csrc/tier_attention.cpp") -> Path:
    """`copy_kv_code` with one byte appended to `kernel` (a C++ source of the paged attention)."""
    copy_kv_code(dst)
    path = dst / kernel
    path.write_bytes(path.read_bytes() + b"\n")
    return dst
