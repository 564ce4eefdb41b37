"""API key format and keyed hashing; passwords with argon2.

A key is `tm-` + 8 id characters + 40 secret characters. The first 11 characters (the
prefix) are stored in clear to find the row; the whole key only as HMAC-SHA256 under the
server's secret key, so a database dump alone cannot be used to test guesses offline.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

from argon2 import PasswordHasher
from argon2.exceptions import VerificationError

KEY_PREFIX = "tm-"
_ALPHABET = string.ascii_letters + string.digits
_ID_LEN = 8
_SECRET_LEN = 40
PREFIX_LEN = len(KEY_PREFIX) + _ID_LEN


@dataclass(slots=True, frozen=True)
class NewKey:
    secret: str  # shown to the user once, never stored
    prefix: str
    hash: str


def _random(n: int) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def hash_key(key: str, secret_key: str) -> str:
    return hmac.new(secret_key.encode(), key.encode(), hashlib.sha256).hexdigest()


def generate_key(secret_key: str) -> NewKey:
    key = KEY_PREFIX + _random(_ID_LEN) + _random(_SECRET_LEN)
    return NewKey(secret=key, prefix=key[:PREFIX_LEN], hash=hash_key(key, secret_key))


def key_prefix(key: str) -> str | None:
    """The lookup prefix of a well-formed key, else None (so malformed keys skip the database)."""
    if not key.startswith(KEY_PREFIX) or len(key) != PREFIX_LEN + _SECRET_LEN:
        return None
    return key[:PREFIX_LEN]


def verify_key(key: str, stored_hash: str, secret_key: str) -> bool:
    return hmac.compare_digest(hash_key(key, secret_key), stored_hash)


_hasher = PasswordHasher()


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password: str, stored: str) -> bool:
    try:
        return _hasher.verify(stored, password)
    except VerificationError:
        return False
