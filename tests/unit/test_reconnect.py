"""A mesh channel to a peer that comes up late (a big target still loading) reaches it within a
couple of seconds of its start, not after gRPC's default reconnect backoff (x1.6 up to 120 s)."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.rpc.server import make_channel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(stub) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_a_peer_that_starts_late_is_reached_soon_after_it_listens() -> None:
    port = _free_port()
    channel = make_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        down_until = time.monotonic() + 20  # 20 s of refused connections: gRPC's default backoff is ~10 s by then
        while time.monotonic() < down_until:
            assert not _check(stub)
            time.sleep(0.5)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        try:
            up = time.monotonic()
            while not _check(stub):
                assert time.monotonic() - up < 4.0, "the channel did not reconnect within 4 s of the peer listening"
                time.sleep(0.1)
        finally:
            server.stop(0)
    finally:
        channel.close()
