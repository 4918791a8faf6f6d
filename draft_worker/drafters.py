"""Pluggable drafters. Each turns (context, k, sampling) into a DraftProposal. No grpc here.

- NgramDrafter: prompt lookup (specmesh.core.ngram); drafts are a point mass (no probs).
- ModelDrafter (draft_worker/model_drafter.py): any HF causal LM with the target's tokenizer,
  drafting k tokens autoregressively, concurrent proposals batched per drafting step.
- BlockDrafter: the trained block drafter (specmesh.drafters.block), conditioned on the target's
  features of the last context_window committed positions; one forward drafts up to
  block_size - 1 tokens (a chain), or their per-position top-k grown into a draft tree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from draft_worker.sequence_lru import SequenceLru
from specmesh.core.features import FeatureWindow
from specmesh.core.ngram import propose_ngram
from specmesh.core.sampling import make_generator, sample, warp_logits
from specmesh.core.tree import build_tree
from specmesh.core.types import DraftProposal, SamplingParams
from specmesh.engine import cpu_gemm, onednn
from specmesh.engine.batcher import Batcher
from specmesh.errors import InvalidArgument


@dataclass(frozen=True)
class ProposeJob:
    seq_id: str
    context: list[int]
    k: int
    params: SamplingParams
    round: int
    # block drafter: target features [r, F] of committed positions [len(context)-1-r, len(context)-1)
    features: torch.Tensor | None = None
    features_complete: bool = False  # the sender's whole window: replace, do not append
    tree_budget: int = 0  # > 0: a draft tree of at most this many nodes (block drafter)
    alive: Callable[[], bool] = lambda: True  # False once the caller cancelled: stop drafting for it
    stop_at: float = 0.0  # > 0: time.monotonic() by which to answer with what is drafted (model drafter)
    candidates: bool = False  # block with tree_budget > 0: the candidate table of every position, no tree


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


def _wait(future, timeout: float | None):
    """The job's result; a job its caller gave up on before it ran never runs (the batcher skips it)."""
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise


class _BatchedDrafter:
    """What the model-backed drafters share: a batcher (model thread) and a per-sequence cache."""

    _cache: SequenceLru
    batcher: Batcher

    def release(self, seq_id: str) -> None:
        self._cache.release(seq_id)

    def cached_sequences(self) -> int:
        return len(self._cache)

    def cached_tokens(self) -> int:
        return self._cache.tokens()

    def close(self) -> None:
        self.batcher.close()


