"""Drafting overlapped with verification (coordinator.overlap_drafting): while the target verifies
round r, the draft tier already drafts round r+1. No grpc here; the loop passes a propose callable.

The guess: round r is accepted in full, and the target's own next token (the bonus) is the one the
drafter itself drafts after d_k. So round r asks the drafter for k+1 tokens, verifies the first k,
and, before its Verify, sends Propose(context + d_1..d_k + d_{k+1}) for round r+1. When round r's
outcome is exactly d_1..d_k + [d_{k+1}], the context the pre-draft was drafted from is the real
context, so it is a draft like any other (lossless at any temperature: its tokens and, at T>0,
its probabilities were computed from exactly that context); round r+1 uses it at once, or waits
for the rest of it. Any other outcome is a miss: the pre-draft is dropped and round r+1 drafts
just in time, as without overlap (vLLM RFC #42109's speculation cache; PEARL's post-verify).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from typing import Callable

from specmesh.core.types import DraftProposal


class Predrafter:
    def __init__(self, propose: Callable[[list[int], int, int], DraftProposal], executor: Executor):
        self._propose = propose  # (context, k, round) -> DraftProposal, may raise
        self._executor = executor
        self._pending: tuple[list[int], int, Future] | None = None  # (guessed context, k, future)
        self.hits = self.misses = 0
        self.wait_s = 0.0  # time rounds spent waiting for a pre-draft that was a hit

    def start(self, context: list[int], draft: DraftProposal, guess: int, k: int, round_: int) -> None:
        """Round r drafted `draft` (its chain) and the bonus guess; draft round r+1 (k+1 tokens)."""
        guessed = context + list(draft.token_ids) + [guess]
        self._pending = (guessed, k, self._executor.submit(self._propose, guessed, k + 1, round_))

    def take(self, context: list[int], timeout: float) -> DraftProposal | None:
        """The pre-draft for this context (waiting for it if still in flight), or None on a miss
        (no pre-draft, another context, or it failed: the caller drafts now)."""
        if self._pending is None:
            return None
        guessed, _, future = self._pending
        self._pending = None
        if guessed != context:
            self.misses += 1
            future.cancel()
            return None
        t0 = time.monotonic()
        try:
            draft = future.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - a failed pre-draft is a miss; the round drafts now
            self.misses += 1
            return None
        self.hits += 1
        self.wait_s += time.monotonic() - t0
        return draft

    def drop(self) -> None:
        if self._pending is not None:
            self._pending[2].cancel()
            self._pending = None
