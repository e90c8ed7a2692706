"""The header of a GGUF file: its metadata and tensor table, read straight from the bytes (an mmap).

Why our own reader and not `gguf.GGUFReader`: the reader builds a numpy object for every element of
every metadata array (the tokenizer's 49k-150k strings) before it answers anything; we only need the
scalars and where each array and tensor lies, so a header reads in milliseconds and the arrays are
read when someone asks (`raw_array`, the tokenizer paths). Torch-free, so the metadata cache, the
weight cache's key and the MoE / family config fixes can read a header without loading torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

class GGUFArray(NamedTuple):
    """A metadata array left in the file: we record where it is, not its elements."""

    elem_type: int
    count: int
    offset: int


class GGUFTensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (slowest-varying first), i.e. GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # scalars and strings decoded; arrays as GGUFArray
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int
    # Where each metadata entry (key, type and value) and the tensor table lie in the file, as
    # (start, end) byte offsets: what `gguf_skeleton` copies verbatim and hashes.
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    tensor_table_span: tuple[int, int] = (0, 0)


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: Any, offset: int = 0) -> None:
        self.buf = buf
        self.pos = offset

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.pos += n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack_from = self.buf, self.pos, struct.unpack_from
        for _ in range(count):
            pos += 8 + unpack_from("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            elem_type, count = self.unpack("<I"), self.unpack("<Q")
            arr = GGUFArray(elem_type, count, self.pos)
            self.skip_array(elem_type, count)
            return arr
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"corrupt GGUF: unknown metadata value type {vtype} at byte {self.pos}")
        return self.unpack(fmt)

    def skip_array(self, elem_type: int, count: int) -> None:
        if elem_type == _STRING:
            self.skip_strings(count)
        elif elem_type == _ARRAY:
            for _ in range(count):
                self.skip_array(self.unpack("<I"), self.unpack("<Q"))
        elif elem_type in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(_SCALAR_FORMATS[elem_type])
        else:
            raise ValueError(f"corrupt GGUF: unknown array element type {elem_type} at byte {self.pos}")


class _Layout(NamedTuple):
    version: int
    metadata: dict[str, Any]
    kv_spans: dict[str, tuple[int, int]]
    raw_infos: list[tuple[str, tuple[int, ...], int, int]]  # name, GGUF dims, ggml type, offset in the data
    table_span: tuple[int, int]
    data_offset: int


def gguf_data_offset(buf: Any) -> int:
    """Where a GGUF file's tensor data starts (the end of its header, aligned): the header walked
    without the `gguf` package, whose import (its type tables, numpy's quantisers) would cost a
    warm start a few hundred milliseconds for the one number the weight cache's key needs."""
    return _read_layout(buf).data_offset


def read_gguf_header(buf: Any) -> GGUFHeader:
    """Parse magic, metadata and tensor infos from a buffer holding a GGUF file (e.g. an mmap)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    version, metadata, kv_spans, raw_infos, table_span, data_offset = _read_layout(buf)
    tensors = []
    for name, dims, ggml_type, rel_offset in raw_infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, unknown to the installed gguf package") from None
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        tensors.append(
            GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, data_offset + rel_offset, n_elems * type_size // block_size)
        )
    return GGUFHeader(version, metadata, tuple(tensors), data_offset, kv_spans, table_span)


def _read_layout(buf: Any) -> _Layout:
    """Magic, metadata (arrays left in the file) and the raw tensor table of a GGUF buffer."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    cur = _Cursor(buf, 4)
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}; only v2 and v3 are readable")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    kv_spans: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
        kv_spans[key] = (start, cur.pos)
    table_start = cur.pos
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        raw_infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    table_span = (table_start, cur.pos)
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    return _Layout(version, metadata, kv_spans, raw_infos, table_span, data_offset)


def read_array(buf: Any, arr: GGUFArray) -> list[Any]:
    """The elements of a metadata array left in the file (`GGUFArray`): strings decoded as UTF-8,
    numbers as Python ints / floats / bools. One pass over its bytes, no object per element until
    the list itself: the 49k-token vocabulary of SmolLM2 reads in ~30 ms, against seconds through
    `gguf.GGUFReader`."""
    if arr.elem_type == _STRING:
        cur, out = _Cursor(buf, arr.offset), []
        for _ in range(arr.count):
            out.append(cur.string())
        return out
    fmt = _SCALAR_FORMATS.get(arr.elem_type)
    if fmt is None:
        raise ValueError(f"read_array reads arrays of strings and numbers, not of element type {arr.elem_type}")
    return np.frombuffer(buf, dtype=np.dtype(fmt), count=arr.count, offset=arr.offset).tolist()


def raw_array(buf: Any, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as ``GGUFReader`` exposes them: typed for plain types, uint8 rows for quantised."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quant_shape_to_byte_shape

    plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}
    qtype = T(info.ggml_type)
    if qtype in plain:
        dtype = np.dtype(plain[qtype])
        return np.frombuffer(buf, dtype=dtype, count=info.n_bytes // dtype.itemsize, offset=info.offset).reshape(info.shape)
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
    return raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))
