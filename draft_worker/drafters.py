"""Pluggable drafters. Each turns (context, k, sampling) into a DraftProposal. No grpc here.

- NgramDrafter: prompt lookup (specmesh.core.ngram); drafts are a point mass (no probs).
- ModelDrafter: any HF causal LM with the target's tokenizer, drafting k tokens
  autoregressively. It keeps a per-sequence KV cache keyed by seq_id (LRU) and reuses the longest
  prefix it shares with the context it is sent, so it is stateless to the caller: any worker can
  serve any round, a miss just recomputes. Concurrent proposals are batched into one forward
  per drafting step.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specmesh.core.ngram import propose_ngram
from specmesh.core.sampling import make_generator, sample, warp_logits
from specmesh.core.types import DraftProposal, SamplingParams
from specmesh.engine.batcher import Batcher
from specmesh.engine.kv import SequenceKV, batched_step, new_sequence_kv


@dataclass(frozen=True)
class ProposeJob:
    seq_id: str
    context: list[int]
    k: int
    params: SamplingParams
    round: int


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, job: ProposeJob, timeout: float | None = None) -> DraftProposal:
        return DraftProposal(propose_ngram(job.context, job.k, self.min_n, self.max_n), None)

    def release(self, seq_id: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Cached:
    kv: SequenceKV
    tokens: list[int]  # the tokens whose KV the cache holds, in order


def _draft_seed(seed: int, seq_id: str, round_: int) -> int:
    digest = hashlib.sha256(f"{seed}:{seq_id}:{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class ModelDrafter:
    name = "draft_model"

    def __init__(self, model, max_batch_size: int, cache_max_sequences: int, max_queue: int = 1024):
        self.model = model
        self.vocab_size = model.config.get_text_config().vocab_size
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._cache_max = cache_max_sequences
        self._lock = threading.Lock()
        self.batcher = Batcher(self._run_batch, max_batch_size, max_queue=max_queue, name="draft-batcher")

    def propose(self, job: ProposeJob, timeout: float | None = None) -> DraftProposal:
        if job.k == 0:
            return DraftProposal([], None)
        return self.batcher.submit("propose", job).result(timeout)

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._cache.pop(seq_id, None)

    def cached_sequences(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self.batcher.close()

    # ------------------------------------------------------------------ model thread
    def _take_cache(self, job: ProposeJob) -> tuple[_Cached, list[int]]:
        """The sequence's cache cut to the longest prefix shared with the context, and the
        context tokens still to forward (at least one, so its logits exist)."""
        with self._lock:
            entry = self._cache.pop(job.seq_id, None)
        if entry is None:
            entry = _Cached(new_sequence_kv(self.model, capacity=len(job.context) + 64), [])
        shared = 0
        limit = min(len(entry.tokens), len(job.context) - 1)
        while shared < limit and entry.tokens[shared] == job.context[shared]:
            shared += 1
        entry.kv.truncate(shared)
        entry.tokens = entry.tokens[:shared]
        return entry, job.context[shared:]

    def _store(self, seq_id: str, entry: _Cached) -> None:
        with self._lock:
            self._cache[seq_id] = entry
            while len(self._cache) > self._cache_max:
                self._cache.popitem(last=False)

    def _run_batch(self, kind: str, jobs: list[ProposeJob]) -> list[DraftProposal]:
        entries, pending = zip(*(self._take_cache(j) for j in jobs))
        gens = [make_generator(_draft_seed(j.params.seed, j.seq_id, j.round)) if j.params.seed is not None
                else None for j in jobs]
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        inputs = list(pending)
        active = list(range(len(jobs)))
        while active:
            outs = batched_step(self.model, [entries[b].kv for b in active], [inputs[b] for b in active])
            for b, out in zip(active, outs):
                entries[b].kv.append(out.new_keys, out.new_values)
                entries[b].tokens += inputs[b]
                q = warp_logits(out.logits[-1:], jobs[b].params)  # [1, V] draft distribution
                token = int(sample(q, gens[b])[0]) if not jobs[b].params.greedy else int(q[0].argmax())
                drafts[b].append(token)
                probs[b].append(q[0])
                inputs[b] = [token]
            active = [b for b in active if len(drafts[b]) < jobs[b].k]
        results = []
        for b, job in enumerate(jobs):
            self._store(job.seq_id, entries[b])
            # greedy drafts are a point mass: no distribution to send
            p = None if job.params.greedy else torch.stack(probs[b])  # [k, V]
            results.append(DraftProposal(drafts[b], p))
        return results
