"""Drafting overlapped with verification (coordinator.overlap_drafting): while the target verifies
round r, the draft tier already drafts round r+1. No grpc here; the loop passes a propose callable.

A pre-draft is n tokens t_1..t_n drafted after a base context G, the guess of where round r+1
starts: round r's context + its drafts d_1..d_k (+ the drafter's own next token, when round r's
Propose drafted one more than it verified). When round r ends, the real context C either extends
G by tokens that t_1..t_m spell out (the target accepted every draft and its own token is the one
the drafter predicted; with k = 0 that is the whole test) or it does not. A hit hands the rest,
t_{m+1}..t_n, to round r+1 as its draft: they and, at T>0, their probabilities were computed from
exactly C, so they are a draft like any other (lossless at any temperature). Anything else is a
miss: the pre-draft is dropped and round r+1 drafts just in time, as without overlap (vLLM RFC
#42109's speculation cache; PEARL's post-verify).

Rounds that draft nothing pre-draft too (G = the context, n = 1 + k): the draft tier keeps up with
the sequence on its own cores, and once the target's token matches the drafter's, the next round
has a draft at no wait, so a drafter that fits the text is measured and used again.

Beside live others (concurrency > 1) rounds verify only what a pre-draft already holds, so that no
sequence falls out of the target's batch waiting for a draft; there a pre-draft has a time budget
instead of a length: the draft tier answers with what it drafted when the target's forward is
expected to end (ProposeRequest.budget_s; RoundPolicy.predraft_budget_s).
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import Executor, Future
from typing import Callable

from specmesh.core.types import DraftProposal


class Predrafter:
    def __init__(self, propose: Callable[[list[int], int, int, list, float], DraftProposal], executor: Executor):
        # (context, n, round, calls, budget_s) -> DraftProposal, may raise; it appends its in-flight
        # RPC to calls, which a miss cancels, so a stale pre-draft stops drafting and frees the draft
        # tier; budget_s > 0: up to n tokens, those drafted within budget_s
        self._propose = propose
        self._executor = executor
        self._pending: tuple[list[int], Future, list] | None = None  # (base G, future of t_1..t_n, calls)
        self.hits = self.misses = 0  # pre-drafts used / dropped unused (a request's last is neither)
        self.wait_s = 0.0  # time rounds spent waiting for a pre-draft that was a hit

    def start(self, base: list[int], n: int, round_: int, budget_s: float = 0.0) -> None:
        """Draft n tokens after `base` for round `round_` (budget_s > 0: as many of them as the draft
        tier drafts within budget_s, at least one). Replaces any pre-draft still pending,
        except one in flight from this very base (a round without a draft that did not wait for
        it): it is already drafting what this one would."""
        if self._pending is not None and self._pending[0] == list(base) and not self._pending[1].done():
            return
        if self._pending is not None:  # never taken: a round without a draft moved past it
            self._miss(self._pending)
            self._pending = None
        base, calls = list(base), []
        # in the request's context (trace parent, request id, canary arm), like its other calls
        run = contextvars.copy_context().run
        self._pending = (base, self._executor.submit(run, self._propose, base, n, round_, calls, budget_s), calls)

    def ready(self, context: list[int]) -> int:
        """Draft tokens a finished pre-draft holds past `context` now (0: none, in flight, or a miss);
        drafted while the target worked, they cost the next round no wait."""
        if self._pending is None or not self._pending[1].done() or self._pending[1].exception() is not None:
            return 0
        base, future, _ = self._pending
        m = _past(base, context, future.result().token_ids)
        return 0 if m is None else len(future.result().token_ids) - m

    def in_flight(self, context: list[int]) -> bool:
        """A pre-draft still drafting from a base `context` extends: it may yet hit."""
        if self._pending is None or self._pending[1].done():
            return False
        return _extends(context, self._pending[0])

    def take(self, context: list[int], timeout: float) -> DraftProposal | None:
        """The pre-draft's tokens past `context` (waiting for it if still in flight), or None on a
        miss (none, a context that does not extend its base by its own tokens, too few tokens
        left, or it failed: the caller drafts now)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        base, future, _ = pending
        if not _extends(context, base):
            return self._miss(pending)  # not worth waiting for: no tokens can make it a hit
        t0 = time.monotonic()
        try:
            draft = future.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - a failed pre-draft is a miss; the round drafts now
            return self._miss(pending)
        m = _past(base, context, draft.token_ids)
        if m is None:
            return self._miss(pending)
        self.hits += 1
        self.wait_s += time.monotonic() - t0
        return DraftProposal(list(draft.token_ids[m:]), None if draft.probs is None else draft.probs[m:])

    def _miss(self, pending: tuple) -> None:
        self.misses += 1
        _cancel(pending)
        return None

    def drop(self) -> None:
        if self._pending is not None:
            _cancel(self._pending)
            self._pending = None


def _past(base: list[int], context: list[int], tokens) -> int | None:
    """m when `context` is `base` + the first m of `tokens` and some tokens are left after them
    (a hit: tokens[m:] is the next round's draft); None otherwise (a miss)."""
    m = len(context) - len(base)
    if len(tokens) <= m or not _extends(context, base) or list(tokens[:m]) != context[len(base):]:
        return None
    return m


def _extends(context: list[int], base: list[int]) -> bool:
    """context is base followed by zero or more tokens."""
    return len(context) >= len(base) and context[: len(base)] == base


def _cancel(pending: tuple) -> None:
    """Stop a pre-draft: not started yet, it never runs; in flight, its RPC is cancelled."""
    _, future, calls = pending
    future.cancel()
    for call in list(calls):
        call.cancel()
