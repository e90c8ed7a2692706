"""Opaque values that carry a reply's reasoning back to this server: signatures and sealed blobs.

Two APIs hand reasoning to the client and take it back on a later turn, where it is rendered into
the prompt as the model's own earlier thinking (the template's `reasoning_content`):

- the Messages API's `thinking` block carries a `signature` (`sign` / `verify`): an HMAC-SHA256 of
  the block's text under the server's key, so a block whose text was edited, or that another server
  produced, is refused instead of being put in the model's mouth;
- the Responses API's reasoning item carries `encrypted_content` when the request includes
  `reasoning.encrypted_content` (`seal` / `unseal`): the text itself, base64, behind an HMAC-SHA256 tag.
  It is authenticated, not encrypted: the `cryptography` package is no dependency of chatserve, and
  secrecy buys nothing here, since the same item's `content` already hands the client the text in
  the clear. What matters is that a value the server renders as its own turn is one it produced.

The key is `--reasoning-signing-key` (replicas behind one router must share it, or a turn that
lands on another replica is refused) or, without one, 32 random bytes drawn when the server starts:
then a signature or blob from an earlier process, or another replica, is refused (a 400 naming the
field). Each use has its own key derived from that one, so a signature never passes as a blob's
tag nor the other way round.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

SIGNATURE_PREFIX = "csig1_"
"""A Messages `thinking.signature` this server made (the version lets a later format refuse it clearly)."""
SEALED_PREFIX = "csrc1_"
"""A Responses `encrypted_content` this server made."""
_TAG_BYTES = 32


class ReasoningSignatureError(ValueError):
    """A signature or sealed value that this server did not produce for this text (edited, or another key's)."""


def _derive(key: bytes, purpose: bytes) -> bytes:
    return hmac.new(key, b"chatserve reasoning " + purpose, hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ReasoningSignatureError("not a value this server produced (bad encoding)") from None


@dataclass(frozen=True)
class ReasoningSigner:
    """The server's key and what it signs; one per serving context (no module globals)."""

    key: bytes = field(repr=False)
    random_key: bool = False
    """True when no key was configured: values from another process are refused (docs/reasoning.md)."""

    @classmethod
    def from_key(cls, key: str | None) -> ReasoningSigner:
        """`--reasoning-signing-key`'s value, or a fresh random key for this process when None."""
        if key is None:
            return cls(secrets.token_bytes(32), random_key=True)
        if not key:
            raise ValueError("--reasoning-signing-key must not be empty")
        return cls(key.encode("utf-8"))

    @property
    def _signing_key(self) -> bytes:
        return _derive(self.key, b"signature v1")

    @property
    def _sealing_key(self) -> bytes:
        return _derive(self.key, b"sealed content v1")

    # ---- Messages: thinking.signature ---------------------------------------------------------
    def sign(self, text: str) -> str:
        """The `signature` of a thinking block whose text is `text`."""
        tag = hmac.new(self._signing_key, text.encode("utf-8"), hashlib.sha256).digest()
        return SIGNATURE_PREFIX + _b64(tag)

    def verify(self, signature: str, text: str) -> bool:
        """Whether `signature` is this server's for exactly `text` (constant-time comparison)."""
        if not signature.startswith(SIGNATURE_PREFIX):
            return False
        return hmac.compare_digest(self.sign(text), signature)

    # ---- Responses: encrypted_content ---------------------------------------------------------
    def seal(self, text: str) -> str:
        """An opaque value holding `text` that only this key's `unseal` gives back."""
        body = text.encode("utf-8")
        tag = hmac.new(self._sealing_key, body, hashlib.sha256).digest()
        return SEALED_PREFIX + _b64(tag + body)

    def unseal(self, sealed: str) -> str:
        """The text a `seal` value holds; `ReasoningSignatureError` for anything this key did not seal."""
        if not sealed.startswith(SEALED_PREFIX):
            raise ReasoningSignatureError("not a value this server produced")
        raw = _unb64(sealed[len(SEALED_PREFIX):])
        tag, body = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        expected = hmac.new(self._sealing_key, body, hashlib.sha256).digest()
        if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, expected):
            raise ReasoningSignatureError("its authentication tag does not match (edited, or sealed by another "
                                          "server or an earlier process without a shared --reasoning-signing-key)")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:  # (cannot happen for a value that passed the tag; said plainly if it does)
            raise ReasoningSignatureError("its content is not UTF-8 text") from None


__all__ = ["SEALED_PREFIX", "SIGNATURE_PREFIX", "ReasoningSignatureError", "ReasoningSigner"]
