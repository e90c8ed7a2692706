"""A GGUF file's skeleton: the same header without the tokenizer's arrays, followed by a hole as long
as the file's tensor data (a sparse file), from which transformers reads the model's config in milliseconds.

Why: transformers reads a GGUF's config only through gguf's reader, which builds a numpy object for
every element of every metadata array (the 49k-150k tokens and merges) before it answers: seconds per
file on a 2-core host, for a config that reads none of them. The tokenizer made from those arrays
depends on them and on the architecture alone, so the metadata cache (models/loader.py
`gguf_metadata_folder`) converts it once per `tokenizer_key` and copies it to every file that shares
it (the quantizations of one model, fine-tunes of one base); the config comes from the skeleton.
A first conversion needs no whole parse either: transformers parses the skeleton and
`tokenizer_arrays` decodes the arrays as its reader would (loader.py `skeleton_metadata` puts them
where transformers does).

What the skeleton keeps, byte for byte: every metadata entry except the tokenizer's arrays, and the
whole tensor table (names, shapes, types, offsets), so transformers sees the same keys, the same
tensors and the same vocabulary size (written as `{arch}.vocab_size` where the file leaves transformers
to count the tokens). The tensor data is a hole (a sparse file), never read for a config.
Torch-free, like the header reader it builds on.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from chatserve.models.gguf_header import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFArray, GGUFHeader, read_array

# The arrays a tokenizer is built from; a config never reads them (beyond their length).
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                              "tokenizer.ggml.scores"})

_UINT32 = 4  # GGUF metadata value type of a uint32
_STRING = 8  # ... of a string


def tokenizer_key(buf: Any, header: GGUFHeader) -> str:
    """A hash of what transformers builds a GGUF's tokenizer from: the architecture (it picks the
    converter) and every `tokenizer.*` metadata entry's bytes (vocabulary, merges, types, special ids,
    flags, chat template). Two files with equal keys get the same tokenizer."""
    h = hashlib.sha256(b"gguf-tokenizer\0")
    h.update(str(header.metadata.get("general.architecture", "")).encode() + b"\0")
    for key in sorted(header.kv_spans):
        if key.startswith("tokenizer."):
            start, end = header.kv_spans[key]
            h.update(bytes(buf[start:end]))
    return h.hexdigest()[:32]


def _uint32_entry(key: str, value: int) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<II", _UINT32, value)


def write_skeleton(buf: Any, header: GGUFHeader, dest: Path) -> None:
    """Write `dest`: the file in `buf` (parsed as `header`) less the tokenizer's arrays, its tensor
    data left as a hole of the original length (so every tensor's extent stays inside the file)."""
    if not header.kv_spans or header.tensor_table_span == (0, 0):
        raise ValueError("the header was read without byte spans (read_gguf_header records them)")
    kept = [key for key in header.kv_spans if key not in TOKENIZER_ARRAYS]
    entries = [bytes(buf[slice(*header.kv_spans[key])]) for key in kept]
    arch = header.metadata.get("general.architecture")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if arch and f"{arch}.vocab_size" not in header.metadata and isinstance(tokens, GGUFArray):
        entries.append(_uint32_entry(f"{arch}.vocab_size", tokens.count))  # transformers' own fallback: len(tokens)
    out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", header.version, len(header.tensors), len(entries)))
    for entry in entries:
        out += entry
    out += bytes(buf[slice(*header.tensor_table_span)])
    alignment = int(header.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    out += bytes(-len(out) % alignment)
    data_bytes = len(buf) - header.data_offset
    with open(dest, "wb") as f:
        f.write(out)
        f.truncate(len(out) + data_bytes)  # a hole: no data written, none read


__all__ = ["TOKENIZER_ARRAYS", "tokenizer_key", "write_skeleton"]


def tokenizer_arrays(buf: Any, header: GGUFHeader) -> dict[str, Any]:
    """The file's tokenizer arrays (`TOKENIZER_ARRAYS` present in it), decoded as transformers'
    GGUF reader decodes metadata values: strings as strict UTF-8 (an invalid one raises, as it does
    there), numbers as Python ints / floats / bools, and a one-element array as its element (its
    `load_gguf_checkpoint` unwraps those). One pass over the bytes: ~0.1 s for SmolLM2's 49k tokens
    and merges, where gguf's reader takes seconds."""
    out: dict[str, Any] = {}
    for key in header.kv_spans:  # file order
        arr = header.metadata.get(key)
        if key not in TOKENIZER_ARRAYS or not isinstance(arr, GGUFArray):
            continue
        values = _strict_strings(buf, arr) if arr.elem_type == _STRING else read_array(buf, arr)
        out[key] = values[0] if len(values) == 1 else values
    return out


def _strict_strings(buf: Any, arr: GGUFArray) -> list[str]:
    out, pos, unpack_from = [], arr.offset, struct.unpack_from
    for _ in range(arr.count):
        (n,) = unpack_from("<Q", buf, pos)
        out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"))
        pos += 8 + n
    return out
