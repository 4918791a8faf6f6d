"""The key store in Redis. Layout (prefix P, hash H = SHA-256 of the key):

    P:key:H        hash  name, rpm, tpm, admin, created, revoked
    P:keyname:N    string  H of the live key named N (names are unique among live keys)
    P:keys         set of every H (revoked ones stay, marked, for audit)
"""

from __future__ import annotations

import os
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specmesh.auth.keys import KeyRecord, check_name, hash_key, key_id, new_key

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(auth_cfg=None, environ=None) -> str:
    environ = os.environ if environ is None else environ
    configured = getattr(auth_cfg, "redis_url", None)
    return configured or environ.get("SPECMESH_REDIS_URL") or DEFAULT_REDIS_URL


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client that fails fast (no retries): an unreachable Redis is a decision, not a hang."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), decode_responses=True)


class KeyStore:
    def __init__(self, client: redis.Redis, prefix: str = "specmesh"):
        self.r = client
        self.prefix = prefix

    def _key(self, key_hash: str) -> str:
        return f"{self.prefix}:key:{key_hash}"

    def _name(self, name: str) -> str:
        return f"{self.prefix}:keyname:{name}"

    def create(self, name: str, rpm: int = 0, tpm: int = 0, admin: bool = False) -> tuple[str, KeyRecord]:
        """A new key (returned once, never stored) and its record. ValueError if the name is taken."""
        check_name(name)
        if rpm < 0 or tpm < 0:
            raise ValueError("rpm and tpm must be >= 0 (0 = unlimited)")
        key = new_key()
        rec = KeyRecord(name, hash_key(key), rpm, tpm, admin, time.time())
        if not self.r.set(self._name(name), rec.key_hash, nx=True):
            raise ValueError(f"a live key named {name!r} exists (revoke it first)")
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._key(rec.key_hash), mapping=rec.to_redis())
        pipe.sadd(f"{self.prefix}:keys", rec.key_hash)
        pipe.execute()
        return key, rec

    def lookup(self, key: str) -> KeyRecord | None:
        return self.get(hash_key(key))

    def get(self, key_hash: str) -> KeyRecord | None:
        data = self.r.hgetall(self._key(key_hash))
        return KeyRecord.from_redis(key_hash, data) if data else None

    def list(self) -> list[KeyRecord]:
        records = [self.get(h) for h in self.r.smembers(f"{self.prefix}:keys")]
        return sorted((r for r in records if r is not None), key=lambda r: (r.revoked, r.created))

    def revoke(self, name_or_id: str) -> KeyRecord:
        """Revoke the live key with this name, or the key with this id. KeyError if none."""
        key_hash = self.r.get(self._name(name_or_id))
        if key_hash is None:
            matches = [h for h in self.r.smembers(f"{self.prefix}:keys") if key_id(h) == name_or_id]
            if len(matches) != 1:
                raise KeyError(f"no key named or with id {name_or_id!r}")
            key_hash = matches[0]
        rec = self.get(key_hash)
        if rec is None:
            raise KeyError(f"no key named or with id {name_or_id!r}")
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._key(key_hash), "revoked", 1)
        if self.r.get(self._name(rec.name)) == key_hash:
            pipe.delete(self._name(rec.name))
        pipe.execute()
        return self.get(key_hash)
