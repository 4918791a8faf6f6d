"""The target engine's model-thread work: prefill and verify forwards, and the cost model's
start-up measurement. TargetEngine (engine.py) admits, checks and queues; its batcher runs these
on the one model thread. No grpc here.

A verify runs step by step (iteration-level scheduling): every running job's next position(s) in
one packed forward (specmesh.engine.kv.batched_step); a round is one step, a decode burst up to
its `steps`, and verify jobs arriving meanwhile join the next step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from specmesh.core.costmodel import ROWS as COST_ROWS
from specmesh.core.ngram import lookup_ngram
from specmesh.core.rejection import verify as verify_round
from specmesh.core.tree import tree_layout, verify_tree
from specmesh.core.trim import cumulative, keep_counts
from specmesh.core.types import DraftProposal, FeatureSpec, NgramBurst, PrefillOutcome, SamplingParams, VerifyOutcome
from specmesh.engine.kv import StepOutput, batched_step
from specmesh.engine.pool import SequenceKV
from specmesh.errors import Unavailable


@dataclass
class Sequence:
    seq_id: str
    kv: SequenceKV
    params: SamplingParams
    generator: torch.Generator
    pending: int | None = None  # last emitted token, not yet in the cache
    tokens: list[int] = field(default_factory=list)  # prompt + emitted (pending last): prompt lookup
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a caller holds the sequence for a prefill/verify
    inflight: bool = False  # its job is with the model thread (queued or running)
    released: bool = False  # dropped from the table; its pool range is freed once no job is in flight


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
    # steps > 1: a burst (VerifyRequest.decode_steps): the draft, if any (chain or tree), verified in the first
    # step, then one-token steps back to back, or with ngram steps that draft by prompt lookup
    steps: int = 1
    ngram: NgramBurst | None = None


class ModelThread:
    """The forwards of a TargetEngine, run on its model thread. Uses the engine's model,
    batch_invariant, row_exact, pool, vocab_size, cost, last_batch_sizes, _last_verify_s,
    draft_trim, trimmed_tokens and _job_done."""

    def _run_batch(self, kind: str, jobs: list, stream=None) -> list:
        jobs = list(jobs)  # verify steps append the jobs that join mid-batch
        try:
            return self._run_jobs(kind, jobs, stream)
        finally:
            for i, job in enumerate(jobs):
                if stream is None or not stream.delivered(i):
                    self._job_done(job.seq)

    def _run_jobs(self, kind: str, jobs: list, stream=None) -> list:
        if kind == "prefill":
            self.last_batch_sizes = (self.last_batch_sizes + [len(jobs)])[-256:]
            return self._run_prefill(jobs, _hidden(jobs))
        return self._run_verify(jobs, stream)

    def measure_cost(self, context: int = 64, repeats: int = 2) -> dict:
        """Seed the cost model: time a forward of each bucket's row count (one sequence of
        `context` tokens, the rows as one chain) on the model thread's kernels, then the batches'
        (_measure_batches); returns the table."""
        kv = self.pool.allocate(context + max(COST_ROWS) + 1)
        ids = [i % self.vocab_size for i in range(1, context + max(COST_ROWS) + 1)]  # any valid tokens
        try:
            self._fill([kv], ids, context)
            measured = {rows: self._best_forward_s([kv], ids, rows, repeats) for rows in COST_ROWS}
        finally:
            kv.release()
        self.cost.seed(measured)
        self._measure_batches(ids, repeats)
        return self.cost.as_dict()

    def _measure_batches(self, ids: list[int], repeats: int, context: int = 32, extra: int = 2) -> None:
        """Seed the cost model's batches (costmodel.BATCHES 4 and 16): a forward of B sequences of
        `context` tokens at one row each, and at 1 + extra rows each (the per-extra-row slope).
        Skipped where the pool has no room for them (tests' small pools)."""
        steps, slopes = {}, {}
        for batch in (4, 16):
            kvs = []
            try:
                kvs += [self.pool.allocate(context + extra + 2) for _ in range(batch)]
                self._fill(kvs, ids, context)
                one, more = (self._best_forward_s(kvs, ids, rows, repeats) for rows in (1, 1 + extra))
                steps[batch], slopes[batch] = one, max(0.0, more - one) / (batch * extra)
            except Unavailable:
                break
            finally:
                for kv in kvs:
                    kv.release()
        self.cost.seed_batches(steps, slopes)

    def _fill(self, kvs: list, ids: list[int], context: int) -> None:
        """Prefill each sequence with ids[:context] and commit it (the cost measurements' context)."""
        batched_step(self.model, kvs, [ids[:context]] * len(kvs), logits_rows=[[context - 1]] * len(kvs))
        for kv in kvs:
            kv.commit(context)

    def _best_forward_s(self, kvs: list, ids: list[int], rows: int, repeats: int) -> float:
        """Seconds of a verify forward of `rows` rows per sequence (not committed): the best of
        `repeats` after a warm-up."""
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            batched_step(self.model, kvs, [ids[:rows]] * len(kvs), row_exact=self.row_exact)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    def _run_prefill(self, jobs: list[PrefillJob], hidden: tuple[int, ...] = ()) -> list[PrefillOutcome]:
        last = [[len(j.prompt) - 1] for j in jobs]  # logits of the last prompt position only
        if self.batch_invariant:  # each prompt alone: unpacked, the target-alone prefill exactly
            outs = [batched_step(self.model, [j.seq.kv], [j.prompt], hidden_layers=hidden, logits_rows=[r])[0]
                    for j, r in zip(jobs, last)]
        else:
            outs = batched_step(self.model, [j.seq.kv for j in jobs], [j.prompt for j in jobs], hidden_layers=hidden,
                                logits_rows=last)
        firsts = []
        for job, out in zip(jobs, outs):
            seq = job.seq
            seq.kv.commit(len(job.prompt))
            first = verify_round(out.logits, DraftProposal([]), seq.params, seq.generator).tokens[0]
            seq.pending, seq.busy, seq.last_used = first, False, time.monotonic()
            seq.tokens = list(job.prompt) + [first]
            rows = None
            if job.features is not None:  # the last max_rows prompt positions
                n = len(job.prompt)
                rows = torch.arange(n - min(n, job.features.max_rows or n), n)
            firsts.append(PrefillOutcome(first, _features(out, hidden, job.features, rows)))
        return firsts

    def _run_verify(self, jobs: list[VerifyJob], stream=None) -> list[VerifyOutcome]:
        """Step by step: every running job's next position(s) in one forward. A job is answered as
        soon as its own steps are done (a round: one step; a decode burst: up to its steps), and
        verify jobs that arrive meanwhile join the next step, so a burst neither holds a round
        back nor is cut short by one. A prefill waiting runs between two steps.
        jobs grows by the joiners; the result list matches it."""
        results: list[VerifyOutcome | None] = [None] * len(jobs)
        taken = [0] * len(jobs)
        running = list(range(len(jobs)))
        while running:
            self.last_batch_sizes = (self.last_batch_sizes + [len(running)])[-256:]  # sequences per forward
            cut = self._trim(jobs, running) if self.draft_trim and len(running) > 1 else {}
            outs = self._verify_step([jobs[i] for i in running], _hidden([jobs[i] for i in running]))
            for i, out in zip(running, outs):
                results[i], taken[i] = _joined(results[i], out, len(jobs[i].draft.token_ids), cut.get(i, 0)), taken[i] + 1
            if stream is None:  # not streaming: the first step's answer for every job
                break
            for i in running:
                spec = jobs[i].ngram
                done = (taken[i] >= jobs[i].steps or (spec is not None and len(results[i].tokens) >= spec.max_tokens)
                        or jobs[i].seq.kv.length >= self.context_window)  # the next step's token: past the window
                if not done:  # the burst's next step: a prompt-lookup draft, or none
                    jobs[i] = dataclasses.replace(jobs[i], draft=self._next_draft(jobs[i], len(results[i].tokens)))
                    done = not jobs[i].draft.token_ids and not self._room_for(jobs[i].seq, 1)  # a draft has its room
                if done:
                    self._job_done(jobs[i].seq)
                    stream.deliver(i, results[i])
            if stream.closing():
                break
            stream.run_others()  # a prefill waiting runs between two steps; the bursts go on
            left = [i for i in running if not stream.delivered(i)]
            joined = stream.take_more(len(left))  # they run at least one step
            jobs.extend(joined)
            results += [None] * len(joined)
            taken += [0] * len(joined)
            running = left + list(range(len(jobs) - len(joined), len(jobs)))
        return results

    def _trim(self, jobs: list[VerifyJob], running: list[int]) -> dict[int, int]:
        """Beside others: each chain draft with p_i cut to the prefix the whole forward does best
        with (core/trim.py), priced by this worker's cost model; jobs[i] replaced in place.
        Returns {i: drafts cut}."""
        accept = [jobs[i].draft.accept if jobs[i].draft.parents is None and jobs[i].draft.token_ids else None
                  for i in running]
        if not any(accept):
            return {}
        rows = sum(1 + (len(jobs[i].draft.token_ids) if a is None else 0) for i, a in zip(running, accept))
        keep = keep_counts(accept, rows, float(len(running)), lambda r: self.cost.estimate(r, len(running)))
        cut = {}
        for i, n in zip(running, keep):
            if n is not None and n < len(jobs[i].draft.token_ids):
                cut[i] = len(jobs[i].draft.token_ids) - n
                jobs[i] = dataclasses.replace(jobs[i], draft=jobs[i].draft.head(n))
        self.trimmed_tokens += sum(cut.values())
        return cut

    def _next_draft(self, job: VerifyJob, emitted: int) -> DraftProposal:
        """A burst's next step's draft: with job.ngram, up to k tokens by prompt lookup over the
        sequence's tokens (k and rates by the match's length where by_match is set), within the
        burst's max_tokens and the context window; else none. A draft the pool has no room for is
        dropped."""
        spec, seq = job.ngram, job.seq
        if spec is None or spec.k <= 0:
            return NO_DRAFT
        cap = min(spec.k, spec.max_tokens - emitted - 1, self.context_window - seq.kv.length - 2)
        n, toks = lookup_ngram(seq.tokens, cap, spec.min_n, spec.max_n) if cap > 0 else (0, [])
        k, rates = spec.for_match(n)
        toks = toks[:k]
        if not toks or not self._room_for(seq, 1 + len(toks)):
            return NO_DRAFT
        return DraftProposal(toks, accept=cumulative(rates, len(toks)) if rates else None)

    @staticmethod
    def _room_for(seq: Sequence, rows: int) -> bool:
        try:
            seq.kv.ensure(seq.kv.length + rows)
            return True
        except Unavailable:  # the pool is full: the burst ends early, the caller asks again
            return False

    def _verify_step(self, jobs: list[VerifyJob], hidden: tuple[int, ...] = ()) -> list[VerifyOutcome]:
        inputs = [[j.seq.pending] + list(j.draft.token_ids) for j in jobs]
        layouts = [tree_layout(j.draft.parents) if j.draft.parents is not None else (None, None) for j in jobs]
        t0 = time.perf_counter()
        outs = batched_step(self.model, [j.seq.kv for j in jobs], inputs, new_masks=[m for m, _ in layouts],
                            depths=[d for _, d in layouts], hidden_layers=hidden, row_exact=self.row_exact)
        self._last_verify_s = time.perf_counter() - t0
        results = []
        for job, out in zip(jobs, outs):
            seq, draft = job.seq, job.draft
            if draft.parents is None:
                outcome = verify_round(out.logits, draft, seq.params, seq.generator)
                keep = torch.arange(outcome.accepted + 1)  # [pending, d_1..d_n]
            else:
                outcome, path = verify_tree(out.logits, draft.token_ids, draft.parents, seq.params, seq.generator)
                keep = torch.tensor(path)  # the accepted root path, root (pending) first
            if draft.parents is None:
                seq.kv.commit(len(keep))  # [pending, d_1..d_n] are in place; rejected slots are dropped
            else:
                seq.kv.commit(0, keep=keep)  # the accepted root path moved down (at most k slots)
            seq.pending = outcome.tokens[-1]
            seq.tokens += outcome.tokens
            feats = _features(out, hidden, job.features, keep)
            results.append(outcome if feats is None else dataclasses.replace(outcome, features=feats))
        self.cost.observe(sum(map(len, inputs)), self._last_verify_s, batch=len(jobs),
                          tokens=sum(len(r.tokens) for r in results))
        return results


NO_DRAFT = DraftProposal([])


def _hidden(jobs: list) -> tuple[int, ...]:
    """HF hidden_states indices of every decoder layer the jobs ask features of (layer l -> l + 1)."""
    return tuple(sorted({layer + 1 for j in jobs if j.features for layer in j.features.layers}))


def _joined(first: VerifyOutcome | None, more: VerifyOutcome, drafted: int, cut: int = 0) -> VerifyOutcome:
    """A burst's outcome so far followed by its next step's, which verified `drafted` tokens
    (`cut` more were drafted and trimmed, core/trim.py)."""
    step = [(drafted, more.accepted)]
    if first is None:
        return dataclasses.replace(more, steps=step, trimmed=cut)
    feats = None if more.features is None else torch.cat([first.features, more.features])
    return dataclasses.replace(first, tokens=first.tokens + more.tokens, features=feats, steps=first.steps + step,
                               trimmed=first.trimmed + cut)


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

