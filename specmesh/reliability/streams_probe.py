"""Concurrent requests per connection and per API key, probed on a real mesh: hold N streams open
(each has sent its first chunk, so it is in flight), then one more must be refused at once."""

from __future__ import annotations

import grpc

from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

LONG = "Count from 1 to 300, separated by commas."
ATTEMPTS = 3  # a held stream may finish before the extra request lands: then again


def _open(channel, metadata, n: int, max_tokens: int) -> list:
    calls = [pb_grpc.GatewayStub(channel).GenerateStream(pb.GenerateRequest(prompt=LONG, max_tokens=max_tokens),
                                                         timeout=300, metadata=metadata) for _ in range(n)]
    for call in calls:
        next(call)  # its first chunk: in flight at the gateway
    return calls


def _extra(channel, metadata) -> tuple[str, str]:
    try:
        pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(prompt="hi", max_tokens=1), timeout=60,
                                              metadata=metadata)
        return "OK", ""
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""


def _hold_and_try(mesh, groups: list[tuple[str, int]], extra: tuple[str, str]) -> tuple[str, str, str]:
    """groups: (key name, streams) each on its own connection; extra: (key name, 'same' | 'new')
    connection for the one more request. -> (status holding, status of the extra, details)."""
    max_tokens = mesh.cfg.gateway.max_tokens_limit
    for _ in range(ATTEMPTS):
        channels, calls = [], []
        try:
            for key, n in groups:
                channels.append(mesh.channel("gateway", own_connection=True))
                calls += _open(channels[-1], mesh.metadata(key), n, max_tokens)
            if extra[1] == "new":
                channels.append(mesh.channel("gateway", own_connection=True))
            status, details = _extra(channels[-1], mesh.metadata(extra[0]))
            if all(not c.done() for c in calls):
                return "OK", status, details
        except grpc.RpcError as err:
            return err.code().name, "", err.details() or ""
        finally:
            for call in calls:
                call.cancel()
            for ch in channels:
                ch.close()
    return "OK", "INCONCLUSIVE", f"a held stream ended before the extra request in {ATTEMPTS} tries"


def connection_limit_row(mesh, row_cls):
    n = mesh.cfg.gateway.max_streams_per_connection
    at, past, details = _hold_and_try(mesh, [("user", n)], ("user", "same"))
    ok = at == "OK" and past == "RESOURCE_EXHAUSTED" and "per connection" in details
    return row_cls("concurrent requests per connection", "gateway.max_streams_per_connection", n, at, past,
                   "RESOURCE_EXHAUSTED", ok, "" if ok else details[:200])


def key_limit_row(mesh, row_cls):
    """Spread over connections, each below its own limit; another key on a new connection still gets in."""
    per_conn, n = mesh.cfg.gateway.max_streams_per_connection, mesh.cfg.gateway.max_streams_per_key
    groups = [("user", min(per_conn - 1, n - i)) for i in range(0, n, per_conn - 1)] if per_conn > 1 else []
    at, past, details = _hold_and_try(mesh, groups, ("user", "new"))
    other = _hold_and_try(mesh, groups, ("other", "new"))[1]
    ok = at == "OK" and past == "RESOURCE_EXHAUSTED" and "per API key" in details and other == "OK"
    return row_cls("concurrent requests per API key", "gateway.max_streams_per_key", n, at, past,
                   "RESOURCE_EXHAUSTED", ok, f"another key meanwhile: {other}" + ("" if ok else f"; {details[:160]}"))
