"""API keys: generation, hashing, the Bearer header, the stored record. Pure (no redis, no grpc).

A key is shown once at creation; only hash_key(key) (SHA-256 hex) is ever stored or compared.
Logs and spans carry the key's name, never the key.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "smk_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key_hash: str) -> str:
    """A short, non-secret handle for listing / revoking (a prefix of the hash)."""
    return key_hash[:12]


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise ValueError("key name: 1-64 of letters, digits, '_', '.', '-' (starting with a letter or digit)")
    return name


def bearer_token(metadata) -> str | None:
    """The key from 'authorization: Bearer KEY' in gRPC metadata (None when absent or malformed)."""
    for k, v in metadata or ():
        if k.lower() == "authorization" and isinstance(v, str):
            scheme, _, token = v.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


@dataclass(frozen=True)
class KeyRecord:
    name: str
    key_hash: str
    rpm: int = 0  # requests per minute, 0 = unlimited
    tpm: int = 0  # tokens (prompt + max_tokens reserved) per minute, 0 = unlimited
    admin: bool = False  # may call the Admin service
    created: float = 0.0  # unix time
    revoked: bool = False

    @property
    def id(self) -> str:
        return key_id(self.key_hash)

    def to_redis(self) -> dict:
        return {"name": self.name, "rpm": self.rpm, "tpm": self.tpm, "admin": int(self.admin),
                "created": self.created, "revoked": int(self.revoked)}

    @classmethod
    def from_redis(cls, key_hash: str, data: dict) -> "KeyRecord":
        return cls(name=data["name"], key_hash=key_hash, rpm=int(data.get("rpm", 0)), tpm=int(data.get("tpm", 0)),
                   admin=data.get("admin", "0") == "1", created=float(data.get("created", 0)),
                   revoked=data.get("revoked", "0") == "1")

    def public(self) -> dict:
        """What `keys list` shows (never the key, never the full hash)."""
        return {"id": self.id, "name": self.name, "rpm": self.rpm, "tpm": self.tpm, "admin": self.admin,
                "created": self.created, "revoked": self.revoked}
