"""One KV block as bytes: header, the block's token ids, its KV payload, a checksum.

::

    magic "CSKV" | version u16 | reserved u16 | fingerprint 16B | key 16B | num_tokens u32 | payload_len u64
    | token ids (num_tokens x u32) | payload | xxh3-64 of everything before it (u64)

A reader checks, in order: length (``truncated``), magic, version and fingerprint (``foreign``: another
model, dtype, layout or format), the checksum (``corrupt``), then the key and the tokens it asked
for (``mismatch``: an entry stored under the wrong name). Any failure raises ``DecodeError`` with
that reason; the store counts it as a miss and never serves the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from .keys import token_bytes

__all__ = ["DecodeError", "encode_entry", "decode_entry", "entry_size", "DECODE_FAILURES"]

_MAGIC = b"CSKV"
_VERSION = 1
_HEAD = struct.Struct("<4sHH16s16sIQ")
_SUM = struct.Struct("<Q")
DECODE_FAILURES = ("truncated", "foreign", "corrupt", "mismatch")


class DecodeError(ValueError):
    """An entry that must not be used; ``reason`` is one of ``DECODE_FAILURES``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def entry_size(num_tokens: int, payload_len: int) -> int:
    return _HEAD.size + 4 * num_tokens + payload_len + _SUM.size


def encode_entry(key: bytes, fingerprint: bytes, token_ids: Sequence[int], payload: bytes | memoryview) -> bytes:
    toks = token_bytes(token_ids)
    head = _HEAD.pack(_MAGIC, _VERSION, 0, fingerprint, key, len(token_ids), len(payload))
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(toks)
    h.update(payload)
    return b"".join((head, toks, payload, _SUM.pack(h.intdigest())))


def decode_entry(
    data: bytes | bytearray | memoryview, *, key: bytes, fingerprint: bytes, token_ids: Sequence[int] | None = None,
    payload_len: int | None = None,
) -> memoryview:
    """The payload of a valid entry (a view into ``data``, no copy), else ``DecodeError``."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _SUM.size:
        raise DecodeError("truncated", f"{len(view)} bytes is shorter than a header")
    magic, version, _, fp, stored_key, num_tokens, plen = _HEAD.unpack_from(view)
    if magic != _MAGIC or version != _VERSION:
        raise DecodeError("foreign", f"not a chatserve KV entry of format {_VERSION}")
    if fp != fingerprint:
        raise DecodeError("foreign", "written for another model, dtype, KV layout or kernel tier")
    total = entry_size(num_tokens, plen)
    if len(view) != total:
        raise DecodeError("truncated" if len(view) < total else "corrupt", f"{len(view)} bytes, header says {total}")
    body = view[: total - _SUM.size]
    (stored_sum,) = _SUM.unpack_from(view, total - _SUM.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        raise DecodeError("corrupt", "checksum does not match")
    if stored_key != key:
        raise DecodeError("mismatch", "stored under another block's key")
    tok_start = _HEAD.size
    if token_ids is not None and bytes(view[tok_start : tok_start + 4 * num_tokens]) != token_bytes(token_ids):
        raise DecodeError("mismatch", "the block's tokens differ from the prompt's")
    if payload_len is not None and plen != payload_len:
        raise DecodeError("foreign", f"payload of {plen} bytes, a block here has {payload_len}")
    return view[tok_start + 4 * num_tokens : total - _SUM.size]
