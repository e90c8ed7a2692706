"""Repacked weights written once to a disk cache and memory-mapped at later starts, as llama.cpp maps
its GGUF file (issue #33).

Why: every start used to read the whole model, de-quantise or copy it and repack every weight into
its kernel's layout (seconds for the default model, tens of seconds for a 1B one on a loaded 2-core
host), and every replica on a machine held a private copy of the result. Now the first start writes
what the repacking produced to one file per (source, kernel tier, matmul method, quantization,
dtype); later starts map that file read-only and point every layer at views of the mapping: no
weight is read twice, nothing is repacked, and the page cache holds one copy that every replica of
the model on the machine shares (their resident sets count it as shared, not private, memory).

What makes an entry usable, checked before anything of it is used (any mismatch is a rebuild, never
an error and never a wrong weight):

- the file's magic and format version (`FORMAT_VERSION`), a CRC of its header, its exact size (a
  truncated file), and a CRC of every tensor's bytes (a corrupted one);
- the source, as it is now: each file's size, mtime and a hash of its header (GGUF metadata and
  tensor table, or a safetensors JSON header; a folder's config.json), and a hash of the code and
  library versions that produced the layout (models/, layers/, kernels/ and the C++ sources; torch,
  gguf, transformers), so an edit or an upgrade rebuilds instead of mapping a stale layout;
- what chose the layout (`layout_identity`): the model class, dtype, device, matmul method and its
  description (kernel tier, AMX, GGUF blocks or int8), the kernel tier of the other ops and the GGUF
  types kept in blocks. This also names the file, so one model's tiers sit side by side.

The folder is bounded (`--weight-cache-max-gb`): after an entry is written, the least recently
used entries (by mtime, which every hit refreshes) are removed until the folder fits, never the
one just written; an entry larger than the whole bound is not written at all (that start keeps
its weights in private memory, and says so). Removing an entry another process has mapped is safe:
its pages stay until that process unmaps them.

Writes go to a temporary file renamed into place, under an flock held for the whole build, so of
several processes starting at once one builds and the others wait and then map its file; a writer
killed half-way leaves a temporary file that the next builder removes, never a half entry.

What is saved is every parameter left after `process_weights` plus each `Linear`'s
`LinearMethod.processed_state` (packed panels, quantized segments), with aliases kept (a tied
lm_head and embedding share one tensor). A model class opts in by having `finish_processing`, the
tail of `process_weights` that runs again after restoring (tied embeddings, the C++ layer stack);
weights held anywhere else would be missing after a restore, so a family that keeps tensors outside
parameters and Linear methods must not define it.

What is not a weight is never saved and always rebuilt: a hit runs neither `load_weights` nor
`process_weights`, so everything a model builds at load that is not a parameter or a Linear's
processed state (its rotary tables, Gemma 3's local and global ones included; Gemma's (1 + w) norm
scales; anything similar a family adds) is built by the model's `post_load()`, which
`load_weights_cached` calls last on every path: cache off, unusable, written, or mapped. A model
that built such state in `load_weights` answered differently at its second start (issue 51);
tests/models/test_weight_cache_families.py loads every family twice from one cache and compares logits bit
for bit.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from chatserve.layers.linear import Linear
from chatserve.models.loader import ModelSource, metadata_cache_root

logger = logging.getLogger(__name__)

MAGIC = b"CSWCACHE"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQ")  # magic, format version, CRC32 of the header JSON, header length
_DATA_ALIGN = 4096  # the data section starts on a page
_TENSOR_ALIGN = 64  # every tensor starts on a cache line (the kernels' aligned loads)
_FREE_MARGIN = 512 * 2**20  # bytes a write must leave free on the cache's filesystem
CACHE_SUBDIR = "repacked-weights"
ENTRY_SUFFIX = ".weights"

Status = Literal["off", "hit", "built", "unsupported", "not-written"]


class WeightCacheError(RuntimeError):
    """An entry that passed every check but does not fit the model built from the same code (a bug)."""


@dataclass(frozen=True)
class WeightCacheConfig:
    """From `EngineArgs.weight_cache` / `weight_cache_dir` / `cache_dir`: whether to use the cache, and where."""

    enabled: bool = True
    directory: str | None = None  # None: repacked-weights/ in `cache_dir` (`default_cache_dir`)
    max_bytes: int = 20 * 2**30  # the folder's entries together; the least recently used go first
    cache_dir: str | None = None  # chatserve's cache folder (`EngineArgs.cache_dir`); None: ~/.cache/chatserve

    def resolved_dir(self) -> Path:
        return Path(self.directory).expanduser() if self.directory else default_cache_dir(self.cache_dir)


def default_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """repacked-weights/ in chatserve's cache folder (`EngineArgs.cache_dir`, else ~/.cache/chatserve):
    beside the converted GGUF metadata (loader.gguf_metadata_folder)."""
    return metadata_cache_root(cache_dir) / CACHE_SUBDIR


@dataclass(frozen=True)
class WeightCacheResult:
    """What the cache did at this load: `status` and, where a file was used or written, its path."""

    status: Status
    path: Path | None = None
    reason: str = ""  # why an entry was (re)built, or why the cache was not used

    def describe(self) -> str:
        where = f" {self.path}" if self.path is not None else ""
        why = f" ({self.reason})" if self.reason else ""
        return {"off": "off", "hit": "mapped", "built": "written and mapped", "unsupported": "not used",
                "not-written": "not written"}[self.status] + where + why


# ---------------------------------------------------------------- what an entry must match

@functools.cache
def code_fingerprint() -> str:
    """A hash of the code and library versions that decide the layout: every source under
    chatserve/models, layers and kernels (C++ included) and torch, gguf, transformers' versions."""
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for sub in ("models", "layers", "kernels"):
        for path in sorted((root / sub).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cpp", ".h", ".hpp"):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("torch", "gguf", "transformers"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{package}={version}\0".encode())
    return digest.hexdigest()


