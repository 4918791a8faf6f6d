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

import logging
import threading
import time

from specmesh.capacity import ROUND_SLOTS  # slots one round may write past the cache
from specmesh.config import MAX_DRAFT_TOKENS, MAX_SEQ_ID_CHARS
from specmesh.core.costmodel import VerifyCost
from specmesh.core.sampling import make_generator
from specmesh.core.tree import tree_layout
from specmesh.core.types import DraftProposal, FeatureSpec, NgramBurst, PrefillOutcome, SamplingParams, VerifyOutcome
from specmesh.engine import attention, bf16rows, cpu_gemm, row_attn, rowexact
from specmesh.engine.batcher import Batcher
from specmesh.engine.pool import new_pool
from specmesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from target_worker.steps import ModelThread, PrefillJob, Sequence, VerifyJob

MAX_MATCH_BUCKETS = 16  # NgramBurst.by_match entries one Verify may carry

log = logging.getLogger(__name__)


DEFAULT_RESERVE = 512  # new tokens reserved for a sequence whose Prefill does not say (it grows past)


def resolve_batch_invariant(model, setting: bool | str) -> int:
    """The row-exact mode (rowexact.rows) for target_worker.batch_invariant (rowexact.mode_for)."""
    return rowexact.mode_for(model, setting)


