"""The per-request speculative decoding loop. Talks to the tiers only through two small
interfaces (TargetClient, DraftPool), so it knows nothing of protobuf.

    prefill(prompt) -> t_1                         (target; first token, TTFT)
    repeat until eos / max_tokens / stop string:
        d_1..d_k = propose(context)                (draft tier; on failure k = 0)
        n, tokens = verify(d_1..d_k)               (target; tokens = d_1..d_n + one target token)
        stream tokens
    release(seq)                                    (always: finish, cancel or error)
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Protocol

from specmesh.core.types import DraftProposal, GenerationRequest, SamplingParams, SpecStats, VerifyOutcome
from specmesh.errors import Cancelled, DeadlineExceeded, SpecmeshError
from specmesh.tokenization import OutputAssembler

log = logging.getLogger(__name__)


class TargetClient(Protocol):
    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float) -> int: ...
    def verify(self, seq_id: str, draft: DraftProposal, timeout: float) -> VerifyOutcome: ...
    def release(self, seq_id: str) -> None: ...


class DraftPool(Protocol):
    def propose(self, seq_id: str, context: list[int], k: int, method: str, params: SamplingParams,
                round_: int, timeout: float) -> DraftProposal: ...
    def release(self, seq_id: str) -> None: ...


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class Generation:
    """Drives one request; iterate `run()` for chunks. `stats` is filled as it goes."""

    def __init__(self, req: GenerationRequest, target: TargetClient, drafts: DraftPool | None,
                 tokenizer, eos_token_ids: set[int], draft_timeout_s: float, is_active=lambda: True):
        self.req, self.target, self.drafts = req, target, drafts
        self.out = OutputAssembler(tokenizer, req.max_tokens, eos_token_ids, tuple(req.stop))
        self.draft_timeout_s = draft_timeout_s
        self.is_active = is_active
        self.stats = SpecStats()
        self.seq_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        self.method = req.method if req.k > 0 and drafts is not None else "off"
        self.ttft_s: float | None = None

    def _remaining(self) -> float:
        if self.req.deadline is None:
            return 3600.0
        left = self.req.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded while generating")
        return left

    def run(self) -> Iterator[Chunk]:
        started = time.monotonic()
        try:
            first = self.target.prefill(self.seq_id, self.req.prompt_ids, self.req.params, self._remaining())
            self.ttft_s = time.monotonic() - started
            yield self._emit([first])
            while not self.out.finish_reason:
                if not self.is_active():
                    raise Cancelled("client went away")
                yield self._emit(self._round())
        finally:
            self._release()

    def _emit(self, tokens: list[int]) -> Chunk:
        ids, text = self.out.add(tokens)
        return Chunk(ids, text, self.out.finish_reason)

    def _k_this_round(self) -> int:
        # a round emits up to k+1 tokens: never draft past max_tokens
        left = self.req.max_tokens - len(self.out.token_ids)
        return max(0, min(self.req.k, left - 1))

    def _round(self) -> list[int]:
        draft = self._draft(self._k_this_round())
        t0 = time.monotonic()
        outcome = self.target.verify(self.seq_id, draft, self._remaining())
        self.stats.verify_time_s += time.monotonic() - t0
        self.stats.record(len(draft.token_ids), outcome.accepted, len(outcome.tokens))
        return outcome.tokens

    def _draft(self, k: int) -> DraftProposal:
        if k == 0 or self.method == "off":
            return DraftProposal([], None)
        context = self.req.prompt_ids + self.out.token_ids
        t0 = time.monotonic()
        try:
            timeout = min(self.draft_timeout_s, self._remaining())
            draft = self.drafts.propose(self.seq_id, context, k, self.method, self.req.params,
                                        self.stats.rounds, timeout)
            return DraftProposal(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])
        except DeadlineExceeded:
            if self.req.deadline is not None and time.monotonic() >= self.req.deadline:
                raise
            return self._draft_failed("draft timed out")
        except SpecmeshError as exc:
            return self._draft_failed(str(exc))
        finally:
            self.stats.draft_time_s += time.monotonic() - t0

    def _draft_failed(self, why: str) -> DraftProposal:
        # a draft failure never fails the request: this round runs with k = 0 (target alone)
        self.stats.draft_failures += 1
        if self.stats.draft_failures == 1:
            log.warning("request %s: draft tier failed (%s); continuing with the target alone",
                        self.req.request_id, why)
        return DraftProposal([], None)

    def _release(self) -> None:
        try:
            self.target.release(self.seq_id)
        except SpecmeshError as exc:
            log.warning("release of %s failed: %s (the worker reclaims it when idle)", self.seq_id, exc)
        if self.drafts is not None and self.method != "off":
            self.drafts.release(self.seq_id)
