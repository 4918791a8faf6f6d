"""specmesh.registry against a real redis-server on a free port (started by this module)."""

from __future__ import annotations

import shutil
import time

import pytest

from specmesh.config import RegistryConfig
from specmesh.registry import Registry, RegistryError, WorkerRecord
from specmesh.registry.heartbeat import Registration
from specmesh.registry.local_redis import LocalRedis, free_port
from specmesh.registry.watch import RegistryWatcher
from specmesh.registry.worker import WorkerLifecycle, advertise_address

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.fixture(scope="module")
def redis_url():
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def registry(redis_url, request):
    reg = Registry(redis_url, namespace=f"t{abs(hash(request.node.name)) % 10**8}", ttl_s=0.6)
    yield reg
    reg.close()


def rec(worker_id="w1", tier="target", address="10.0.0.1:1", **kw) -> WorkerRecord:
    return WorkerRecord(worker_id, tier, address, **kw)


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_record_json_roundtrip_and_helpers():
    r = rec(methods=["ngram"], capacity={"max_sequences": 8, "max_tokens": 100},
            load={"live_sequences": 3, "held_tokens": 40})
    back = WorkerRecord.from_json(r.to_json())
    assert back == r and back.methods == ("ngram",)
    assert back.free_sequences() == 5 and back.free_tokens() == 60
    assert back.serves("ngram") and not back.serves("draft_model")
    assert rec().serves("anything") and rec().free_sequences() is None
    with pytest.raises(ValueError):
        rec(tier="bogus")


def test_put_list_remove_and_ttl(registry):
    registry.put(rec("a", address="h:1"))
    registry.put(rec("b", address="h:2"))
    registry.put(rec("d", tier="draft", address="h:3"))
    assert [r.address for r in registry.list("target")] == ["h:1", "h:2"]
    assert [r.worker_id for r in registry.list("draft")] == ["d"]
    registry.remove("target", "a")
    assert [r.worker_id for r in registry.list("target")] == ["b"]
    assert wait_for(lambda: registry.list("target") == [] and registry.list("draft") == [], timeout=3)


def test_namespaces_are_separate(redis_url):
    one, two = Registry(redis_url, "one", 5), Registry(redis_url, "two", 5)
    one.put(rec("x"))
    assert two.list("target") == [] and len(one.list("target")) == 1
    one.remove("target", "x")


def test_unreachable_registry_raises_registry_error():
    reg = Registry(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    with pytest.raises(RegistryError):
        reg.list("target")


def test_heartbeat_refreshes_load_and_keeps_record_alive(registry):
    load = {"live_sequences": 0}
    reg = Registration(registry, rec("hb"), lambda: dict(load), interval_s=0.1).start()
    try:
        load["live_sequences"] = 7
        assert wait_for(lambda: registry.list("target")[0].load["live_sequences"] == 7)
        time.sleep(1.0)  # > ttl: still there because it heartbeats
        assert [r.worker_id for r in registry.list("target")] == ["hb"]
        reg.set_draining()
        assert registry.list("target")[0].draining
    finally:
        reg.stop()
    assert registry.list("target") == []


def test_stopped_heartbeat_expires(registry):
    reg = Registration(registry, rec("dies"), interval_s=0.1).start()
    reg._stop.set()  # as if the process were killed: no deregistration
    assert wait_for(lambda: registry.list("target") == [], timeout=3)


def test_watcher_delivers_and_keeps_last_view_when_redis_is_down(registry):
    seen: list = []
    watcher = RegistryWatcher(registry, {"target": seen.append}, poll_interval_s=0.05)
    registry.put(rec("w"))
    watcher.start()
    try:
        assert [r.worker_id for r in seen[-1]] == ["w"]
        registry.put(rec("w2", address="h:9"))
        assert wait_for(lambda: len(seen[-1]) == 2)
    finally:
        watcher.stop()
    dead = RegistryWatcher(Registry(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2), {"target": seen.append})
    n = len(seen)
    assert dead.sync() is False and len(seen) == n  # nothing delivered: pools keep their members


def test_advertise_address():
    assert advertise_address("127.0.0.1:0", 4242) == "127.0.0.1:4242"
    assert advertise_address("0.0.0.0:50053", 50053) != "0.0.0.0:50053"
    assert advertise_address("0.0.0.0:1", 1, "worker-7") == "worker-7:1"
    assert advertise_address("0.0.0.0:1", 1, "ip").split(":")[0].count(".") == 3


class FakeService:
    listen, port = "127.0.0.1:0", 5555

    def __init__(self):
        self.lifecycle = None


def test_lifecycle_registers_drains_and_deregisters(registry):
    # generous TTL / drain timeout / waits: on a loaded 2-core box a heartbeat or the drain thread can
    # stall for seconds (the record expiring, or the drain giving up, made this test flaky)
    rcfg = RegistryConfig(url=registry.url, namespace=registry.namespace, heartbeat_interval_s=0.1, ttl_s=15.0,
                          poll_interval_s=0.1)
    state = {"busy": True, "drained": False}
    life = WorkerLifecycle(rcfg, "target", capacity={"max_sequences": 4, "max_tokens": 99},
                           load_fn=lambda: {"live_sequences": 1}, begin_drain=lambda: state.update(drained=True),
                           is_idle=lambda: not state["busy"], drain_timeout_s=60.0).attach(FakeService())
    assert life.address == "127.0.0.1:5555"
    (record,) = registry.list("target")
    assert record.capacity["max_sequences"] == 4 and not record.draining
    import threading

    t = threading.Thread(target=life.drain)
    t.start()
    assert wait_for(lambda: registry.list("target") and registry.list("target")[0].draining, timeout=30)
    # drain marks the record before it calls begin_drain: wait for that call too, not race it
    assert wait_for(lambda: state["drained"], timeout=30) and t.is_alive()  # waits for the live sequence
    state["busy"] = False
    t.join(30)
    assert not t.is_alive() and registry.list("target") == []


def test_lifecycle_without_registry_drains_only():
    life = WorkerLifecycle(RegistryConfig(), "draft", is_idle=lambda: True, drain_timeout_s=5).attach(FakeService())
    t0 = time.monotonic()
    life.drain()
    life.drain()  # idempotent
    assert life.registration is None and time.monotonic() - t0 < 1.0