def _file_fingerprint(path: Path, header_bytes: Callable[[Any], int]) -> dict[str, Any]:
    """Size, mtime and a SHA-256 of the first `header_bytes(mapping)` bytes of one source file."""
    st = path.stat()
    with open(path, "rb") as f:
        if st.st_size == 0:
            digest = hashlib.sha256().hexdigest()
        else:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                digest = hashlib.sha256(buf[: header_bytes(buf)]).hexdigest()
            finally:
                buf.close()
    return {"file": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": digest}


def _gguf_header_end(buf: Any) -> int:
    from chatserve.models.gguf_header import gguf_data_offset

    return gguf_data_offset(buf)


def _safetensors_header_end(buf: Any) -> int:
    (n,) = struct.unpack_from("<Q", buf, 0) if len(buf) >= 8 else (0,)
    return min(len(buf), 8 + n)


def source_fingerprint(source: ModelSource) -> list[dict[str, Any]]:
    """What the cache entry must still match of the model's files (a GGUF file, or a folder's
    safetensors files and config.json)."""
    if source.gguf_file is not None:
        return [_file_fingerprint(Path(source.folder, source.gguf_file).resolve(), _gguf_header_end)]
    folder = Path(source.folder).resolve()
    files = [_file_fingerprint(p, _safetensors_header_end) for p in sorted(folder.glob("*.safetensors"))]
    config = folder / "config.json"
    if config.is_file():
        files.append(_file_fingerprint(config, len))
    return files


def layout_identity(model: nn.Module, source: ModelSource, dtype: torch.dtype, device: torch.device, ops: Any) -> dict[str, Any]:
    """Everything that chooses the bytes of the processed weights, besides the source's contents and the
    code: one entry (one file) per distinct value."""
    path = Path(source.folder, source.gguf_file) if source.gguf_file is not None else Path(source.folder)
    linear = ops.linear
    return {
        "source": str(path.resolve()),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "linear_method": type(linear).__qualname__,
        "linear": linear.description,
        "quant_tier": getattr(getattr(linear, "quant", None), "tier", None),
        "kernel_tier": ops.cpu.tier if ops.cpu is not None else None,
        "gguf_qtypes": sorted(ops.gguf_qtypes),
    }


def entry_path(directory: Path, source: ModelSource, identity: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[:80]
    return directory / f"{stem}-{digest}{ENTRY_SUFFIX}"


# ---------------------------------------------------------------- the model's processed state

@dataclass
class _Captured:
    tensors: list[torch.Tensor]  # in file order; a layout refers to them by index
    layout: dict[str, Any]  # {"params": {name: index}, "linears": {name: {"values": {...}, "tensors": {key: index}}}}


def capture(model: nn.Module) -> _Captured | str:
    """Every parameter of a processed model and each Linear's `processed_state`, tensors deduplicated
    (aliases such as a tied lm_head keep one copy); or, where some layer's state cannot be saved, why."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def add(t: torch.Tensor) -> int:
        if id(t) not in index:
            index[id(t)] = len(tensors)
            tensors.append(t.detach())
        return index[id(t)]

    params: dict[str, int] = {}
    linears: dict[str, dict[str, Any]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                params[f"{mname}.{pname}" if mname else pname] = add(p)
        if isinstance(module, Linear):
            state = module.method.processed_state(module)
            if state is None:
                return f"{mname}'s weights are in a layout that cannot be saved ({module.method.description})"
            values = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            refs = {k: add(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
            linears[mname] = {"values": values, "tensors": refs}
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.layout != torch.strided or t.is_mkldnn:
            return f"a weight of type {t.type()} cannot be written to a file"
    return _Captured(tensors, {"params": params, "linears": linears})


def restore(model: nn.Module, layout: dict[str, Any], views: list[torch.Tensor]) -> None:
    """Point the model's parameters and every Linear's processed state at `views` (tensors of the
    mapped file), then let the model finish as `process_weights` does. Names under modules that the
    model builds only in `finish_processing` (a tied embedding's reference to the lm_head) are
    aliases of names that do resolve, and are skipped."""
    modules = dict(model.named_modules(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}
    restored_linears: set[int] = set()
    for name, i in layout["params"].items():
        mname, _, pname = name.rpartition(".")
        module = modules.get(mname)
        if module is None:
            continue
        old = module._parameters.get(pname)
        view = views[i]
        if old is not None and (tuple(old.shape) != tuple(view.shape) or old.dtype != view.dtype):
            raise WeightCacheError(f"{name}: cached {tuple(view.shape)} {view.dtype}, model has {tuple(old.shape)} {old.dtype}")
        if i not in made:
            made[i] = nn.Parameter(view, requires_grad=False)
        module._parameters[pname] = made[i]
    for mname, entry in layout["linears"].items():
        module = modules.get(mname)
        if module is None:
            continue
        if not isinstance(module, Linear):
            raise WeightCacheError(f"{mname} is a Linear in the cache but a {type(module).__name__} in the model")
        if id(module) not in restored_linears:
            state = dict(entry["values"])
            state.update((k, views[i]) for k, i in entry["tensors"].items())
            module.method.restore_processed(module, state)
            restored_linears.add(id(module))
    missing = [n for n, m in modules.items() if isinstance(m, Linear) and id(m) not in restored_linears]
    if missing:
        raise WeightCacheError(f"layers missing from the cache: {missing[:4]}")
    model.finish_processing()  # type: ignore[operator]
    mapped = {id(p) for p in made.values()}
    stray = [n for n, p in model.named_parameters() if id(p) not in mapped]
    if stray:
        raise WeightCacheError(f"parameters not restored from the cache: {stray[:4]}")


# ---------------------------------------------------------------- the file

def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


def write_entry(path: Path, header: dict[str, Any], tensors: list[torch.Tensor], *, max_bytes: int | None = None) -> None:
    """Write the entry to a temporary file beside `path` and rename it into place (the caller holds the
    lock); then, with `max_bytes`, evict the least recently used other entries until the folder fits."""
    records: list[dict[str, Any]] = []
    offset = 0
    for t in tensors:
        data = _tensor_bytes(t)
        records.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset,
                        "nbytes": data.nbytes, "crc32": zlib.crc32(data)})
        offset = _align(offset + data.nbytes, _TENSOR_ALIGN)
    body = json.dumps({**header, "tensors": records, "data_nbytes": offset}, sort_keys=True).encode()
    data_start = _align(_PREAMBLE.size + len(body), _DATA_ALIGN)
    total = data_start + offset
    if max_bytes is not None and total > max_bytes:
        raise OSError(f"the entry needs {total / 2**30:.2f} GiB, more than the whole cache may hold "
                      f"({max_bytes / 2**30:.2f} GiB, --weight-cache-max-gb)")
    free = shutil.disk_usage(path.parent).free
    if free < total + _FREE_MARGIN:
        raise OSError(f"{free / 2**30:.1f} GiB free on {path.parent}, the entry needs {total / 2**30:.2f} GiB + a margin")
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, zlib.crc32(body), len(body)))
            f.write(body)
            for t, rec in zip(tensors, records):
                f.seek(data_start + rec["offset"])
                f.write(_tensor_bytes(t))
            f.truncate(total)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if max_bytes is not None:
        evict_to_fit(path.parent, max_bytes, keep=path)


def evict_to_fit(directory: Path, max_bytes: int, *, keep: Path) -> list[Path]:
    """Remove the least recently used entries (oldest mtime first) of `directory` until its entries
    fit in `max_bytes`; `keep` is never removed. Returns what was removed. An entry that vanishes
    meanwhile (another process evicting too) is skipped."""
    entries = []
    for entry in directory.glob(f"*{ENTRY_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat()
            entries.append((st.st_mtime, st.st_size, entry))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if entry == keep:
            continue
        entry.unlink(missing_ok=True)
        (entry.parent / f"{entry.name}.lock").unlink(missing_ok=True)
        total -= size
        removed.append(entry)
        logger.info("weight cache: removed %s (%.2f GiB; the cache holds at most %.2f GiB)", entry, size / 2**30,
                    max_bytes / 2**30)
    return removed


@dataclass
class MappedEntry:
    header: dict[str, Any]
    views: list[torch.Tensor]  # views of `buffer`, in the header's tensor order
    buffer: mmap.mmap


_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                                      torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}


def open_entry(path: Path, identity: dict[str, Any], validity: dict[str, Any], threads: int = 1) -> MappedEntry | str:
    """The entry mapped read-only with one tensor view per record, or why it cannot be used."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return "no entry yet"
    except OSError as exc:
        return f"unreadable ({exc})"
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREAMBLE.size:
            return f"truncated ({size} bytes)"
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for advice in ("MADV_HUGEPAGE", "MADV_WILLNEED"):  # huge pages where the filesystem's page cache has them
        with contextlib.suppress(AttributeError, OSError):
            buf.madvise(getattr(mmap, advice))
    try:
        result = _check(buf, size, identity, validity, threads)
    except Exception as exc:  # any malformed header: a rebuild, never a crash
        result = f"unreadable header ({type(exc).__name__}: {exc})"
    if isinstance(result, str):
        buf.close()
        return result
    return result


def _check(buf: mmap.mmap, size: int, identity: dict[str, Any], validity: dict[str, Any], threads: int) -> MappedEntry | str:
    magic, version, crc, n = _PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        return "not a weight cache file"
    if version != FORMAT_VERSION:
        return f"format version {version}, this chatserve writes {FORMAT_VERSION}"
    if _PREAMBLE.size + n > size:
        return "truncated header"
    body = buf[_PREAMBLE.size : _PREAMBLE.size + n]
    if zlib.crc32(body) != crc:
        return "header checksum mismatch (corrupted)"
    header = json.loads(body)
    if header.get("identity") != identity:
        return "written for another layout (hash collision of the file name)"
    stale = _first_difference(header.get("validity"), validity)
    if stale:
        return stale
    data_start = _align(_PREAMBLE.size + n, _DATA_ALIGN)
    records = header["tensors"]
    if size != data_start + header["data_nbytes"]:
        return f"truncated ({size} bytes, expected {data_start + header['data_nbytes']})"
    for rec in records:
        if rec["dtype"] not in _DTYPES or rec["offset"] + rec["nbytes"] > header["data_nbytes"]:
            return "bad tensor record (corrupted)"
    whole = memoryview(buf)
    try:
        def crc_ok(rec: dict[str, Any]) -> bool:  # zlib releases the GIL: threads check tensors side by side
            start = data_start + rec["offset"]
            return zlib.crc32(whole[start : start + rec["nbytes"]]) == rec["crc32"]

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            if not all(pool.map(crc_ok, sorted(records, key=lambda r: -r["nbytes"]))):
                return "tensor checksum mismatch (corrupted)"
    finally:
        whole.release()
    views = []
    with warnings.catch_warnings():  # "the given buffer is not writable": read-only is the point
        warnings.simplefilter("ignore", UserWarning)
        for rec in records:
            dtype, shape = _DTYPES[rec["dtype"]], tuple(rec["shape"])
            if rec["nbytes"] == 0:
                views.append(torch.empty(shape, dtype=dtype))
                continue
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=rec["nbytes"], offset=data_start + rec["offset"])
            views.append(flat.view(dtype).view(shape))
    return MappedEntry(header, views, buf)


def _first_difference(found: Any, expected: dict[str, Any]) -> str:
    """'' where the entry's validity record equals today's, else what changed (for the log line)."""
    if not isinstance(found, dict):
        return "no validity record"
    if found.get("format") != expected["format"]:
        return "written by another format"
    if found.get("code") != expected["code"]:
        return "written by other chatserve code or torch / gguf / transformers versions"
    old, new = found.get("source") or [], expected["source"]
    if len(old) != len(new):
        return "the source's files changed"
    for a, b in zip(old, new):
        for key in ("file", "size", "mtime_ns", "header_sha256"):
            if a.get(key) != b[key]:
                return f"the source changed ({b['file']}: {key.replace('_', ' ')})"
    return ""


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One builder of an entry at a time; the kernel drops the lock if its holder dies."""
    import fcntl

    fd = os.open(path.parent / f"{path.name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


# ---------------------------------------------------------------- loading through the cache

def load_weights_cached(model: nn.Module, fill: Callable[[], None], *, config: WeightCacheConfig | None,
                        source: ModelSource, dtype: torch.dtype, device: torch.device, ops: Any) -> WeightCacheResult:
    """Give `model` its processed weights: mapped from a valid cache entry, or by `fill()` (load_weights +
    process_weights) and then written to the cache and mapped from it; then, whichever way they came,
    `model.post_load()` builds what is not a weight (rotary tables, derived scales). The model must
    have been built but not filled."""
    result = _fill_or_map(model, fill, config=config, source=source, dtype=dtype, device=device, ops=ops)
    model.post_load()  # type: ignore[operator]  # every path: a hit never ran load_weights / process_weights
    return result


def _fill_or_map(model: nn.Module, fill: Callable[[], None], *, config: WeightCacheConfig | None,
                 source: ModelSource, dtype: torch.dtype, device: torch.device, ops: Any) -> WeightCacheResult:
    if config is None or not config.enabled:
        fill()
        return WeightCacheResult("off")
    unfit = None
    if device.type != "cpu":
        unfit = f"the weights live on {device.type}, not in mappable host memory"
    elif not callable(getattr(model, "finish_processing", None)):
        unfit = f"{type(model).__name__} does not support it (no finish_processing)"
    directory = config.resolved_dir()
    if unfit is None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if config.directory:
                raise ValueError(f"weight_cache_dir={config.directory!r} cannot be created ({exc}); pass a writable "
                                 "folder, or turn the cache off (weight_cache=False, --no-weight-cache)") from None
            unfit = f"{directory} cannot be created ({exc})"
    if unfit is not None:
        logger.info("weight cache not used: %s", unfit)
        fill()
        return WeightCacheResult("unsupported", reason=unfit)

    identity = layout_identity(model, source, dtype, device, ops)
    validity = {"format": FORMAT_VERSION, "code": code_fingerprint(), "source": source_fingerprint(source)}
    path = entry_path(directory, source, identity)
    threads = torch.get_num_threads()
    found = open_entry(path, identity, validity, threads)
    if isinstance(found, MappedEntry):
        return _restore_fresh(model, found, path)
    with _exclusive(path):
        again = open_entry(path, identity, validity, threads)  # built by another process while we waited?
        if isinstance(again, MappedEntry):
            return _restore_fresh(model, again, path)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a writer killed half-way (we hold the lock)
            stale.unlink(missing_ok=True)
        fill()
        captured = capture(model)
        if isinstance(captured, str):
            logger.info("weight cache not used: %s", captured)
            return WeightCacheResult("unsupported", reason=captured)
        header = {"identity": identity, "validity": validity, "layout": captured.layout}
        try:
            write_entry(path, header, captured.tensors, max_bytes=config.max_bytes)
        except OSError as exc:
            logger.warning("weight cache entry %s not written (%s): this start keeps its own copy of the weights", path, exc)
            return WeightCacheResult("not-written", path, str(exc))
    del captured
    written = open_entry(path, identity, validity, threads)
    if isinstance(written, str):  # replaced meanwhile by a process of another code version, say
        logger.warning("weight cache entry %s unusable right after writing it (%s)", path, written)
        return WeightCacheResult("not-written", path, written)
    try:
        restore(model, written.header["layout"], written.views)  # the same bytes: the model stays correct
    except WeightCacheError as exc:
        path.unlink(missing_ok=True)
        logger.warning("weight cache entry %s does not restore this model (%s); removed, weights kept in memory", path, exc)
        return WeightCacheResult("unsupported", reason=str(exc))
    ops.release_memory()  # the repacked copy just replaced by the mapping goes back to the OS
    logger.info("weight cache: wrote %s (%s)", path, found)
    return WeightCacheResult("built", path, found)


def _restore_fresh(model: nn.Module, entry: MappedEntry, path: Path) -> WeightCacheResult:
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: the last entry the size bound evicts
    try:
        restore(model, entry.header["layout"], entry.views)
    except WeightCacheError as exc:
        path.unlink(missing_ok=True)
        raise WeightCacheError(f"the weight cache entry {path} passed its checks but does not fit the model ({exc}). "
                               "It was removed: start again to rebuild it, or pass --no-weight-cache, and please "
                               "report this") from None
    logger.info("weight cache: mapped %s", path)
    return WeightCacheResult("hit", path)
