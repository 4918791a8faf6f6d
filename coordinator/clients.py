"""gRPC clients for the target tier, behind the loop's TargetClient shape, and the pools of both
tiers from the config (the draft tier's pool: coordinator/draftpool.py).

Membership comes from a static address list (no registry: coordinator.*_workers) or from the
registry: RegistryWatcher calls update(records) with each tier's live workers, so a worker
started at run time gets traffic at the next poll and one that stops heartbeating, or drains,
gets no new work. Routing:

  target  a NEW sequence goes to the worker with the most free KV capacity (free sequence slots,
          then free tokens, from its last heartbeat; this coordinator's own live sequences on it
          count too, so a burst spreads before the next heartbeat). Without load data: the worker
          with the fewest of this coordinator's sequences. The sequence then stays there
          (TargetLease) — its KV cache lives on that worker.
  draft   every round to the least-loaded healthy draft worker (coordinator/draftpool.py).

A worker that answers UNAVAILABLE (down, draining, full) is skipped for retry_after_s.
"""

from __future__ import annotations

import logging

import grpc

from coordinator.draftpool import GrpcDraftPool
from coordinator.membership import Member, Members
from specmesh.core.types import DraftProposal, FeatureSpec, NgramBurst, PrefillOutcome, SamplingParams, VerifyOutcome
from specmesh.errors import Unavailable
from specmesh.rpc.convert import (burst_steps_from_pb, cost_from_pb, feature_request_to_pb, features_from_pb,
                                  ngram_burst_to_pb, probs_to_wire, sampling_to_pb)
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.server import make_channel
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GrpcTargetClient:
    """One target worker. The loop keeps a sequence on the client that prefilled it."""

    def __init__(self, address: str):
        self.address = address
        self.channel = make_channel(address)
        self.stub = pb_grpc.TargetWorkerStub(self.channel)

    def _raise(self, err: grpc.RpcError) -> None:
        """The typed error of a failed call. This client never cancels its own (blocking) calls, so
        CANCELLED means the worker cancelled it, i.e. it is stopping: UNAVAILABLE, so the loop fails
        the sequence over instead of failing the request."""
        if hasattr(err, "code") and err.code() == grpc.StatusCode.CANCELLED:
            raise Unavailable(f"target worker {self.address}: call cancelled by the worker ({err.details()})") from err
        raise_from_rpc(err, f"target worker {self.address}")

    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float,
                max_new_tokens: int = 0) -> int:
        return self.prefill_outcome(seq_id, prompt, params, timeout, max_new_tokens=max_new_tokens).token

    def prefill_outcome(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float,
                        features: FeatureSpec | None = None, max_new_tokens: int = 0) -> PrefillOutcome:
        """Prefill; with `features`, also the prompt's block-drafter features. max_new_tokens: what
        the sequence may still generate (the worker reserves its KV for it)."""
        req = pb.PrefillRequest(seq_id=seq_id, prompt=prompt, sampling=sampling_to_pb(params),
                                max_new_tokens=max_new_tokens)
        if features is not None:
            req.return_features.CopyFrom(feature_request_to_pb(features))
        try:
            resp = self.stub.Prefill(req, timeout=timeout)
        except grpc.RpcError as err:
            self._raise(err)
        return PrefillOutcome(resp.token_id, features_from_pb(resp.features), cost_from_pb(resp.verify_cost))

    def verify(self, seq_id: str, draft: DraftProposal, timeout: float,
               features: FeatureSpec | None = None, steps: int = 1, ngram: NgramBurst | None = None) -> VerifyOutcome:
        vocab = 0 if draft.probs is None else int(draft.probs.shape[1])
        dense, sparse = probs_to_wire(draft.probs)
        req = pb.VerifyRequest(seq_id=seq_id, draft_token_ids=draft.token_ids, draft_probs=dense,
                               draft_sparse_probs=sparse, vocab_size=vocab, draft_parents=draft.parents or [],
                               decode_steps=steps if steps > 1 else 0, ngram_burst=ngram_burst_to_pb(ngram),
                               draft_accept=draft.accept or [])
        if features is not None:
            req.return_features.CopyFrom(feature_request_to_pb(features))
        try:
            resp = self.stub.Verify(req, timeout=timeout)
        except grpc.RpcError as err:
            self._raise(err)
        return VerifyOutcome(resp.accepted, list(resp.token_ids), resp.bonus, features_from_pb(resp.features),
                             cost_from_pb(resp.verify_cost), burst_steps_from_pb(resp), resp.trimmed_tokens)

    def release(self, seq_id: str) -> None:
        try:
            self.stub.Release(pb.ReleaseRequest(seq_id=seq_id), timeout=5.0)
        except grpc.RpcError as err:
            self._raise(err)

    def status(self, timeout: float = 5.0) -> pb.WorkerStatusResponse:
        try:
            return self.stub.Status(pb.WorkerStatusRequest(), timeout=timeout)
        except grpc.RpcError as err:
            self._raise(err)

    def close(self) -> None:
        self.channel.close()


