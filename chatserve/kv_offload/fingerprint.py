"""What must agree between the writer and the reader of a KV block: one digest of it.

A cached block is only the right block if every input that shaped its bytes is the same: the
weights (by content, not by path: a re-quantised file at the same path is another model), the
dtype, the KV geometry (layers, KV heads, head dim, block size), the attention backend (the CPU
kernels keep K/V in their own layout inside a block) and the kernel tier and matmul path (tiers
round differently, so bit-identical greedy output after a load needs the same tier's bytes). The
digest is part of every key (so two models never look at each other's entries) and of every
entry's header (so an entry copied or renamed into the wrong place is still refused).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import xxhash

__all__ = ["KVFingerprint", "hash_model_files", "FORMAT_VERSION"]

FORMAT_VERSION = 1
"""Bumped whenever the entry format or the meaning of a field changes: old entries become foreign."""


def hash_model_files(paths: Iterable[str | os.PathLike], memo_path: str | None = None) -> str:
    """A content hash of the model's files (weights, config), streamed: xxh3-128 runs at memory speed,
    so a 140 MB GGUF costs tens of milliseconds. ``memo_path``: a JSON file remembering the hash by
    (path, size, mtime), so a many-GB checkpoint is read once, not at every start (a file rewritten in
    place gets a new mtime, hence a new hash)."""
    files = sorted(os.path.realpath(p) for p in paths)
    stamp = "|".join(f"{p}:{(st := os.stat(p)).st_size}:{st.st_mtime_ns}" for p in files)
    memo: dict[str, str] = {}
    if memo_path is not None:
        try:
            with open(memo_path) as f:
                memo = json.load(f)
            if stamp in memo:
                return memo[stamp]
        except (OSError, ValueError):
            memo = {}
    h = xxhash.xxh3_128()
    for path in files:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    if memo_path is not None:
        memo[stamp] = digest
        tmp = f"{memo_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dict(list(memo.items())[-64:]), f)
            os.replace(tmp, memo_path)
        except OSError:
            pass  # a memo we cannot write only costs the next start a re-read
    return digest


@dataclass(frozen=True)
class KVFingerprint:
    """Everything that changes a KV block's bytes. ``digest`` names it in keys and headers."""

    model_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str
    """The attention backend that wrote the block (its K/V layout inside the block)."""
    kernels: str
    """Matmul path and kernel tier (``LayerOps.describe()``): tiers round differently."""
    device_type: str
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> bytes:
        """16 bytes: blake2b of every field, in a fixed order."""
        text = "\n".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()
