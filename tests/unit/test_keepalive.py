"""A peer that stops answering (SIGSTOP: alive, its socket open, nothing read) is found by the mesh
channels' keepalive: the call in flight fails UNAVAILABLE within ~15 s instead of waiting out its
deadline (the coordinator then fails over; a client retries elsewhere)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.netutil import free_port
from specmesh.rpc.server import CHANNEL_OPTIONS

SERVER = """
import sys, threading
from specmesh.rpc.server import Service
svc = Service("probe", sys.argv[1], lambda server: None, 2, credentials=None).start()
print("up", flush=True)
threading.Event().wait()
"""


def test_keepalive_finds_a_stopped_peer():
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE,
                            env=dict(os.environ, OTEL_TRACES_EXPORTER="none"))
    try:
        assert proc.stdout.readline().strip() == b"up"
        with grpc.insecure_channel(address, CHANNEL_OPTIONS) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=120)  # a call that stays open
            next(watch)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                next(watch)
                raise AssertionError("the watch ended without an error")
            except grpc.RpcError as err:
                took = time.monotonic() - t0
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert took < 40, f"found after {took:.0f} s (the deadline was 120 s)"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
