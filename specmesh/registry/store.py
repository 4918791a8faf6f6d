"""The worker registry in Redis: TTL keys written by heartbeats, read by coordinators."""

from __future__ import annotations

import logging

import redis

from specmesh.registry.records import TIERS, WorkerRecord

log = logging.getLogger(__name__)


class RegistryError(RuntimeError):
    """Redis could not be reached or answered with an error."""


class Registry:
    """put / remove / list worker records. Every key expires ttl_s after its last put."""

    def __init__(self, url: str, namespace: str = "specmesh", ttl_s: float = 5.0, client=None, timeout_s: float = 2.0):
        self.url, self.namespace, self.ttl_s = url, namespace, ttl_s
        self.client = client or redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                     socket_connect_timeout=timeout_s, decode_responses=True)

    @classmethod
    def from_config(cls, rcfg) -> "Registry":
        return cls(rcfg.url, rcfg.namespace, rcfg.ttl_s)

    def key(self, tier: str, worker_id: str) -> str:
        return f"{self.namespace}:workers:{tier}:{worker_id}"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise RegistryError(f"registry {self.url}: {what} failed: {exc}") from exc

    def ping(self) -> bool:
        return bool(self._call("ping", self.client.ping))

    def put(self, record: WorkerRecord) -> None:
        px = max(1, int(self.ttl_s * 1000))
        self._call("put", self.client.set, self.key(record.tier, record.worker_id), record.to_json(), px=px)

    def remove(self, tier: str, worker_id: str) -> None:
        self._call("remove", self.client.delete, self.key(tier, worker_id))

    def list(self, tier: str) -> list[WorkerRecord]:
        """Live records of one tier (expired ones are gone), sorted by worker id."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        keys = sorted(self._call("scan", lambda: list(self.client.scan_iter(
            match=f"{self.namespace}:workers:{tier}:*", count=500))))
        if not keys:
            return []
        out = []
        for key, raw in zip(keys, self._call("mget", self.client.mget, keys)):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                out.append(WorkerRecord.from_json(raw))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("registry: ignoring unreadable record %s: %s", key, exc)
        return out

    def all(self) -> dict[str, list[WorkerRecord]]:
        return {tier: self.list(tier) for tier in TIERS}

    def close(self) -> None:
        try:
            self.client.close()
        except redis.RedisError:
            pass
