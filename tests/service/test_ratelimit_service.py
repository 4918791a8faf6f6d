"""Rate limits against a real redis-server: the Lua token buckets (atomic across "replicas" and
threads), reservation and refund, retry-after, fail open / closed; and at a real gateway:
RESOURCE_EXHAUSTED with `retry-after` in the trailing metadata."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from prod_helpers import (FakeCoordinator, Started, bearer, dead_redis_url, gateway_stub, make_config,  # noqa: F401
                          redis_server, start_fake_coordinator, start_gateway)
from specmesh.auth.guard import Guard
from specmesh.auth.keys import hash_key
from specmesh.auth.ratelimit import RateLimiter
from specmesh.auth.store import KeyStore, connect
from specmesh.errors import Unavailable
from specmesh.telemetry import metrics
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service


def limiter(url, prefix="rl"):
    return RateLimiter(connect(url, 2.0), prefix)


def test_requests_bucket_allows_the_limit_then_refuses_with_retry_after(redis_server):  # noqa: F811
    lim = limiter(redis_server.url)
    h = hash_key("k-rpm")
    assert [lim.reserve(h, 3, 0, 0).allowed for _ in range(3)] == [True] * 3
    d = lim.reserve(h, 3, 0, 0)
    assert not d.allowed and d.limit == "requests" and 0 < d.retry_after_s <= 20.0


def test_tokens_bucket_reserves_then_refunds(redis_server):  # noqa: F811
    lim = limiter(redis_server.url)
    h = hash_key("k-tpm")
    assert lim.reserve(h, 0, 1000, 700).allowed
    d = lim.reserve(h, 0, 1000, 700)
    assert not d.allowed and d.limit == "tokens" and d.retry_after_s > 0
    lim.refund(h, 1000, 500)  # the first request generated far less than it reserved
    assert lim.reserve(h, 0, 1000, 700).allowed
    never = lim.reserve(h, 0, 1000, 1001)
    assert not never.allowed and never.retry_after_s is None


def test_both_limits_take_all_or_nothing(redis_server):  # noqa: F811
    lim = limiter(redis_server.url)
    h = hash_key("k-both")
    assert lim.reserve(h, 5, 100, 90).allowed
    assert not lim.reserve(h, 5, 100, 90).allowed  # tokens refuse ...
    levels = lim.levels(h)
    assert 3.9 < levels["requests"] < 4.1  # ... and the request was not taken either


def test_replicas_and_threads_never_overshoot(redis_server):  # noqa: F811
    replicas = [limiter(redis_server.url), limiter(redis_server.url)]  # two gateways, one Redis
    h = hash_key("k-race")
    start = threading.Barrier(16)

    def one(i):
        start.wait()
        return replicas[i % 2].reserve(h, 10, 0, 0).allowed

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert sum(results) == 10


def test_unreachable_redis_fails_open_or_closed(prompt_encoder):
    url = dead_redis_url()
    open_cfg = make_config({"auth": {"required": True, "redis_url": url, "redis_timeout_s": 0.2}})
    g = Guard.from_config(open_cfg, environ={})
    from specmesh.auth.keys import KeyRecord

    rec = KeyRecord("k", hash_key("x"), rpm=1)
    before = metrics.RATELIMIT_BACKEND_ERRORS.labels("open")._value.get()
    assert g.reserve(rec, 10).tokens == 0  # admitted
    assert metrics.RATELIMIT_BACKEND_ERRORS.labels("open")._value.get() == before + 1
    closed = Guard.from_config(make_config({"auth": {"redis_url": url, "redis_timeout_s": 0.2},
                                            "ratelimit": {"on_redis_error": "closed"}}), environ={})
    with pytest.raises(Unavailable):
        closed.reserve(rec, 10)
    with pytest.raises(Unavailable):  # an unknown key cannot be verified: never fails open
        g.authenticate("smk_whatever")


@pytest.fixture(scope="module")
def gateway(redis_server, prompt_encoder):  # noqa: F811
    started = Started()
    fake = FakeCoordinator(completion=2)
    coordinator = start_fake_coordinator(fake, started)
    cfg = make_config({"auth": {"required": True, "redis_url": redis_server.url, "key_prefix": "rlgw"},
                       "gateway": {"coordinator": coordinator}})
    _, svc = start_gateway(cfg, prompt_encoder, started)
    yield SimpleNamespace(stub=gateway_stub(svc.listen, started), store=KeyStore(connect(redis_server.url), "rlgw"),
                          limiter=limiter(redis_server.url, "rlgw"))
    started.stop()


def test_gateway_rpm_3_then_resource_exhausted_with_retry_after(gateway):
    key, _ = gateway.store.create("rpm3", rpm=3)
    r = pb.GenerateRequest(prompt="hi", max_tokens=4)
    for _ in range(3):
        assert gateway.stub.Generate(r, timeout=30, metadata=bearer(key)).finish_reason == "length"
    before = metrics.RATELIMIT_REJECTIONS.labels("requests")._value.get()
    with pytest.raises(grpc.RpcError) as exc:
        gateway.stub.Generate(r, timeout=30, metadata=bearer(key))
    err = exc.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rpm3" in err.details()
    retry_after = dict(err.trailing_metadata())["retry-after"]
    assert 0 < float(retry_after) <= 20.0
    assert metrics.RATELIMIT_REJECTIONS.labels("requests")._value.get() == before + 1
    with pytest.raises(grpc.RpcError) as exc:  # streams are limited alike
        list(gateway.stub.GenerateStream(r, timeout=30, metadata=bearer(key)))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_gateway_reserves_prompt_plus_max_tokens_and_refunds_the_rest(gateway):
    key, rec = gateway.store.create("tpm", tpm=100000)
    resp = gateway.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=500), timeout=30, metadata=bearer(key))
    assert resp.usage.completion_tokens == 2
    # left = tpm - (prompt + 2 generated); the 498 not generated came back (refill only adds)
    level = gateway.limiter.levels(rec.key_hash)["tokens"]
    used = 100000 - level
    assert 2 < used < 100  # the prompt (chat template) and two tokens, not 500
    chunks = list(gateway.stub.GenerateStream(pb.GenerateRequest(prompt="hi", max_tokens=500), timeout=30,
                                              metadata=bearer(key)))
    assert chunks[-1].finish_reason
    assert 100000 - gateway.limiter.levels(rec.key_hash)["tokens"] < 2 * used + 10


def test_gateway_prompt_plus_max_tokens_beyond_tpm_never_fits(gateway):
    key, _ = gateway.store.create("tiny", tpm=50)
    with pytest.raises(grpc.RpcError) as exc:
        gateway.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=100), timeout=30, metadata=bearer(key))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry-after" not in dict(exc.value.trailing_metadata() or ())
