"""The local disk tier: one file per block under a directory, bounded by size, least recently used out.

Layout: ``DIR/<fingerprint hex[:16]>/<key hex[:2]>/<key hex>.kv``. Why files and not one big
file: a write is a temp file plus ``os.replace`` in the same folder, atomic on every POSIX file
system, so a reader (another process, or this one after a crash) sees the old entry or the whole
new one, never half of one; a file cut short by a power loss fails its checksum and is a miss.

LRU by access time: a read sets the file's mtime (atime is often off: ``noatime``), so the order
survives restarts; the index is rebuilt by one scan at start. The size bound covers the whole
directory (every model in it): when a write passes it, the oldest files go first. Several engines
may share a directory; each keeps its own index, so the bound is approximate between them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from .tier import Tier

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_STALE_TMP_S = 600.0  # a temp file this old was left by a writer that died


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"kv_offload_max_gb must be > 0, got {max_bytes} bytes")
        self.root = os.fspath(root)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # path -> size, least recently used first
        self.total_bytes = 0
        self.num_evicted = 0
        self.num_rejected = 0  # entries larger than the whole bound
        self.write_errors = 0
        self.read_errors = 0
        os.makedirs(self.root, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for folder, _, files in os.walk(self.root):
            for f in files:
                path = os.path.join(folder, f)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if f.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TMP_S:
                        _remove(path)
                elif f.endswith(_SUFFIX):
                    found.append((st.st_mtime, path, st.st_size))
        found.sort()
        for _, path, size in found:
            self._index[path] = size
            self.total_bytes += size
        with self._lock:
            self._shrink()
        logger.info("KV disk tier %s: %d entries, %.1f MiB of %.1f MiB", self.root, len(self._index),
                    self.total_bytes / 2**20, self.max_bytes / 2**20)

    def path_of(self, name: str) -> str:
        fp, key = name.split("/")
        return os.path.join(self.root, fp[:16], key[:2], key + _SUFFIX)

    def get_run(self, names: Sequence[str]) -> list[bytearray]:
        out: list[bytearray] = []
        for name in names:
            path = self.path_of(name)
            try:
                with open(path, "rb") as f:
                    data = bytearray(os.fstat(f.fileno()).st_size)  # NOTE: writable: loaded into the pool as is
                    data = data[: f.readinto(data)]
                os.utime(path)  # NOTE: the LRU stamp, kept across restarts
            except FileNotFoundError:
                with self._lock:
                    self._forget(path)
                break
            except OSError as exc:
                self.read_errors += 1
                logger.warning("KV disk tier: reading %s failed (%s); counted as a miss", path, exc)
                break
            with self._lock:
                if path in self._index:
                    self._index.move_to_end(path)
                else:  # written by another engine sharing the directory
                    self._index[path] = len(data)
                    self.total_bytes += len(data)
            out.append(data)
        return out

    def count_run(self, names: Sequence[str]) -> int:
        n = 0
        for name in names:
            if not os.path.exists(self.path_of(name)):
                break
            n += 1
        return n

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        written = 0
        for name, data in items:
            path = self.path_of(name)
            if len(data) > self.max_bytes:
                self.num_rejected += 1
                continue
            with self._lock:
                if path in self._index:
                    continue
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except OSError as exc:
                self.write_errors += 1
                _remove(tmp)
                if self.write_errors in (1, 10, 100) or self.write_errors % 1000 == 0:
                    logger.warning("KV disk tier: writing %s failed (%s); %d writes failed so far", path, exc,
                                   self.write_errors)
                continue
            written += len(data)
            with self._lock:
                self._index[path] = len(data)
                self.total_bytes += len(data)
                self._shrink()
        return written

    def delete(self, name: str) -> None:
        path = self.path_of(name)
        _remove(path)
        with self._lock:
            self._forget(path)

    def _forget(self, path: str) -> None:
        size = self._index.pop(path, None)
        if size is not None:
            self.total_bytes -= size

    def _shrink(self) -> None:
        while self.total_bytes > self.max_bytes and self._index:
            path, size = self._index.popitem(last=False)
            self.total_bytes -= size
            self.num_evicted += 1
            _remove(path)

    def describe(self) -> dict[str, object]:
        return {"dir": self.root, "entries": len(self._index), "bytes": self.total_bytes, "max_bytes": self.max_bytes,
                "evicted": self.num_evicted}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