def _draft_seed(seed: int, round_: int) -> int:
    """The draft's sampling stream for one round: a function of the request's seed and the round
    only (not the per-request sequence id), so a repeated seeded request drafts the same tokens."""
    digest = hashlib.sha256(f"{seed}:{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class BlockDrafter(_BatchedDrafter):
    """Drafts with a block drafter model (specmesh.drafters.block.BlockDrafter) from target
    features. Keeps each sequence's newest context_window rows keyed by seq_id (LRU), as the
    drafter's context rows (its layers' keys and values of each position, projected on arrival):
    each round brings only the feature rows committed since the last; rows that do not extend what is held
    (worker restarted, evicted, or another worker served the last round) are a miss
    (DraftProposal.missing_features) and the coordinator resends its whole window."""

    name = "block"
    drafts_candidates = True  # all block positions in one forward: a candidate table (ProposeJob.candidates)

    def __init__(self, model, max_batch_size: int, cache_max_sequences: int, max_queue: int = 1024,
                 cpu_kernel: bool = False, head_ids: torch.Tensor | None = None):
        self.model = model  # a specmesh.drafters.block.BlockDrafter, eval
        # head_ids: [K] the token ids the head scores (the most frequent K, sorted; None: all):
        # drafts are only ever those tokens (specmesh/training/vocab.py)
        self._head_tokens = None if head_ids is None else head_ids.cpu()  # [K]: a head row's token id
        head = model.lm_head if head_ids is None else _rows_of(model.lm_head, head_ids)
        # cpu_kernel: a float32 LM head (the target's, shared) from packed weights where the kernel
        # runs; in bf16 every linear and the head from oneDNN-prepacked copies where available
        # (a 2-core AMX Xeon: a candidate table 12.9 -> 8.6 ms; +1x the drafter's and head's bytes)
        self.cpu_kernel = bool(cpu_kernel) and cpu_gemm.pack_linear(head)
        self.prepacked = bool(cpu_kernel) and onednn.prepack_children(model) > 0
        self.head = onednn.PrepackedLinear.of(head) if self.prepacked and onednn.usable(head) else head
        cfg = model.cfg
        self.window, self.max_k, self.vocab_size = cfg.context_window, cfg.block_size - 1, cfg.vocab_size
        self.feature_size = cfg.feature_size
        self._cache = SequenceLru(cache_max_sequences)  # seq_id -> FeatureWindow
        self.batcher = Batcher(self._run_batch, max_batch_size, max_queue=max_queue, name="block-batcher")

    def propose(self, job: ProposeJob, timeout: float | None = None) -> DraftProposal:
        window = self._window(job)
        if window is None:
            return DraftProposal([], None, missing_features=True)
        if job.k == 0 and not job.candidates:
            return DraftProposal([], None)
        return _wait(self.batcher.submit("propose", (job, window)), timeout)

    def _window(self, job: ProposeJob) -> FeatureWindow | None:
        """Merge the job's rows into the sequence's window; None = a miss. The rows end at the
        last committed position: end = len(context) - 1."""
        end, rows = len(job.context) - 1, job.features
        if rows is not None and (rows.dim() != 2 or rows.shape[1] != self.feature_size or rows.shape[0] > end):
            raise InvalidArgument("features", f"must be [rows <= {end}, {self.feature_size}], "
                                              f"got {tuple(rows.shape)}")
        if rows is not None:
            rows = self._context_rows(rows)
        win = self._cache.take(job.seq_id)
        if rows is not None and job.features_complete:  # the sender's whole window: replace
            win = FeatureWindow(self.window, rows, end)
        elif rows is not None and (win is None or not win.extend(rows, end)):  # a delta with nothing to extend
            win = None
        if win is None or win.end != end or len(win) == 0:
            return None
        self._cache.put(job.seq_id, win)
        return win

    @torch.inference_mode()
    def _context_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Feature rows [r, F] -> the drafter's context rows [r, L * 2 Hkv D] (every layer's keys
        and values of those positions), which the window keeps: each row depends on its own
        features only, so a round projects just the rows it adds, not the whole window (the
        projection of 64 rows was ~1 of a table's 8 ms on a 2-core Zen 4)."""
        return self.model.context_rows(rows.to(self.model.lm_head.weight.device))

    # ------------------------------------------------------------------ model thread
    @torch.inference_mode()
    def _run_batch(self, kind: str, items: list[tuple[ProposeJob, FeatureWindow]]) -> list[DraftProposal]:
        ctx, valid = zip(*(w.padded() for _, w in items))  # each [C, L * 2 Hkv D] context rows, [C] bool (host)
        device = self.model.lm_head.weight.device
        last = torch.tensor([job.context[-1] for job, _ in items], device=device)  # [N]: x_T, last context token
        # hidden: [N, B, H]; block position i >= 1 predicts x_{T+i}
        hidden = self.model.hidden_from_rows(self.model.block_ids(last), torch.stack(ctx).to(device),
                                             torch.stack(valid).to(device))
        head = self.head
        depths = [self.max_k if job.candidates else min(job.k, self.max_k) for job, _ in items]
        rows = torch.cat([hidden[b, 1: 1 + d] for b, d in enumerate(depths)])  # [sum depths, H]
        # every job's rows through the head at once: one read of its weights (the kernel where packed)
        rows = rows.to(head.weight.dtype)
        logits = (cpu_gemm.apply(head, rows) if self.cpu_kernel else head(rows)).float().cpu()  # [sum depths, K]
        out = []
        for (job, _), part in zip(items, logits.split(depths)):  # part: [depth, K]
            out.append(self._candidates(job, part) if job.candidates
                       else self._tree(job, part) if job.tree_budget > 0 else self._chain(job, part))
        return out

    def _tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the head's K rows -> token ids (the same where the head scores every token)."""
        return idx if self._head_tokens is None else self._head_tokens[idx]

    def _chain(self, job: ProposeJob, logits: torch.Tensor) -> DraftProposal:
        """logits: [k, K]. Greedy: argmax per position (a point mass). T > 0: x_i ~ q_i, the warped
        per-position distribution, returned over the whole vocabulary (0 outside the head's
        tokens) so rejection sampling stays lossless (q_i does not depend on the earlier drafts,
        which is allowed: q_i(. | x_<i) = q_i)."""
        if job.params.greedy:
            return DraftProposal(self._tokens(logits.argmax(dim=-1)).tolist(), None)
        q = warp_logits(logits, job.params)  # [k, K]
        gen = make_generator(_draft_seed(job.params.seed, job.round)) \
            if job.params.seed is not None else None
        drafts = self._tokens(sample(q, gen))
        if self._head_tokens is not None:  # [k, V]
            q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self._head_tokens, q)
        return DraftProposal(drafts.tolist(), q)

    def _top(self, job: ProposeJob, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [D, K] -> (log q, tokens), each [D, W]: every position's top W = tree_budget by
        log q (warped at T > 0, so cut tokens never appear), descending."""
        logq = torch.log_softmax(logits, dim=-1) if job.params.greedy else warp_logits(logits, job.params).log()
        logq, idx = logq.topk(min(job.tree_budget, logq.shape[-1]), dim=-1)
        return logq, self._tokens(idx)

    def _tree(self, job: ProposeJob, logits: torch.Tensor) -> DraftProposal:
        """logits: [D, K] -> a best-first tree over the per-position top-k (specmesh.core.tree).
        The target walks it without draft probabilities (lossless for any tree)."""
        tree = build_tree(*self._top(job, logits), job.tree_budget)
        return DraftProposal(tree.tokens, None, tree.parents)

    def _candidates(self, job: ProposeJob, logits: torch.Tensor) -> DraftProposal:
        """logits: [block_size - 1, K] -> the table _tree builds from, for every block position."""
        return DraftProposal([], None, candidates=self._top(job, logits))


def _rows_of(head: nn.Linear, ids: torch.Tensor) -> nn.Linear:
    """A linear of head's rows `ids` only (a copy: +K / V of the head's bytes)."""
    sub = nn.Linear(head.in_features, ids.shape[0], bias=False, dtype=head.weight.dtype, device=head.weight.device)
    rows = head.weight.detach().index_select(0, ids.to(head.weight.device))  # [K, H]
    sub.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
    return sub
