"""specmesh.rpc.admission.AdmissionLimiter: max in-flight, a bounded queue, quick refusals."""

from __future__ import annotations

import threading
import time

import pytest

from specmesh.config import ConfigError, load_config
from specmesh.errors import DeadlineExceeded, Unavailable
from specmesh.rpc.admission import AdmissionLimiter, deadline_from


def hold(limiter, started: threading.Event, release: threading.Event, out: list):
    try:
        with limiter.slot():
            started.set()
            release.wait(30)
        out.append("ok")
    except Exception as exc:  # noqa: BLE001
        out.append(exc)
        started.set()


def test_in_flight_then_queue_then_refused_at_once():
    lim = AdmissionLimiter("t", max_inflight=1, max_queue=1, queue_timeout_s=30)
    release, out = threading.Event(), []
    s1, s2 = threading.Event(), threading.Event()
    t1 = threading.Thread(target=hold, args=(lim, s1, release, out))
    t1.start()
    assert s1.wait(10) and lim.inflight == 1
    t2 = threading.Thread(target=hold, args=(lim, s2, release, out))
    t2.start()
    assert_eventually(lambda: lim.waiting == 1)
    with pytest.raises(Unavailable, match="overloaded"):
        lim.acquire()  # full: refused without waiting for queue_timeout_s
    assert lim.rejected == 1
    release.set()
    t1.join(10)
    t2.join(10)
    assert out == ["ok", "ok"] and lim.inflight == 0 and lim.waiting == 0


def test_queue_wait_gives_up_after_queue_timeout():
    lim = AdmissionLimiter("t", 1, 4, queue_timeout_s=0.05)
    lim.acquire()
    with pytest.raises(Unavailable, match="no slot"):
        lim.acquire()
    lim.release()
    lim.acquire()  # the slot is free again
    lim.release()


def test_queue_wait_never_outlives_the_callers_deadline():
    lim = AdmissionLimiter("t", 1, 4, queue_timeout_s=30)
    lim.acquire()
    with pytest.raises(DeadlineExceeded):
        lim.acquire(deadline=time.monotonic() + 0.05)
    lim.release()


def test_zero_queue_refuses_as_soon_as_all_slots_are_taken():
    lim = AdmissionLimiter("t", 2, 0, queue_timeout_s=30)
    lim.acquire()
    lim.acquire()
    with pytest.raises(Unavailable):
        lim.acquire()
    assert lim.capacity == 2


def test_a_released_slot_goes_to_the_waiter():
    lim = AdmissionLimiter("t", 1, 2, queue_timeout_s=30)
    lim.acquire()
    got = threading.Event()
    t = threading.Thread(target=lambda: (lim.acquire(), got.set()))
    t.start()
    assert_eventually(lambda: lim.waiting == 1)
    lim.release()
    assert got.wait(10)
    t.join(5)
    assert lim.inflight == 1


def test_on_reject_is_called_per_refusal():
    calls = []
    lim = AdmissionLimiter("t", 1, 0, 1, on_reject=lambda: calls.append(1))
    lim.acquire()
    for _ in range(3):
        with pytest.raises(Unavailable):
            lim.acquire()
    assert len(calls) == 3


def test_deadline_from_context():
    class Ctx:
        def __init__(self, left):
            self.left = left

        def time_remaining(self):
            return self.left

    assert deadline_from(Ctx(None)) is None
    assert abs(deadline_from(Ctx(5.0)) - (time.monotonic() + 5.0)) < 1.0


def test_backpressure_and_shutdown_config():
    cfg = load_config(environ={})
    for role in ("gateway", "coordinator", "draft_worker", "target_worker"):
        bp = getattr(cfg.backpressure, role)
        assert bp.max_inflight >= 1 and bp.max_queue >= 0
    assert cfg.shutdown.grace_s > 0
    with pytest.raises(ConfigError, match="^backpressure.gateway.max_inflight:"):
        load_config(environ={}, overrides={"backpressure": {"gateway": {"max_inflight": 0}}})
    cfg = load_config(environ={"SPECMESH_BACKPRESSURE__TARGET_WORKER__MAX_QUEUE": "3"})
    assert cfg.backpressure.target_worker.max_queue == 3


def assert_eventually(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)