class TargetEngine(ModelThread):
    def __init__(self, model, max_batch_size: int, max_sequences: int, max_tokens: int, idle_timeout_s: float,
                 max_queue: int = 1024, batch_invariant: bool | str = False, cpu_kernel: bool | str = "auto",
                 batch_gather: float = 0.0, attention_fold: bool | str = "auto", draft_trim: bool = False,
                 bf16_rows: bool | str = "auto"):
        # cpu_kernel: float32 linears of a step from packed weights (specmesh/engine/cpu_gemm.py)
        # where it builds and runs; batch_invariant: verify with one-token kernels and prefill
        # unpacked, so the output is bitwise the target alone's whatever the batch (rowexact.py);
        # attention_fold: one-token rows' attention laid out as rows where faster (attention.py)
        attention.configure(attention_fold)
        bf16rows.configure(bf16_rows)  # batched bf16 rows of the decoder's linears (bf16rows.py)
        self.cpu_kernel = bool(cpu_kernel) and cpu_gemm.install(model)
        self.row_exact = resolve_batch_invariant(model, batch_invariant)  # 0 / 1 / 2 (rowexact.rows)
        self.batch_invariant = bool(self.row_exact)
        # bf16 attention rows on the row kernel: the mesh's own kernels (mode 2), and batched steps
        # where the CPU kernels are allowed, under auto where probed faster (row_attn.py: never the
        # target alone's own steps)
        row_attn.enable_bf16(model, True if self.row_exact == 2 else self.row_exact == 0 and cpu_kernel)
        self.model = rowexact.install(model) if self.batch_invariant else model
        if self.row_exact and next(model.parameters()).device.type == "cpu":
            cpu_gemm.load()  # deterministic rows' SDPA loop (kv._rows_exact): built or loaded now, not in a step
        cfg = model.config.get_text_config()
        self.vocab_size, self.num_layers = cfg.vocab_size, cfg.num_hidden_layers
        self.context_window = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            # pool attention reads every slot: keep sequences inside the window, where that is exact
            self.context_window = min(self.context_window, int(cfg.sliding_window))
        self.max_sequences, self.idle_timeout_s = max_sequences, idle_timeout_s
        self.pool = new_pool(model, max_tokens)  # the KV of every sequence, allocated once (pool.py)
        self.cost = VerifyCost()  # seconds per verify forward by packed rows (measure_cost, every batch)
        self._seqs: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        # batch_gather: a verify batch waits up to this fraction of the last verify forward for the
        # sequences between two rounds (their callers are turning a result into the next round)
        self.batch_gather, self._last_verify_s = batch_gather, 0.0
        self.draft_trim = draft_trim  # beside others, chains verified as far as the batch gains (core/trim.py)
        self.trimmed_tokens = 0  # drafts left unverified so (metrics)
        self.batcher = Batcher(self._run_batch, max_batch_size, max_queue=max_queue, name="target-batcher",
                               gather=self._gather if batch_gather > 0 else None, streaming=True)
        self.last_batch_sizes: list[int] = []

    # ------------------------------------------------------------------ public API (any thread)
    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float | None = None) -> int:
        return self.prefill_outcome(seq_id, prompt, params, timeout).token

    def prefill_outcome(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float | None = None,
                        features: FeatureSpec | None = None, max_new_tokens: int = 0) -> PrefillOutcome:
        """max_new_tokens: what the caller may still generate (0: unknown); the sequence's pool
        range is reserved for it up front, so it never has to move."""
        self._check_features(features)
        if not 0 < len(seq_id) <= MAX_SEQ_ID_CHARS:
            raise InvalidArgument("seq_id", f"1 to {MAX_SEQ_ID_CHARS} characters")
        if not prompt:
            raise InvalidArgument("prompt", "must hold at least one token")
        self._check_tokens(prompt, "prompt")
        if len(prompt) >= self.context_window:
            raise InvalidArgument("prompt", f"{len(prompt)} tokens do not fit the {self.context_window}-token window")
        seq = self._admit(seq_id, params, len(prompt), max_new_tokens)
        try:
            return self._run_job("prefill", PrefillJob(seq, prompt, features), timeout)
        except BaseException:
            self.release(seq_id)
            raise

    def verify(self, seq_id: str, draft: DraftProposal, timeout: float | None = None,
               features: FeatureSpec | None = None, steps: int = 1, ngram: NgramBurst | None = None) -> VerifyOutcome:
        """One round (steps 1) or a burst of `steps` target steps: the draft, if any (a chain or a
        tree), in the first, then one-token steps, or steps drafting by prompt lookup (ngram)."""
        if not 1 <= steps <= MAX_DRAFT_TOKENS:
            raise InvalidArgument("decode_steps", f"1..{MAX_DRAFT_TOKENS}")
        _check_ngram(ngram)
        if len(draft.token_ids) > MAX_DRAFT_TOKENS:  # before the tree's [N+1, N+1] mask is built
            raise InvalidArgument("draft_token_ids", f"at most {MAX_DRAFT_TOKENS} draft tokens")
        self._check_tokens(draft.token_ids, "draft_token_ids")
        self._check_features(features)
        if draft.probs is not None and tuple(draft.probs.shape) != (len(draft.token_ids), self.vocab_size):
            raise InvalidArgument("draft_probs", f"shape {tuple(draft.probs.shape)} != [k, {self.vocab_size}]")
        depth = self._check_tree(draft)
        seq = self._claim(seq_id)
        try:
            if seq.kv.length + 1 + depth > self.context_window:
                raise InvalidArgument("draft_token_ids", "round would run past the context window")
            seq.kv.ensure(seq.kv.length + 1 + len(draft.token_ids))  # Unavailable when the pool is full
            return self._run_job("verify", VerifyJob(seq, draft, features, steps, ngram), timeout)
        finally:
            seq.busy = False
            seq.last_used = time.monotonic()

    def release(self, seq_id: str) -> bool:
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return False
            seq.released = True
            if not seq.inflight:  # else the job's end frees it (_job_done): never under a running step
                seq.kv.release()
            return True

    def _run_job(self, kind: str, job, timeout: float | None):
        """Submit one job for its sequence and wait; a job given up on before it ran is cancelled."""
        seq = job.seq
        with self._lock:
            seq.inflight = True
        try:
            future = self.batcher.submit(kind, job)
        except BaseException:
            self._job_done(seq)
            raise
        try:
            return future.result(timeout)
        except BaseException:
            if future.cancel():  # never reached the model thread
                self._job_done(seq)
            raise

    def _job_done(self, seq: Sequence) -> None:
        with self._lock:
            seq.inflight = False
            if seq.released:
                seq.kv.release()

    def reclaim_idle(self, now: float | None = None) -> list[str]:
        """Drop sequences untouched for idle_timeout_s (a coordinator that vanished mid-request)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [s for s, q in self._seqs.items() if not q.busy and now - q.last_used > self.idle_timeout_s]
            for s in stale:
                q = self._seqs.pop(s)
                q.released = True
                if not q.inflight:
                    q.kv.release()
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

    def reserved_tokens(self) -> int:
        """Pool slots owned by live sequences (held tokens plus each one's reserved headroom)."""
        return self.pool.max_tokens - self.pool.free_tokens()

    def close(self) -> None:
        self.batcher.close()

    # ------------------------------------------------------------------ admission
    def _check_tokens(self, tokens: list[int], name: str) -> None:
        if any(t < 0 or t >= self.vocab_size for t in tokens):
            raise InvalidArgument(name, f"token ids must be in [0, {self.vocab_size})")

    def _check_features(self, spec: FeatureSpec | None) -> None:
        if spec is not None and (len(spec.layers) > self.num_layers
                                 or any(not 0 <= layer < self.num_layers for layer in spec.layers)):
            raise InvalidArgument("return_features.layers", f"at most {self.num_layers} decoder layers, "
                                                            f"each in [0, {self.num_layers})")

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

    def _admit(self, seq_id: str, params: SamplingParams, prompt_len: int, max_new: int = 0) -> Sequence:
        with self._lock:
            if seq_id in self._seqs:
                raise FailedPrecondition(f"sequence {seq_id} already exists")
            if len(self._seqs) >= self.max_sequences:
                raise Unavailable(f"KV cache full: {len(self._seqs)} live sequences")
            if prompt_len + 1 > self.pool.max_tokens:
                raise Unavailable(f"KV cache full: a {prompt_len}-token prompt exceeds the {self.pool.max_tokens}-token pool")
            want = min(prompt_len + (max_new or DEFAULT_RESERVE) + ROUND_SLOTS, self.context_window + ROUND_SLOTS)
            try:
                kv = self.pool.allocate(want)
            except Unavailable:  # no range with headroom: the prompt alone, grown round by round
                kv = self.pool.allocate(prompt_len + 1)
            seq = Sequence(seq_id, kv, params, make_generator(params.seed), busy=True)
            self._seqs[seq_id] = seq
            return seq

    def _claim(self, seq_id: str) -> Sequence:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise NotFound(f"sequence {seq_id} is not held by this worker (released or reclaimed)")
            if seq.busy or seq.inflight or seq.pending is None:
                raise FailedPrecondition(f"sequence {seq_id} has a round in flight")
            seq.busy = True
            seq.last_used = time.monotonic()
            return seq

    # ------------------------------------------------------------------ model thread
    def _gather(self, kind: str, n: int, recent_s: float = 1.0) -> tuple[int, float]:
        """(verify jobs to wait for in all, longest wait): the n taken plus every sequence between
        two rounds (prefilled, no job in flight, touched in the last recent_s + two forwards: its
        last round took one forward or more, a slow model's more than a second)."""
        if kind != "verify":
            return n, 0.0
        now, recent_s = time.monotonic(), recent_s + 2 * self._last_verify_s
        with self._lock:
            coming = sum(1 for q in self._seqs.values()
                         if not q.inflight and not q.released and q.pending is not None and now - q.last_used < recent_s)
        return n + coming, self.batch_gather * self._last_verify_s


def _check_ngram(spec: NgramBurst | None) -> None:
    if spec is None:
        return
    if not (0 <= spec.k <= MAX_DRAFT_TOKENS and 1 <= spec.min_n <= spec.max_n <= MAX_DRAFT_TOKENS
            and spec.max_tokens >= 1):
        raise InvalidArgument("ngram_burst", f"k 0..{MAX_DRAFT_TOKENS}, 1 <= min_n <= max_n <= {MAX_DRAFT_TOKENS}, "
                              "max_tokens >= 1")
    mins = [b.min_match for b in spec.by_match]
    if (len(mins) > MAX_MATCH_BUCKETS or any(m < 1 for m in mins) or mins != sorted(set(mins))
            or any(not 0 <= b.k <= MAX_DRAFT_TOKENS for b in spec.by_match)):
        raise InvalidArgument("ngram_burst.by_match", f"at most {MAX_MATCH_BUCKETS} entries, min_match >= 1 and "
                              f"ascending, k 0..{MAX_DRAFT_TOKENS}")
