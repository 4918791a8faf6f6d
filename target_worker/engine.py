"""Target engine: per-sequence KV caches, batched prefill and verification. No grpc here.

A sequence's cache holds every token except the last emitted one ("pending"): that token's
logits are not known yet. Prefill forwards the prompt and samples the first token. A verify
round forwards [pending, d_1..d_k] in one step (batched with other sequences' rounds), so row i
of the logits scores d_{i+1}; the rejection sampler keeps n drafts and emits one target token,
and the cache keeps the n+1 slots [pending, d_1..d_n]. The prefix is never recomputed.

A draft tree (draft.parents) is verified in the same single forward: input [pending, nodes...]
with the ancestor mask and positions cache_length + depth (specmesh.core.tree); the walk keeps
the accepted root path's KV slots only. When a call asks (FeatureSpec), the target also returns
the block drafter's features of every slot it commits: the chosen decoder layers' outputs,
concatenated, bf16. Other calls request no hidden states and pay nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from specmesh.core.rejection import verify as verify_round
from specmesh.core.sampling import make_generator
from specmesh.core.tree import tree_layout, verify_tree
from specmesh.core.types import DraftProposal, FeatureSpec, PrefillOutcome, SamplingParams, VerifyOutcome
from specmesh.engine import rowexact
from specmesh.engine.batcher import Batcher
from specmesh.engine.kv import SequenceKV, StepOutput, batched_step, new_sequence_kv
from specmesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    seq_id: str
    kv: SequenceKV
    params: SamplingParams
    generator: torch.Generator
    pending: int | None = None  # last emitted token, not yet in the cache
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a prefill/verify job is queued or running


@dataclass(frozen=True)
class PrefillJob:
    seq: Sequence
    prompt: list[int]
    features: FeatureSpec | None = None


@dataclass(frozen=True)
class VerifyJob:
    seq: Sequence
    draft: DraftProposal
    features: FeatureSpec | None = None


class TargetEngine:
    def __init__(self, model, max_batch_size: int, max_sequences: int, max_tokens: int, idle_timeout_s: float,
                 max_queue: int = 1024, batch_invariant: bool = False):
        # batch_invariant: verify row by row with one-token kernels and prefill unpadded, so the
        # output is bitwise the target alone's whatever the batch (specmesh/engine/rowexact.py)
        self.model = rowexact.install(model) if batch_invariant else model
        self.batch_invariant = batch_invariant
        cfg = model.config.get_text_config()
        self.vocab_size, self.num_layers = cfg.vocab_size, cfg.num_hidden_layers
        self.context_window = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        self.max_sequences, self.max_tokens, self.idle_timeout_s = max_sequences, max_tokens, idle_timeout_s
        self._seqs: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self.batcher = Batcher(self._run_batch, max_batch_size, max_queue=max_queue, name="target-batcher")
        self.last_batch_sizes: list[int] = []

    # ------------------------------------------------------------------ public API (any thread)
    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float | None = None) -> int:
        return self.prefill_outcome(seq_id, prompt, params, timeout).token

    def prefill_outcome(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float | None = None,
                        features: FeatureSpec | None = None) -> PrefillOutcome:
        self._check_features(features)
        if not prompt:
            raise InvalidArgument("prompt", "must hold at least one token")
        self._check_tokens(prompt, "prompt")
        if len(prompt) >= self.context_window:
            raise InvalidArgument("prompt", f"{len(prompt)} tokens do not fit the {self.context_window}-token window")
        seq = self._admit(seq_id, params, len(prompt))
        try:
            return self.batcher.submit("prefill", PrefillJob(seq, prompt, features)).result(timeout)
        except BaseException:
            self.release(seq_id)
            raise

    def verify(self, seq_id: str, draft: DraftProposal, timeout: float | None = None,
               features: FeatureSpec | None = None) -> VerifyOutcome:
        self._check_tokens(draft.token_ids, "draft_token_ids")
        self._check_features(features)
        if draft.probs is not None and tuple(draft.probs.shape) != (len(draft.token_ids), self.vocab_size):
            raise InvalidArgument("draft_probs", f"shape {tuple(draft.probs.shape)} != [k, {self.vocab_size}]")
        depth = self._check_tree(draft)
        seq = self._claim(seq_id)
        if seq.kv.length + 1 + depth > self.context_window:
            seq.busy = False
            raise InvalidArgument("draft_token_ids", "round would run past the context window")
        try:
            return self.batcher.submit("verify", VerifyJob(seq, draft, features)).result(timeout)
        finally:
            seq.busy = False
            seq.last_used = time.monotonic()

    def release(self, seq_id: str) -> bool:
        with self._lock:
            return self._seqs.pop(seq_id, None) is not None

    def reclaim_idle(self, now: float | None = None) -> list[str]:
        """Drop sequences untouched for idle_timeout_s (a coordinator that vanished mid-request)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [s for s, q in self._seqs.items() if not q.busy and now - q.last_used > self.idle_timeout_s]
            for s in stale:
                del self._seqs[s]
        if stale:
            log.info("reclaimed %d idle sequence(s)", len(stale))
        return stale

    def cache_length(self, seq_id: str) -> int:
        """Tokens held in the sequence's KV cache (0 when it is not held)."""
        seq = self._seqs.get(seq_id)
        return seq.kv.length if seq is not None else 0

    def live_sequences(self) -> int:
        return len(self._seqs)

    def held_tokens(self) -> int:
        with self._lock:
            return sum(s.kv.length for s in self._seqs.values())

    def idle_for(self, now: float | None = None) -> float:
        """Seconds since any live sequence was last used (inf when none is held, 0 while one is busy)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if any(s.busy for s in self._seqs.values()):
                return 0.0
            return min((now - s.last_used for s in self._seqs.values()), default=float("inf"))

    def kv_bytes(self) -> int:
        with self._lock:
            return sum(s.kv.nbytes() for s in self._seqs.values())

    def close(self) -> None:
        self.batcher.close()

    # ------------------------------------------------------------------ admission
    def _check_tokens(self, tokens: list[int], name: str) -> None:
        if any(t < 0 or t >= self.vocab_size for t in tokens):
            raise InvalidArgument(name, f"token ids must be in [0, {self.vocab_size})")

    def _check_features(self, spec: FeatureSpec | None) -> None:
        if spec is not None and any(not 0 <= layer < self.num_layers for layer in spec.layers):
            raise InvalidArgument("return_features.layers", f"decoder layers must be in [0, {self.num_layers})")

    def _check_tree(self, draft: DraftProposal) -> int:
        """Validate a draft tree; returns the draft's depth (a chain: its length)."""
        if draft.parents is None:
            return len(draft.token_ids)
        if draft.probs is not None:
            raise InvalidArgument("draft_probs", "a draft tree is verified without draft probabilities")
        if len(draft.parents) != len(draft.token_ids):
            raise InvalidArgument("draft_parents", "needs one parent per draft token")
        try:
            return int(tree_layout(draft.parents)[1].max())
        except ValueError as exc:
            raise InvalidArgument("draft_parents", str(exc)) from None

    def _admit(self, seq_id: str, params: SamplingParams, prompt_len: int) -> Sequence:
        with self._lock:
            if seq_id in self._seqs:
                raise FailedPrecondition(f"sequence {seq_id} already exists")
            if len(self._seqs) >= self.max_sequences:
                raise Unavailable(f"KV cache full: {len(self._seqs)} live sequences")
            held = sum(s.kv.length for s in self._seqs.values())
            if held + prompt_len > self.max_tokens:
                raise Unavailable(f"KV cache full: {held} of {self.max_tokens} tokens held")
            seq = Sequence(seq_id, new_sequence_kv(self.model, capacity=prompt_len + 64), params,
                           make_generator(params.seed), busy=True)
            self._seqs[seq_id] = seq
            return seq

    def _claim(self, seq_id: str) -> Sequence:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise NotFound(f"sequence {seq_id} is not held by this worker (released or reclaimed)")
            if seq.busy or seq.pending is None:
                raise FailedPrecondition(f"sequence {seq_id} has a round in flight")
            seq.busy = True
            seq.last_used = time.monotonic()
            return seq

    # ------------------------------------------------------------------ model thread
    def _run_batch(self, kind: str, jobs: list) -> list:
        self.last_batch_sizes = (self.last_batch_sizes + [len(jobs)])[-256:]
        # HF hidden_states indices of every requested decoder layer (layer l -> index l + 1)
        hidden = tuple(sorted({layer + 1 for j in jobs if j.features for layer in j.features.layers}))
        if kind == "prefill":
            return self._run_prefill(jobs, hidden)
        return self._run_verify(jobs, hidden)

    def _run_prefill(self, jobs: list[PrefillJob], hidden: tuple[int, ...] = ()) -> list[PrefillOutcome]:
        if self.batch_invariant:  # each prompt alone: no padding, the target-alone prefill exactly
            outs = [batched_step(self.model, [j.seq.kv], [j.prompt], hidden_layers=hidden)[0] for j in jobs]
        else:
            outs = batched_step(self.model, [j.seq.kv for j in jobs], [j.prompt for j in jobs], hidden_layers=hidden)
        firsts = []
        for job, out in zip(jobs, outs):
            seq = job.seq
            seq.kv.append(out.new_keys, out.new_values)
            first = verify_round(out.logits[-1:], DraftProposal([]), seq.params, seq.generator).tokens[0]
            seq.pending, seq.busy, seq.last_used = first, False, time.monotonic()
            rows = None
            if job.features is not None:  # the last max_rows prompt positions
                n = len(job.prompt)
                rows = torch.arange(n - min(n, job.features.max_rows or n), n)
            firsts.append(PrefillOutcome(first, _features(out, hidden, job.features, rows)))
        return firsts

    def _run_verify(self, jobs: list[VerifyJob], hidden: tuple[int, ...] = ()) -> list[VerifyOutcome]:
        inputs = [[j.seq.pending] + list(j.draft.token_ids) for j in jobs]
        layouts = [tree_layout(j.draft.parents) if j.draft.parents is not None else (None, None) for j in jobs]
        outs = batched_step(self.model, [j.seq.kv for j in jobs], inputs, new_masks=[m for m, _ in layouts],
                            depths=[d for _, d in layouts], hidden_layers=hidden, row_exact=self.batch_invariant)
        results = []
        for job, out in zip(jobs, outs):
            seq, draft = job.seq, job.draft
            if draft.parents is None:
                outcome = verify_round(out.logits, draft, seq.params, seq.generator)
                keep = torch.arange(outcome.accepted + 1)  # [pending, d_1..d_n]
            else:
                outcome, path = verify_tree(out.logits, draft.token_ids, draft.parents, seq.params, seq.generator)
                keep = torch.tensor(path)  # the accepted root path, root (pending) first
            seq.kv.append(out.new_keys, out.new_values, keep=keep)
            seq.pending = outcome.tokens[-1]
            feats = _features(out, hidden, job.features, keep)
            results.append(outcome if feats is None else dataclasses.replace(outcome, features=feats))
        return results


def _features(out: StepOutput, hidden: tuple[int, ...], spec: FeatureSpec | None,
              rows: torch.Tensor | None) -> torch.Tensor | None:
    """The block drafter's features of the committed slots: [len(rows), len(layers) * H] bf16.

    out.hidden_states[i]: [Q, H], HF hidden-state index hidden[i] (decoder layer hidden[i] - 1's
    output; after the final norm for the last layer). rows: [r] slot indices into Q.
    feature(slot) = concat_l h_{l+1}(slot) over spec.layers, in that order.
    """
    if spec is None:
        return None
    picked = [out.hidden_states[hidden.index(layer + 1)].index_select(0, rows) for layer in spec.layers]
    return torch.cat(picked, dim=-1).to(torch.bfloat16)