def _target_score(m: Member, prompt_tokens: int) -> tuple:
    rec = m.record
    if rec is None or rec.free_sequences() is None:
        return (1, -m.inflight, 0)  # static: fewest of this coordinator's sequences
    live = max(m.reported("live_sequences"), m.inflight)
    free_seq = int(rec.capacity["max_sequences"]) - live
    free_tok = rec.free_tokens() if rec.free_tokens() is not None else 0
    fits = free_seq > 0 and free_tok >= prompt_tokens
    return (1 if fits else 0, free_seq, free_tok)


class TargetLease:
    """A sequence's target worker (a TargetClient): every call goes to the worker that prefilled it;
    release() also frees the slot this coordinator counts against the worker."""

    def __init__(self, pool: "TargetPool", member: Member):
        self.pool, self.member = pool, member
        self.client = member.client
        self.address = member.address
        self._released = False

    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float,
                max_new_tokens: int = 0) -> int:
        return self._call(self.client.prefill, seq_id, prompt, params, timeout, max_new_tokens=max_new_tokens)

    def prefill_outcome(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float,
                        features: FeatureSpec | None = None, max_new_tokens: int = 0) -> PrefillOutcome:
        return self._call(self.client.prefill_outcome, seq_id, prompt, params, timeout, features,
                          max_new_tokens=max_new_tokens)

    def verify(self, seq_id: str, draft: DraftProposal, timeout: float,
               features: FeatureSpec | None = None, steps: int = 1, ngram: NgramBurst | None = None) -> VerifyOutcome:
        if steps > 1:  # a decode burst (a chain draft, if any, in its first step)
            lookup = {} if ngram is None else {"ngram": ngram}
            return self._call(self.client.verify, seq_id, draft, timeout, features, steps=steps, **lookup)
        if features is None:  # the plain call, as every TargetClient takes it
            return self._call(self.client.verify, seq_id, draft, timeout)
        return self._call(self.client.verify, seq_id, draft, timeout, features)

    def status(self, timeout: float = 5.0):
        return self.client.status(timeout)

    def release(self, seq_id: str) -> None:
        try:
            self.client.release(seq_id)
        finally:
            if not self._released:
                self._released = True
                self.pool.members.done(self.member)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Unavailable:
            self.pool.members.mark_down(self.member, self.pool.retry_after_s)
            raise


class TargetPool:
    """Picks a target worker per new sequence (most free KV capacity; see the module doc)."""

    def __init__(self, addresses: tuple[str, ...] = (), retry_after_s: float = 2.0, fingerprint: str = ""):
        self.members = Members(addresses, GrpcTargetClient, "target")
        self.retry_after_s = retry_after_s
        self.fingerprint = fingerprint  # the model this coordinator serves ("" = not compared)
        self._refused: set[str] = set()

    @property
    def clients(self) -> list[GrpcTargetClient]:
        return [m.client for m in self.members.snapshot()]

    def update(self, records) -> None:
        """Registry records; a target serving another model than this coordinator's (its manifest's
        fingerprint differs: changed weights, another version) is never routed to."""
        records = list(records)
        if self.fingerprint:
            for r in records:
                if r.fingerprint and r.fingerprint != self.fingerprint and r.worker_id not in self._refused:
                    self._refused.add(r.worker_id)
                    log.warning("target worker %s (%s) serves model %s, not this coordinator's %s: not used",
                                r.address, r.worker_id, r.fingerprint, self.fingerprint)
            records = [r for r in records if not r.fingerprint or r.fingerprint == self.fingerprint]
        self.members.update(records)

    def pick(self, exclude=(), prompt_tokens: int = 0) -> TargetLease:
        with self.members.lock:
            cands = self.members.candidates(exclude)
            if not cands:
                known = len(self.members.by_addr)
                raise Unavailable(f"no target worker available ({known} known, {len(exclude)} already tried, "
                                  "others down or draining)" if known else "no target worker registered")
            best = max(cands, key=lambda m: _target_score(m, prompt_tokens))
            best.inflight += 1
        return TargetLease(self, best)


def pools_from_config(cfg, ccfg=None, fingerprint: str = ""):
    """(TargetPool, GrpcDraftPool, watcher|None): static lists, or fed by the registry when
    registry.url is set (then coordinator.*_workers are ignored)."""
    ccfg = ccfg or cfg.coordinator
    dynamic = bool(cfg.registry.url)
    targets = TargetPool(() if dynamic else ccfg.target_workers, ccfg.draft_retry_after_s, fingerprint)
    drafts = GrpcDraftPool(() if dynamic else ccfg.draft_workers, ccfg.draft_retry_after_s)
    watcher = None
    if dynamic:
        from specmesh.registry.store import Registry
        from specmesh.registry.watch import RegistryWatcher

        watcher = RegistryWatcher(Registry.from_config(cfg.registry), {"target": targets.update, "draft": drafts.update},
                                  cfg.registry.poll_interval_s).start()
    return targets, drafts, watcher
