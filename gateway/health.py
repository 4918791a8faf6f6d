"""The gateway's readiness: SERVING only while a real one-token generation through the mesh
succeeds. A background thread probes every `health.probe_interval_s` (every `startup_retry_s`
until the first success); health checks only read the last result. The probe is marked
(x-specmesh-probe): no hop traces it, and its log lines are DEBUG."""

from __future__ import annotations

import logging
import threading
import uuid

import grpc

from specmesh.telemetry import context as reqctx
from specmesh.telemetry import metrics
from specmesh.v1 import specmesh_pb2 as pb

log = logging.getLogger(__name__)


class MeshProbe:
    def __init__(self, coordinator_stub, set_serving, health_cfg):
        self.stub, self.set_serving, self.cfg = coordinator_stub, set_serving, health_cfg
        self.ok: bool | None = None  # None: not probed yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gateway-probe", daemon=True)

    def start(self) -> "MeshProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check_once(self) -> bool:
        info = reqctx.RequestInfo("gateway", "HealthProbe", request_id=f"probe-{uuid.uuid4().hex[:12]}", probe=True)
        req = pb.GenerateRequest(prompt="ping", max_tokens=1, request_id=info.request_id)
        try:
            with reqctx.active(info):
                resp = self.stub.Generate(req, timeout=self.cfg.probe_timeout_s)
        except grpc.RpcError as err:
            self._report(False, f"{err.code().name}: {err.details()}")
            return False
        except Exception as exc:  # noqa: BLE001 - the probe thread must survive anything
            self._report(False, f"{type(exc).__name__}: {exc}")
            return False
        ok = len(resp.token_ids) == 1
        self._report(ok, "" if ok else "the generation returned no token")
        return ok

    def _report(self, ok: bool, why: str) -> None:
        if ok != self.ok:  # log transitions only
            if ok:
                log.info("mesh probe: a one-token generation succeeded; SERVING")
            else:
                log.warning("mesh probe failed (%s); NOT_SERVING", why)
        self.ok = ok
        metrics.HEALTH_PROBE_OK.set(1 if ok else 0)

    def _loop(self) -> None:
        ever_ok = False
        while not self._stop.is_set():
            ok = self.check_once()
            if self._stop.is_set():
                break
            self.set_serving(ok)
            ever_ok = ever_ok or ok
            self._stop.wait(self.cfg.probe_interval_s if ever_ok else self.cfg.startup_retry_s)
