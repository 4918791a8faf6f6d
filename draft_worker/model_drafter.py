"""ModelDrafter: any HF causal LM with the target's tokenizer, drafting k tokens autoregressively.
No grpc here.

It keeps a per-sequence KV cache keyed by seq_id (LRU) and reuses the longest prefix it shares
with the context it is sent, so it is stateless to the caller: any worker can serve any round, a
miss just recomputes. Its model thread batches per drafting step: every running proposal drafts
its next token in one forward, a proposal is answered as soon as its k tokens are drafted, and
proposals that arrive meanwhile join the next step (iteration-level batching, as vLLM
schedules), so requests out of step with one another still share the draft model's forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draft_worker.drafters import ProposeJob, _BatchedDrafter, _draft_seed, _wait
from draft_worker.sequence_lru import SequenceLru
from specmesh.core.sampling import make_generator, sample, truncate, warp_logits
from specmesh.core.types import DraftProposal
from specmesh.engine.batcher import Batcher
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import SequenceKV, new_sequence_kv


@dataclass
class _Cached:
    kv: SequenceKV
    tokens: list[int]  # the tokens whose KV the cache holds, in order


class ModelDrafter(_BatchedDrafter):
    name = "draft_model"

    def __init__(self, model, max_batch_size: int, cache_max_sequences: int, max_queue: int = 1024,
                 proposal_top_k: int = 0, cache_max_tokens: int = 0):
        self.model = model
        text = model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.context_window = getattr(text, "max_position_embeddings", None)  # Propose refuses longer contexts
        # T > 0: sample each draft from its distribution kept on the proposal_top_k likeliest tokens
        # (0: the whole vocabulary); that truncated row is the proposal sent, sparse on the wire
        self.proposal_top_k = proposal_top_k
        # seq_id -> _Cached; cache_max_tokens: KV slots held in all (0: only the sequence count bounds it)
        self._cache = SequenceLru(cache_max_sequences, cache_max_tokens, size=lambda e: e.kv.capacity)
        self.batcher = Batcher(self._run_batch, max_batch_size, max_queue=max_queue, name="draft-batcher",
                               streaming=True)

    def propose(self, job: ProposeJob, timeout: float | None = None) -> DraftProposal:
        if job.k == 0:
            return DraftProposal([], None)
        return _wait(self.batcher.submit("propose", job), timeout)

    # ------------------------------------------------------------------ model thread
    def _take_cache(self, job: ProposeJob) -> tuple[_Cached, list[int]]:
        """The sequence's cache cut to the longest prefix shared with the context, and the
        context tokens still to forward (at least one, so its logits exist)."""
        entry = self._cache.take(job.seq_id)
        if entry is None:
            entry = _Cached(new_sequence_kv(self.model, capacity=len(job.context) + 64), [])  # a private pool
        shared = 0
        limit = min(len(entry.tokens), len(job.context) - 1)
        while shared < limit and entry.tokens[shared] == job.context[shared]:
            shared += 1
        entry.kv.truncate(shared)
        entry.tokens = entry.tokens[:shared]
        return entry, job.context[shared:]

    def _run_batch(self, kind: str, jobs: list[ProposeJob], stream=None) -> list[DraftProposal | None]:
        """One forward per drafting step for every running job. A job is answered as soon as its k
        tokens are drafted (or its caller cancelled it), and proposals queued meanwhile join the
        next step (iteration-level batching, as vLLM schedules): requests out of step with each
        other still share the draft model's forwards instead of each waiting for a whole batch.
        jobs grows by the joiners; the result list matches it (None where answered by stream)."""
        jobs, running = list(jobs), []
        results: list[DraftProposal | None] = [None] * len(jobs)
        for i, job in enumerate(jobs):
            self._join(running, job, i, results, stream)
        while running:
            t0 = time.monotonic()
            outs = batched_step(self.model, [d.entry.kv for d in running], [d.inputs for d in running],
                                logits_rows=[[len(d.inputs) - 1] for d in running])
            for d, out in zip(running, outs):
                d.advance(out.logits, self.proposal_top_k)  # out.logits: [1, V]
            step_s = time.monotonic() - t0  # a budgeted job stops when another step would overrun it
            for d in [d for d in running if d.finished(step_s)]:
                running.remove(d)
                self._answer(d, results, stream)
            if stream is None or stream.others_waiting():
                continue
            for job in stream.take_more(len(running)):  # they draft from the next step
                jobs.append(job)
                results.append(None)
                self._join(running, job, len(jobs) - 1, results, stream)
        return results

    def _join(self, running: list["_Drafting"], job: ProposeJob, index: int, results: list, stream) -> None:
        for old in [d for d in running if d.job.seq_id == job.seq_id]:
            # its caller moved on (a stale pre-draft whose cancel has not arrived yet): answer it as
            # it stands and hand its cache to the new proposal instead of drafting from scratch
            running.remove(old)
            self._answer(old, results, stream)
        running.append(_Drafting(job, *self._take_cache(job), index=index))

    def _answer(self, d: "_Drafting", results: list, stream) -> None:
        self._cache.put(d.job.seq_id, d.entry)
        results[d.index] = d.result()
        if stream is not None:
            stream.deliver(d.index, results[d.index])


class _Drafting:
    """One proposal being drafted on the model thread: its cache, the tokens still to forward and
    what it drafted so far."""

    def __init__(self, job: ProposeJob, entry: _Cached, inputs: list[int], index: int):
        self.job, self.entry, self.inputs = job, entry, inputs
        self.index = index
        self.gen = make_generator(_draft_seed(job.params.seed, job.round)) if job.params.seed is not None else None
        self.drafts: list[int] = []
        self.probs: list[torch.Tensor] = []  # each [V]

    def advance(self, logits: torch.Tensor, top_k: int) -> None:
        """logits: [1, V] after the forward of self.inputs: commit them, draft the next token."""
        self.entry.kv.commit(len(self.inputs))
        self.entry.tokens += self.inputs
        q = warp_logits(logits, self.job.params)  # [1, V] draft distribution
        if not self.job.params.greedy:
            q = truncate(q, top_k)  # exactly what the token is drawn from
        token = int(q[0].argmax()) if self.job.params.greedy else int(sample(q, self.gen)[0])
        self.drafts.append(token)
        self.probs.append(q[0])
        self.inputs = [token]

    def finished(self, step_s: float) -> bool:
        # a cancelled call (a pre-draft the coordinator found stale) stops here: its cache keeps
        # what was forwarded, and the draft tier is free for the round that replaces it; a budgeted
        # one (a pre-draft beside live others) when one more step of step_s would end past its time
        if len(self.drafts) >= self.job.k or not self.job.alive():
            return True
        return self.job.stop_at > 0 and time.monotonic() + step_s > self.job.stop_at

    def result(self) -> DraftProposal:
        # greedy drafts are a point mass: no distribution to send
        greedy = self.job.params.greedy or not self.probs
        return DraftProposal(self.drafts, None if greedy else torch.stack(self.probs))  # [k, V]
