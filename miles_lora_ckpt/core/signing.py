"""Tamper evidence, opt-in: an HMAC-SHA256 over the manifest's canonical body.

The manifest's digests catch damage, not forgery: anyone can recompute them. With a secret key
configured (`core.settings`), every manifest written is signed, and every reader refuses one that is
unsigned or mis-signed. The manifest holds every file's digest, so this covers every byte. `key_id`
names a key without revealing it; the key is never written, logged or shown. See docs/guarantees.md,
"What only the signing key catches".
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.regular_files import read_regular

__all__ = [
    "FROM_SETTINGS",
    "SigningKey",
    "SigningKeyError",
    "check_shape",
    "configured_key",
    "describe",
    "problem",
    "resolve",
    "sign",
]

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


class SigningKeyError(MilesLoraCkptError, ValueError):
    """The configured key cannot be used (missing file, too short, both settings given)."""


@dataclass(frozen=True)
class SigningKey:
    """A secret key and its `key_id`: 16 hex digits of SHA-256 over a fixed label and the key."""

    secret: bytes = field(repr=False)
    key_id: str = ""

    @classmethod
    def from_secret(cls, secret: bytes) -> SigningKey:
        """The key of `secret`; SigningKeyError when it has fewer than `MIN_KEY_BYTES` bytes."""
        if len(secret) < MIN_KEY_BYTES:
            raise SigningKeyError(f"the signing key has {len(secret)} bytes, at least {MIN_KEY_BYTES} are needed")
        key_id = hashlib.sha256(b"miles-lora-ckpt key id\0" + secret).hexdigest()[:16]
        return cls(secret, key_id)


def configured_key() -> SigningKey | None:
    """The key from the settings, or None when signing is off. Raises SigningKeyError."""
    current = settings.current()
    if current.hmac_key_file and current.hmac_key:
        raise SigningKeyError("set either hmac_key_file or hmac_key, not both")
    if current.hmac_key:
        return SigningKey.from_secret(current.hmac_key.strip().encode())
    if current.hmac_key_file:
        return SigningKey.from_secret(_read_key_file(Path(current.hmac_key_file)))
    return None


def _read_key_file(path: Path) -> bytes:
    try:
        raw = read_regular(path, max_bytes=MAX_KEY_FILE_BYTES)
    except FileNotFoundError:
        raise SigningKeyError(f"signing key file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SigningKeyError(f"signing key file {path}: {reason}") from None
    return bytes(raw).strip()


def sign(canonical_body: bytes, key: SigningKey) -> dict:
    """The `signature` object for a manifest whose canonical body is `canonical_body`."""
    mac = hmac.new(key.secret, canonical_body, hashlib.sha256).hexdigest()
    return {"algorithm": ALGORITHM, "key_id": key.key_id, "mac": mac}


def check_shape(signature: Any) -> None:
    """Check that `signature` is exactly {algorithm, key_id, mac} of short strings (ValueError)."""
    if (
        not isinstance(signature, dict)
        or set(signature) != {"algorithm", "key_id", "mac"}
        or not all(isinstance(v, str) and len(v) <= 128 for v in signature.values())
    ):
        raise ValueError("malformed manifest signature (expected algorithm, key_id and mac strings)")


def problem(signature: dict | None, canonical_body: bytes, key: SigningKey | None) -> str | None:
    """Why a manifest with this signature fails under `key`, or None when it is acceptable.

    `signature` has passed `check_shape`; any string it holds is compared, never raised on. Without
    a key nothing is checked, and a signature is only informational.
    """
    if key is None:
        return None
    if signature is None:
        return "unsigned, but a signing key is configured (written without a key, or its signature was stripped)"
    if signature["algorithm"] != ALGORITHM:
        return f"signature algorithm {signature['algorithm']!r} is not {ALGORITHM}"
    expected = hmac.new(key.secret, canonical_body, hashlib.sha256).hexdigest()
    # Compared as bytes: `compare_digest` raises TypeError on a non-ASCII str, and a forged `mac`
    # may hold any. That must be a refusal, never a crash.
    if hmac.compare_digest(expected.encode(), signature["mac"].encode("utf-8", "surrogatepass")):
        return None
    if signature["key_id"] != key.key_id:
        return f"signed with another key (key id {signature['key_id']}; the configured key's id is {key.key_id})"
    return "signature does not match the manifest (edited after signing)"


# A default that means "read the key from the settings when needed".
class _FromSettings:
    def __repr__(self) -> str:
        return "FROM_SETTINGS"


FROM_SETTINGS: Any = _FromSettings()


def resolve(key: SigningKey | None | Any) -> SigningKey | None:
    """`key` itself, or the configured key for `FROM_SETTINGS`; raises SigningKeyError."""
    return configured_key() if key is FROM_SETTINGS else key


def describe(signature: dict | None, key: SigningKey | None) -> str:
    """One word for `inspect`/`ls`: unsigned, signed (checked) or signed (not checked)."""
    if signature is None:
        return "unsigned"
    return "signed (verified)" if key is not None else f"signed with key id {signature['key_id']} (not checked: no key)"
