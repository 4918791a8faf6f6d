"""gRPC clients for the two worker tiers, behind the loop's TargetClient / DraftPool shapes."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from specmesh.core.types import DraftProposal, SamplingParams, VerifyOutcome
from specmesh.errors import Unavailable
from specmesh.rpc.convert import probs_to_bytes, proposal_from_pb, sampling_to_pb
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.server import make_channel
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GrpcTargetClient:
    """One target worker. The loop keeps a sequence on the client that prefilled it."""

    def __init__(self, address: str):
        self.address = address
        self.stub = pb_grpc.TargetWorkerStub(make_channel(address))

    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float) -> int:
        req = pb.PrefillRequest(seq_id=seq_id, prompt=prompt, sampling=sampling_to_pb(params))
        try:
            return self.stub.Prefill(req, timeout=timeout).token_id
        except grpc.RpcError as err:
            raise_from_rpc(err, f"target worker {self.address}")

    def verify(self, seq_id: str, draft: DraftProposal, timeout: float) -> VerifyOutcome:
        vocab = 0 if draft.probs is None else int(draft.probs.shape[1])
        req = pb.VerifyRequest(seq_id=seq_id, draft_token_ids=draft.token_ids,
                               draft_probs=probs_to_bytes(draft.probs), vocab_size=vocab)
        try:
            resp = self.stub.Verify(req, timeout=timeout)
        except grpc.RpcError as err:
            raise_from_rpc(err, f"target worker {self.address}")
        return VerifyOutcome(resp.accepted, list(resp.token_ids), resp.bonus)

    def release(self, seq_id: str) -> None:
        try:
            self.stub.Release(pb.ReleaseRequest(seq_id=seq_id), timeout=5.0)
        except grpc.RpcError as err:
            raise_from_rpc(err, f"target worker {self.address}")

    def status(self, timeout: float = 5.0) -> pb.WorkerStatusResponse:
        try:
            return self.stub.Status(pb.WorkerStatusRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise_from_rpc(err, f"target worker {self.address}")


class TargetPool:
    """Picks a target worker per new sequence (round-robin)."""

    def __init__(self, addresses: tuple[str, ...]):
        self.clients = [GrpcTargetClient(a) for a in addresses]
        self._next = itertools.cycle(range(len(self.clients)))
        self._lock = threading.Lock()

    def pick(self) -> GrpcTargetClient:
        with self._lock:
            return self.clients[next(self._next)]


class GrpcDraftPool:
    """Round-robin over draft workers; a worker that fails is skipped for retry_after_s.

    Any draft worker can serve any round (they only cache, keyed by seq_id), so a round simply
    goes to the next healthy one."""

    def __init__(self, addresses: tuple[str, ...], retry_after_s: float):
        self.stubs = [(a, pb_grpc.DraftWorkerStub(make_channel(a))) for a in addresses]
        self.retry_after_s = retry_after_s
        self._down_until = [0.0] * len(self.stubs)
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def _pick(self) -> int:
        with self._lock:
            now = time.monotonic()
            for _ in range(len(self.stubs)):
                i = next(self._rr) % len(self.stubs)
                if self._down_until[i] <= now:
                    return i
        raise Unavailable("no draft worker is healthy")

    def propose(self, seq_id: str, context: list[int], k: int, method: str, params: SamplingParams,
                round_: int, timeout: float) -> DraftProposal:
        if not self.stubs:
            raise Unavailable("no draft workers configured")
        i = self._pick()
        address, stub = self.stubs[i]
        req = pb.ProposeRequest(seq_id=seq_id, context=context, num_tokens=k, method=method,
                                sampling=sampling_to_pb(params), round=round_)
        try:
            resp = stub.Propose(req, timeout=timeout)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                with self._lock:
                    self._down_until[i] = time.monotonic() + self.retry_after_s
            raise_from_rpc(err, f"draft worker {address}")
        return proposal_from_pb(resp.token_ids, resp.probs, resp.vocab_size)

    def release(self, seq_id: str) -> None:
        # best effort and asynchronous: the draft cache is only an optimisation (LRU-bounded)
        for _, stub in self.stubs:
            stub.Release.future(pb.ReleaseDraftRequest(seq_id=seq_id), timeout=2.0)
