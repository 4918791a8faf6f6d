"""specmesh.auth.guard.Guard with in-memory fakes: auth decisions, rate-limit decisions, refunds,
and what happens when Redis is unreachable (fail open / closed, known-key cache, log throttling)."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from specmesh.auth.guard import Guard, Reservation
from specmesh.auth.keys import KeyRecord, hash_key
from specmesh.auth.ratelimit import Decision
from specmesh.errors import PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from specmesh.telemetry import metrics

KEY, ADMIN_KEY, REVOKED_KEY = "smk_user", "smk_admin", "smk_revoked"


class FakeStore:
    def __init__(self):
        self.down = False
        self.records = {
            hash_key(KEY): KeyRecord("user", hash_key(KEY), rpm=3, tpm=100),
            hash_key(ADMIN_KEY): KeyRecord("ops", hash_key(ADMIN_KEY), admin=True),
            hash_key(REVOKED_KEY): KeyRecord("old", hash_key(REVOKED_KEY), revoked=True),
        }

    def get(self, key_hash):
        if self.down:
            raise RedisConnectionError("down")
        return self.records.get(key_hash)


class FakeLimiter:
    def __init__(self):
        self.down = False
        self.decision = Decision(True)
        self.reserved, self.refunded = [], []

    def reserve(self, key_hash, rpm, tpm, tokens):
        if self.down:
            raise RedisConnectionError("down")
        self.reserved.append(tokens)
        return self.decision

    def refund(self, key_hash, tpm, tokens):
        if self.down:
            raise RedisConnectionError("down")
        self.refunded.append(tokens)


def guard(required=True, fail_open=True, interval=60.0):
    return Guard(FakeStore(), FakeLimiter(), required, True, fail_open, interval)


def count(counter, *labels) -> float:
    return (counter.labels(*labels) if labels else counter)._value.get()


def test_auth_off_checks_nothing():
    g = guard(required=False)
    g.store.down = True  # never contacted
    assert g.authenticate(None) is None
    assert g.authenticate("garbage") is None
    assert g.reserve(None, 50) == Reservation(None, 0)


@pytest.mark.parametrize("key, reason", [(None, "missing"), ("", "missing"), ("smk_nope", "unknown"),
                                         (REVOKED_KEY, "revoked")])
def test_missing_unknown_revoked_are_unauthenticated(key, reason):
    before = count(metrics.AUTH_FAILURES, reason)
    with pytest.raises(Unauthenticated):
        guard().authenticate(key)
    assert count(metrics.AUTH_FAILURES, reason) == before + 1


def test_valid_key_gives_its_record_and_admin_needs_the_admin_flag():
    g = guard()
    assert g.authenticate(KEY).name == "user"
    with pytest.raises(PermissionDenied):
        g.authenticate(KEY, admin=True)
    assert g.authenticate(ADMIN_KEY, admin=True).name == "ops"


def test_admin_is_checked_even_with_auth_off():
    g = guard(required=False)
    with pytest.raises(Unauthenticated):
        g.authenticate(None, admin=True)
    assert g.authenticate(ADMIN_KEY, admin=True).admin


def test_over_the_limit_is_resource_exhausted_with_retry_after():
    g = guard()
    rec = g.authenticate(KEY)
    g.limiter.decision = Decision(False, 12.5, "requests")
    before = count(metrics.RATELIMIT_REJECTIONS, "requests")
    with pytest.raises(ResourceExhausted) as exc:
        g.reserve(rec, 40)
    assert exc.value.retry_after_s == 12.5 and "user" in str(exc.value)
    assert count(metrics.RATELIMIT_REJECTIONS, "requests") == before + 1


def test_a_request_that_never_fits_has_no_retry_hint():
    g = guard()
    g.limiter.decision = Decision(False, None, "tokens")
    with pytest.raises(ResourceExhausted) as exc:
        g.reserve(g.authenticate(KEY), 500)
    assert exc.value.retry_after_s is None


def test_reserve_then_refund_the_unused_part():
    g = guard()
    res = g.reserve(g.authenticate(KEY), 40)
    assert res.tokens == 40 and g.limiter.reserved == [40]
    g.refund(res, used_tokens=15)
    assert g.limiter.refunded == [25]
    g.refund(Reservation(res.record, 10), used_tokens=10)  # nothing unused: no call
    assert g.limiter.refunded == [25]


def test_unlimited_keys_never_touch_the_limiter():
    g = guard()
    res = g.reserve(g.authenticate(ADMIN_KEY), 40)
    assert res.tokens == 0 and g.limiter.reserved == []


def test_redis_down_fail_open_admits_counts_and_logs_once_per_interval(caplog):
    g = guard(fail_open=True, interval=3600)
    rec = g.authenticate(KEY)
    g.limiter.down = True
    before = count(metrics.RATELIMIT_BACKEND_ERRORS, "open")
    with caplog.at_level(logging.WARNING, logger="specmesh.auth.guard"):
        for _ in range(5):
            assert g.reserve(rec, 10).tokens == 0  # admitted, nothing to refund
    assert count(metrics.RATELIMIT_BACKEND_ERRORS, "open") == before + 5
    assert len([r for r in caplog.records if "redis unreachable" in r.getMessage()]) == 1


def test_redis_down_fail_closed_is_unavailable():
    g = guard(fail_open=False)
    rec = g.authenticate(KEY)
    g.limiter.down = True
    with pytest.raises(Unavailable):
        g.reserve(rec, 10)


def test_redis_down_a_recently_verified_key_still_works_an_unknown_one_does_not():
    g = guard()
    assert g.authenticate(KEY).name == "user"
    g.store.down = True
    assert g.authenticate(KEY).name == "user"
    with pytest.raises(Unavailable):
        g.authenticate("smk_never_seen")


def test_a_revoked_key_is_forgotten_by_the_outage_cache():
    g = guard()
    g.authenticate(KEY)
    g.store.records[hash_key(KEY)] = KeyRecord("user", hash_key(KEY), revoked=True)
    with pytest.raises(Unauthenticated):
        g.authenticate(KEY)
    g.store.down = True
    with pytest.raises(Unavailable):
        g.authenticate(KEY)
