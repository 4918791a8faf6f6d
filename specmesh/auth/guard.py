"""The gateway's admission guard: API key -> KeyRecord, then rate limits. No grpc.

Auth off: nothing is checked and no Redis is needed. Auth required: a missing, unknown or
revoked key is Unauthenticated. Redis unreachable: a key verified recently is still accepted
(cache), an unknown one gets Unavailable; rate limits fail open (admit, counted, logged at most
once per interval) or closed (Unavailable), per `ratelimit.on_redis_error`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from redis.exceptions import RedisError

from specmesh.auth.keys import KeyRecord, hash_key
from specmesh.auth.ratelimit import RateLimiter
from specmesh.auth.store import KeyStore, connect, redis_url
from specmesh.errors import PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from specmesh.telemetry import metrics

log = logging.getLogger(__name__)

KNOWN_KEYS_KEPT = 10000  # verified keys remembered for a Redis outage
KNOWN_KEY_TTL_S = 600.0


def auth_required(auth_cfg, environ=None) -> bool:
    """auth.required, with SPECMESH_AUTH=required|disabled winning (load_config applies it too)."""
    from specmesh.config_ops import auth_env_override

    environ = os.environ if environ is None else environ
    return bool(auth_env_override(environ).get("auth", {}).get("required", auth_cfg.required))


@dataclass
class Reservation:
    record: KeyRecord | None = None
    tokens: int = 0  # reserved in the tokens/minute bucket (to refund the unused part)


class Guard:
    def __init__(self, store: KeyStore | None, limiter: RateLimiter | None, required: bool,
                 ratelimit_enabled: bool = True, fail_open: bool = True, log_interval_s: float = 60.0):
        self.store, self.limiter, self.required = store, limiter, required
        self.ratelimit_enabled, self.fail_open, self.log_interval_s = ratelimit_enabled, fail_open, log_interval_s
        self._known: OrderedDict[str, tuple[KeyRecord, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._last_report = float("-inf")
        self._failures_since_report = 0

    @classmethod
    def from_config(cls, cfg, environ=None) -> "Guard":
        """Connects lazily: with auth off and no admin use, Redis is never contacted."""
        required = cfg.auth.required  # SPECMESH_AUTH was applied by load_config
        client = connect(redis_url(cfg.auth, environ), cfg.auth.redis_timeout_s)
        return cls(KeyStore(client, cfg.auth.key_prefix), RateLimiter(client, cfg.auth.key_prefix), required,
                   cfg.ratelimit.enabled, cfg.ratelimit.on_redis_error == "open", cfg.ratelimit.error_log_interval_s)

    # ------------------------------------------------------------------ authentication
    def authenticate(self, key: str | None, admin: bool = False) -> KeyRecord | None:
        """The key's record (None when auth is off and no admin right is needed)."""
        if not self.required and not admin:
            return None
        if not key:
            metrics.AUTH_FAILURES.labels("missing").inc()
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        rec = self._lookup(hash_key(key))
        if rec is None or rec.revoked:
            reason = "unknown" if rec is None else "revoked"
            metrics.AUTH_FAILURES.labels(reason).inc()
            raise Unauthenticated(f"{reason} API key")
        if admin and not rec.admin:
            metrics.AUTH_FAILURES.labels("not_admin").inc()
            raise PermissionDenied(f"key {rec.name!r} is not an admin key")
        return rec

    def _lookup(self, key_hash: str) -> KeyRecord | None:
        try:
            rec = self.store.get(key_hash)
        except RedisError as exc:
            self._backend_failed("key lookup", exc)
            with self._lock:
                known = self._known.get(key_hash)
            if known is not None and time.monotonic() - known[1] < KNOWN_KEY_TTL_S:
                return known[0]
            raise Unavailable("cannot verify the API key: key store unreachable; retry later") from None
        with self._lock:
            if rec is None or rec.revoked:
                self._known.pop(key_hash, None)
            else:
                self._known[key_hash] = (rec, time.monotonic())
                self._known.move_to_end(key_hash)
                while len(self._known) > KNOWN_KEYS_KEPT:
                    self._known.popitem(last=False)
        return rec

    # ------------------------------------------------------------------ rate limits
    def reserve(self, rec: KeyRecord | None, tokens: int) -> Reservation:
        """Take one request and `tokens` tokens from the key's buckets, or raise ResourceExhausted."""
        if rec is None or not self.ratelimit_enabled or (rec.rpm <= 0 and rec.tpm <= 0):
            return Reservation(rec)
        try:
            decision = self.limiter.reserve(rec.key_hash, rec.rpm, rec.tpm, tokens)
        except RedisError as exc:
            self._backend_failed("rate limit", exc)
            if self.fail_open:
                return Reservation(rec)
            raise Unavailable("rate limiter unreachable; retry later") from None
        if not decision.allowed:
            metrics.RATELIMIT_REJECTIONS.labels(decision.limit).inc()
            if decision.retry_after_s is None:
                raise ResourceExhausted(f"request needs {tokens} tokens (prompt + max_tokens), more than key "
                                        f"{rec.name!r} may use per minute ({rec.tpm})")
            per = f"{rec.rpm} requests" if decision.limit == "requests" else f"{rec.tpm} tokens"
            raise ResourceExhausted(f"rate limit of key {rec.name!r} ({per}/minute) reached; retry in "
                                    f"{decision.retry_after_s:.1f}s", retry_after_s=decision.retry_after_s)
        return Reservation(rec, tokens if rec.tpm > 0 else 0)

    def refund(self, res: Reservation, used_tokens: int) -> None:
        unused = res.tokens - max(0, used_tokens)
        if res.record is None or unused <= 0:
            return
        try:
            self.limiter.refund(res.record.key_hash, res.record.tpm, unused)
        except RedisError as exc:
            self._backend_failed("rate limit refund", exc)

    def _backend_failed(self, what: str, exc: BaseException) -> None:
        metrics.RATELIMIT_BACKEND_ERRORS.labels("open" if self.fail_open else "closed").inc()
        now = time.monotonic()
        with self._lock:
            self._failures_since_report += 1
            if now - self._last_report < self.log_interval_s:
                return
            count, self._failures_since_report, self._last_report = self._failures_since_report, 0, now
        log.warning("redis unreachable (%s: %s); failing %s; %d failure(s) since the last report",
                    what, type(exc).__name__, "open" if self.fail_open else "closed", count)
