"""Plain value types shared by the core, the engines and the servicers (never protobuf)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = no top-k truncation
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        from specmesh.errors import InvalidArgument

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", "must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidArgument("top_k", "must be >= 0 (0 disables top-k)")


@dataclass(frozen=True)
class DraftProposal:
    """k drafted tokens and, when the drafter has them, the distributions they were drawn from."""

    token_ids: list[int]
    # probs: [k, V] float32, row i = draft distribution q_i that token_ids[i] was sampled from
    # (after the same temperature/top-k/top-p warping the target uses). None = point mass on
    # each drafted token (n-gram lookup, or greedy drafting).
    probs: torch.Tensor | None = None
    # A draft tree (specmesh.core.tree): parents[i] = index of token_ids[i]'s parent among the
    # drafts, -1 = the pending token. None = a chain (token_ids in order).
    parents: list[int] | None = None
    # The drafter needs target features it does not hold (block drafter cache miss): resend.
    missing_features: bool = False
    # A block drafter's candidate table (log q [D, W], token ids [D, W]; row d = draft position
    # d + 1, descending): asked for instead of a tree; trees are built from it (core/tree.py).
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None
    # A chain's p_i: the proposer's estimate that drafts 1..i are all accepted (non-increasing;
    # VerifyRequest.draft_accept). Set: the target may verify a prefix only (core/trim.py).
    accept: list[float] | None = None

    def head(self, n: int) -> DraftProposal:
        """A chain's first n drafts (probabilities and p_i with them)."""
        return DraftProposal(self.token_ids[:n], None if self.probs is None else self.probs[:n], None,
                             accept=None if self.accept is None else self.accept[:n])


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of verifying k drafted tokens: n accepted drafts, then one target token.

    tokens = drafts[:n] + [t], where t is *recovered* (sampled from the residual at the first
    rejection) when n < k, or the *bonus* token (sampled from the target at position k) when n == k.
    """

    accepted: int
    tokens: list[int]
    bonus: bool
    # [accepted + 1, F] bfloat16: target features of the slots committed to the KV cache
    # ([pending, accepted drafts...]), when the round asked for them (FeatureSpec)
    features: torch.Tensor | None = None
    cost: dict | None = None  # the target's verify cost model (core/costmodel.VerifyCost.as_dict)
    # a burst (several target steps in one call): (drafted, accepted) of each step, the first
    # step's draft first; None: one step (accepted / bonus above are the first step's)
    steps: list[tuple[int, int]] | None = None
    trimmed: int = 0  # drafts the target left unverified, every step of the call (core/trim.py)

    @property
    def recovered(self) -> bool:
        return not self.bonus


@dataclass(frozen=True)
class MatchBucket:
    """A burst step's draft after a match of at least min_match tokens (NgramBurst.by_match): up to k
    tokens, their a_j rates (empty: never trimmed)."""

    min_match: int
    k: int
    rates: tuple[float, ...] = ()


@dataclass(frozen=True)
class NgramBurst:
    """A burst's prompt lookup in the target (VerifyRequest.ngram_burst): after its first step, each
    step drafts up to k tokens that followed the latest earlier copy of the sequence's last
    min_n..max_n tokens (core/ngram.py), verified in that step; the burst emits at most max_tokens."""

    k: int
    min_n: int
    max_n: int
    max_tokens: int
    # a_j: the rate at which a step's draft position j is accepted once j - 1 was (the round
    # policy's, the steps' p_i from them); empty: the target never trims the steps' drafts
    rates: tuple[float, ...] = ()
    # by the match's length, ascending min_match: a step whose lookup matched n tokens drafts as
    # the last bucket with min_match <= n says (none: no draft); empty: k and rates for every match
    by_match: tuple[MatchBucket, ...] = ()

    def for_match(self, n: int) -> tuple[int, tuple[float, ...]]:
        """(k, rates) of a step whose lookup matched n tokens (capped at k)."""
        if not self.by_match:
            return self.k, self.rates
        fit = [b for b in self.by_match if b.min_match <= n]
        return (min(self.k, fit[-1].k), fit[-1].rates) if fit else (0, ())


@dataclass(frozen=True)
class FeatureSpec:
    """Target features to return for the block drafter: per committed position, the outputs of
    these 0-based decoder layers concatenated (the last layer's after the final norm, as HF's
    hidden_states[-1]); prefill returns only the last max_rows prompt positions (0 = all)."""

    layers: tuple[int, ...]
    max_rows: int = 0


@dataclass(frozen=True)
class PrefillOutcome:
    token: int  # the first output token
    features: torch.Tensor | None = None  # [rows, F] bfloat16, the prompt's last rows (FeatureSpec)
    cost: dict | None = None  # the target's verify cost model (core/costmodel.VerifyCost.as_dict)


@dataclass
class SpecStats:
    """Per-request speculation statistics. mean acceptance length = tokens emitted per target step."""

    rounds: int = 0  # target verify steps (prefill not counted)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens produced by verify rounds (accepted + one target token each)
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = rounds accepting draft i
    drafted_per_position: list[int] = field(default_factory=list)  # [i] = rounds drafting position i
    draft_failures: int = 0  # rounds that fell back to k=0 because the draft tier failed
    tier_down_rounds: int = 0  # rounds run with k=0 unasked: no draft worker could be asked (all down)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    feature_bytes: int = 0  # target features received from the target tier (block drafter)
    draft_feature_bytes: int = 0  # target features sent on to the draft tier
    chosen_k: dict[int, int] = field(default_factory=dict)  # k drafted per round (a tree: nodes) -> rounds
    predraft_hits: int = 0  # overlap: rounds whose draft was drafted during the previous verify
    # overlap: pre-drafts dropped (the previous round was not accepted in full); block tables:
    # drafting rounds without a tail, which waited for a table made then
    predraft_misses: int = 0
    draft_wait_s: float = 0.0  # overlap: time rounds waited for a pre-draft (a table) still in flight
    draft_waits: int = 0  # block tables: drafting rounds that waited for their draft (> 2 ms)
    trimmed_tokens: int = 0  # drafts the target left unverified for its batch's sake (core/trim.py)
    graft_rounds: int = 0  # block trees that carried an n-gram graft (coordinator.ngram_graft)
    graft_tokens: int = 0  # tokens accepted past the drafter's own nodes, on the graft

    def record(self, drafted: int, accepted: int, emitted: int, positions: int | None = None) -> None:
        """positions: draft positions (depths) of the round; default = drafted (a chain). A draft
        tree of N nodes and depth D counts N drafted tokens over D positions."""
        positions = drafted if positions is None else positions
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        grow = max(positions, len(self.drafted_per_position))
        self.drafted_per_position += [0] * (grow - len(self.drafted_per_position))
        self.accepted_per_position += [0] * (grow - len(self.accepted_per_position))
        for i in range(positions):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    method: str  # "off" or a drafter name
    k: int  # speculative tokens per round (0 = off)
    stop: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() by which the request must end
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tree_budget: int = 0  # draft-tree nodes per round (block drafter); 0 = chain
    k_max: int = 0  # > 0: k is chosen per round for goodput in 0..k_max (speculative.k_policy goodput)
