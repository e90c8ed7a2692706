"""One KV block as bytes: header, the block's token ids, its KV payload, a checksum or a MAC.

::

    magic "CSKV" | version u16 | flags u16 | fingerprint 16B | key 16B | num_tokens u32 | payload_len u64
    | token ids (num_tokens x u32) | payload | trailer

The version is the fingerprint's ``FORMAT_VERSION`` (one number for the whole format). The trailer
covers everything before it: without a secret, an xxh3-64 checksum (8 bytes: damage, not
tampering); under ``--kv-offload-secret`` (flag ``FLAG_MAC``), an HMAC-SHA256 (32 bytes; SHA-256
runs on the CPUs' SHA extensions, about twice BLAKE2b's speed there), so only a holder of the secret
can write an entry a reader accepts.

A reader checks, in order: length (``truncated``), magic, version, fingerprint and whether the entry
is authenticated as the reader expects (``foreign``: another model, dtype, layout or format, or an
entry written without the secret the reader holds, or with one it does not), the checksum or MAC
(``corrupt``: damaged, or forged / written with another secret: the two cannot be told apart), then
the key and the tokens it asked for (``mismatch``: an entry stored under the wrong name). Any failure
raises ``DecodeError`` with that reason; the store counts it as a miss and never serves the bytes.
Token ids are stored in clear: a MAC authenticates, it does not hide (docs/prefix-cache.md).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import xxhash

from .fingerprint import FORMAT_VERSION
from .keys import token_bytes

__all__ = ["DecodeError", "encode_entry", "decode_entry", "entry_size", "DECODE_FAILURES"]

_MAGIC = b"CSKV"
_HEAD = struct.Struct("<4sHH16s16sIQ")
_SUM = struct.Struct("<Q")
MAC_BYTES = 32
FLAG_MAC = 1
DECODE_FAILURES = ("truncated", "foreign", "corrupt", "mismatch")


class DecodeError(ValueError):
    """An entry that must not be used; ``reason`` is one of ``DECODE_FAILURES``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def entry_size(num_tokens: int, payload_len: int, mac: bool = False) -> int:
    return _HEAD.size + 4 * num_tokens + payload_len + (MAC_BYTES if mac else _SUM.size)


def _mac(mac_key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(mac_key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def encode_entry(key: bytes, fingerprint: bytes, token_ids: Sequence[int], payload: bytes | memoryview,
                 mac_key: bytes | None = None) -> bytes:
    """The entry's bytes; with ``mac_key`` (``TierSecret.mac_key``) a MAC trailer instead of a checksum."""
    toks = token_bytes(token_ids)
    head = _HEAD.pack(_MAGIC, FORMAT_VERSION, FLAG_MAC if mac_key else 0, fingerprint, key, len(token_ids), len(payload))
    if mac_key:
        return b"".join((head, toks, payload, _mac(mac_key, head, toks, payload)))
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(toks)
    h.update(payload)
    return b"".join((head, toks, payload, _SUM.pack(h.intdigest())))


def decode_entry(
    data: bytes | bytearray | memoryview, *, key: bytes, fingerprint: bytes, token_ids: Sequence[int] | None = None,
    payload_len: int | None = None, mac_key: bytes | None = None,
) -> memoryview:
    """The payload of a valid entry (a view into ``data``, no copy), else ``DecodeError``. With
    ``mac_key`` only an entry whose MAC verifies under it is valid; without, only unauthenticated ones."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _SUM.size:
        raise DecodeError("truncated", f"{len(view)} bytes is shorter than a header")
    magic, version, flags, fp, stored_key, num_tokens, plen = _HEAD.unpack_from(view)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise DecodeError("foreign", f"not a chatserve KV entry of format {FORMAT_VERSION}")
    if fp != fingerprint:
        raise DecodeError("foreign", "written for another model, dtype, KV layout, kernel tier, rope or code version")
    if flags & ~FLAG_MAC:
        raise DecodeError("foreign", f"unknown flags {flags:#x}")
    keyed = bool(flags & FLAG_MAC)
    if keyed != bool(mac_key):
        raise DecodeError("foreign", "written under a KV offload secret this reader does not hold" if keyed
                          else "not authenticated: written without the KV offload secret this reader holds")
    total = entry_size(num_tokens, plen, keyed)
    if len(view) != total:
        raise DecodeError("truncated" if len(view) < total else "corrupt", f"{len(view)} bytes, header says {total}")
    trailer = MAC_BYTES if keyed else _SUM.size
    body = view[: total - trailer]
    if mac_key:
        if not hmac.compare_digest(_mac(mac_key, body), bytes(view[total - trailer :])):
            raise DecodeError("corrupt", "MAC does not verify: damaged, forged, or written with another secret")
    else:
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
    return view[tok_start + 4 * num_tokens : total - trailer]
