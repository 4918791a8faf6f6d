"""The draft tier's pool, behind the loop's DraftPool shape: EVERY ROUND goes to the least-loaded
healthy draft worker serving the method (ties: the one that served this sequence before, for its
cache, then round-robin). The draft tier is stateless to the coordinator: any draft worker can
serve any round. A worker that answers UNAVAILABLE is skipped for retry_after_s; Release of a
finished sequence's draft cache is asynchronous, best effort, and retried.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import grpc

from coordinator.membership import Member, Members
from specmesh.core.types import DraftProposal, SamplingParams
from specmesh.errors import Cancelled, Unavailable
from specmesh.rpc.convert import features_to_pb, proposal_from_pb, sampling_to_pb
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.server import make_channel
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

MAX_TRACKED_SEQUENCES = 100_000
# a draft Release is best effort but must not be lost to a loaded host: a generous deadline and
# two more tries when it timed out or the worker was unreachable for a moment
RELEASE_TIMEOUT_S, RELEASE_ATTEMPTS = 10.0, 3
RELEASE_RETRY_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


class GrpcDraftClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = make_channel(address)
        self.stub = pb_grpc.DraftWorkerStub(self.channel)

    def close(self) -> None:
        self.channel.close()


class GrpcDraftPool:
    """Least-loaded draft worker per round; a worker that fails is skipped for retry_after_s."""

    def __init__(self, addresses: tuple[str, ...] = (), retry_after_s: float = 2.0):
        self.members = Members(addresses, GrpcDraftClient, "draft")
        self.retry_after_s = retry_after_s
        # seq_id -> draft workers that hold its draft cache (bounded: a sequence switched to "off"
        # mid-request by the admin switch is never released here)
        self._served: OrderedDict[str, set[str]] = OrderedDict()
        # Release calls in flight: a gRPC future nobody holds is cancelled when it is garbage
        # collected ("Cancelled upon garbage collection!"), often before it was sent
        self._releasing: set = set()

    @property
    def stubs(self) -> list[tuple[str, Any]]:
        return [(m.address, m.client.stub) for m in self.members.snapshot()]

    def update(self, records) -> None:
        self.members.update(records)

    def available(self, method: str) -> bool:
        """Whether a worker serving `method` may be asked now (none down for its retry time)."""
        return self.members.any_usable(ok=lambda m: m.record is None or m.record.serves(method))

    def _pick(self, seq_id: str, method: str) -> Member:
        with self.members.lock:
            if not self.members.by_addr:
                raise Unavailable("no draft workers configured")
            cands = self.members.candidates(ok=lambda m: m.record is None or m.record.serves(method))
            if not cands:
                raise Unavailable("no draft worker is healthy")
            served = self._served.get(seq_id, ())
            best = min(cands, key=lambda m: (max(m.inflight, m.reported("inflight")), m.address not in served))
            best.inflight += 1
            self._served.setdefault(seq_id, set()).add(best.address)
            if len(self._served) > MAX_TRACKED_SEQUENCES:
                self._served.popitem(last=False)
        return best

    def propose(self, seq_id: str, context: list[int], k: int, method: str, params: SamplingParams,
                round_: int, timeout: float, features=None, tree_budget: int = 0, calls=None,
                budget_s: float = 0.0, candidates: bool = False) -> DraftProposal:
        """features: (rows [r, F], complete) for the block drafter (ProposeRequest.features).
        calls: a list the in-flight call is appended to, for a caller that may cancel it.
        budget_s > 0: up to k tokens, those drafted within budget_s (ProposeRequest.budget_s).
        candidates: a block drafter's candidate table instead of a tree (ProposeRequest.candidates)."""
        member = self._pick(seq_id, method)
        req = pb.ProposeRequest(seq_id=seq_id, context=context, num_tokens=k, method=method,
                                sampling=sampling_to_pb(params), round=round_, tree_budget=tree_budget,
                                budget_s=budget_s, candidates=candidates)
        if features is not None and features[0] is not None:
            req.features.CopyFrom(features_to_pb(features[0]))
            req.features_complete = features[1]
        try:
            call = member.client.stub.Propose.future(req, timeout=timeout)
            if calls is not None:
                calls.append(call)
            resp = call.result()
        except grpc.FutureCancelledError:
            raise Cancelled("pre-draft cancelled") from None
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and call.cancelled():
                raise Cancelled("pre-draft cancelled") from None
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                self.members.mark_down(member, self.retry_after_s)
            raise_from_rpc(err, f"draft worker {member.address}")
        finally:
            self.members.done(member)
        return proposal_from_pb(resp.token_ids, resp.probs, resp.vocab_size, resp.parents, resp.features_missing,
                                sparse=resp.sparse_probs if resp.HasField("sparse_probs") else None,
                                candidates=resp.candidates if resp.HasField("candidates") else None)

    def release(self, seq_id: str) -> None:
        # best effort and asynchronous: the draft cache is only an optimisation (LRU-bounded)
        with self.members.lock:
            addresses = self._served.pop(seq_id, ())
            targets = [self.members.by_addr[a] for a in addresses if a in self.members.by_addr]
        for m in targets:
            self._send_release(m, seq_id, RELEASE_ATTEMPTS)

    def _send_release(self, member: Member, seq_id: str, attempts: int) -> None:
        """Held until it ended (at once if it already did); a Release that timed out or found the
        worker unreachable (a loaded host, a reconnect) is sent again, up to `attempts` times."""
        call = member.client.stub.Release.future(pb.ReleaseDraftRequest(seq_id=seq_id), timeout=RELEASE_TIMEOUT_S)
        self._releasing.add(call)

        def ended(c) -> None:
            retry = attempts > 1 and not c.cancelled() and c.code() in RELEASE_RETRY_CODES
            if retry and member.address in self.members.by_addr:
                self._send_release(member, seq_id, attempts - 1)
            self._releasing.discard(c)

        call.add_done_callback(ended)
