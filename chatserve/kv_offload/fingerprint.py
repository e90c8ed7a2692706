"""What must agree between the writer and the reader of a KV block: one digest of it.

A cached block is only the right block if every input that shaped its bytes is the same: the
weights (by content, not by path: a re-quantised file at the same path is another model), the
dtype, the KV geometry (layers, KV heads, head dim, block size), the attention backend (the CPU
kernels keep K/V in their own layout inside a block), the kernel tier and matmul path (tiers
round differently, so bit-identical greedy output after a load needs the same tier's bytes), the
rotary tables as resolved (theta, scaling, and the context length where the rope depends on it:
Phi-3's long-rope factors), the code that computes and lays out K/V (a hash of the kernel sources
and the Python that writes blocks: an upgrade that changes a kernel's rounding or the paged layout
is another namespace, even while old and new replicas share one Redis) and the versions of the
libraries that compute it. The digest is part of every key (so two models never look at each
other's entries) and of every entry's header (so an entry copied or renamed into the wrong place is
still refused). docs/prefix-cache.md has the table of fields.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

import xxhash

__all__ = ["KVFingerprint", "hash_model_files", "kv_code_hash", "library_versions", "FORMAT_VERSION",
           "KV_CODE_PATHS", "KV_LIBRARIES"]

FORMAT_VERSION = 2
"""The one version of the KV tiers' format: the entry layout (codec.py writes it in every header) and
the meaning of the fingerprint's fields (it is one of them). Bump it here, and only here, whenever
either changes: every older entry then becomes foreign (another name, refused if found).
2: the rope, code, library, KV dtype and salt fields; a MAC trailer under --kv-offload-secret."""

# What computes a block's K/V or lays it out, relative to the chatserve package: the kernels (C++ and
# Python), the attention backends that store K/V, the layers and models that compute it (rotary, norms,
# matmuls, loaders), the batch's slot mapping and the runner's block copies in and out of the pool.
KV_CODE_PATHS: tuple[str, ...] = (
    "kernels", "attention", "layers", "models", "forward_batch.py", "worker/kv_transfer.py",
    "worker/kv_pool.py", "worker/model_runner.py", "kv_offload/codec.py", "kv_offload/keys.py",
)
_CODE_SUFFIXES = frozenset({".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh"})
# Libraries whose version can change a block's bytes (torch's ops, transformers' rope and config
# parsing, gguf / numpy de-quantisation, safetensors loading), read from their installed metadata.
KV_LIBRARIES: tuple[str, ...] = ("chatserve", "torch", "transformers", "gguf", "numpy", "safetensors", "triton")
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
"""The chatserve package whose sources `kv_code_hash` reads (tests point it at a modified copy)."""


def kv_code_hash(root: str | None = None) -> str:
    """SHA-256 of every source file under `KV_CODE_PATHS` of the package at `root` (default:
    `PACKAGE_ROOT`), names and bytes, in a fixed order: any edit to a kernel or to the code that
    writes KV is another fingerprint. Computed once per process and root (~2 MB of sources)."""
    return _tree_hash(os.path.realpath(root or PACKAGE_ROOT))


@functools.cache
def _tree_hash(root: str) -> str:
    digest = hashlib.sha256()
    base = Path(root)
    for rel in KV_CODE_PATHS:
        path = base / rel
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if file.suffix not in _CODE_SUFFIXES or "__pycache__" in file.parts or not file.is_file():
                continue
            digest.update(str(file.relative_to(base)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def library_versions() -> str:
    """``name=version`` of each of `KV_LIBRARIES` ("-" where not installed), from the installed
    packages' metadata: nothing is imported (torch alone takes a second)."""
    parts = []
    for name in KV_LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        parts.append(f"{name}={version}")
    return ",".join(parts)


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
    """Everything that changes a KV block's bytes, or who may share it. ``digest`` names it in keys
    and headers. The fields with defaults are filled where they are known: the code and library
    fields here (the running process's), the rope fields by the engine's tiers from the model
    (``KVTiering``: ``with_rope``); the KV dtype and the salt domain by the features that add them."""

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
    rope: str = ""
    """Each rotary table's resolved parameters (type, theta, scaling) and a hash of the frequencies they
    give, as canonical JSON (``LlamaFamilyForCausalLM.rope_identity``)."""
    rope_max_positions: int = 0
    """The context length the rotary tables were built for, where they depend on it (long-rope's
    factors, dynamic NTK's base); 0 where they do not (any max_model_len shares the blocks)."""
    code_hash: str = field(default_factory=kv_code_hash)
    """SHA-256 of the kernel sources and the code that computes and writes K/V (``KV_CODE_PATHS``)."""
    libraries: str = field(default_factory=library_versions)
    """Versions of the libraries that compute K/V (``KV_LIBRARIES``, from importlib.metadata)."""
    kv_dtype: str = ""
    """The KV cache's element type where it differs from ``dtype`` (a quantized KV cache); "" = dtype."""
    salt_domain: str = ""
    """Who may share these blocks, where a deployment scopes it (cache salts); "" = every request."""
    format_version: int = FORMAT_VERSION

    def with_rope(self, tables: dict[str, dict[str, object]]) -> KVFingerprint:
        """This fingerprint with the rope fields of a model's ``rope_identity()``: per table, its
        ``parameters``, ``max_positions`` (None where the table does not depend on the context length)
        and ``inv_freq_sha256``."""
        lengths = [int(n) for t in tables.values() if isinstance(n := t.get("max_positions"), int)]
        return replace(self, rope=json.dumps(tables, sort_keys=True, separators=(",", ":"), default=str),
                       rope_max_positions=max(lengths, default=0))

    @property
    def digest(self) -> bytes:
        """16 bytes: blake2b of every field, in a fixed order."""
        text = "\n".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()
