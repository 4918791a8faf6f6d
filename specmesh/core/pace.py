"""Whether drafting pays, as measured: wall seconds per emitted token of the rounds that drafted
and of the rounds that did not (k = 0: the target alone, its decode bursts included), per drafter,
process-wide (every request's rounds fold in). No grpc here.

The goodput rule (core/goodput.py) prices a round by the target's forward alone. What it does not
see shows up here: a Propose's hop and the coordinator's work per round, the several tokens a
k = 0 round's burst buys per call, a draft tier sharing the target's CPU. Measured on a 2-core
Zen 5 at concurrency 4 (session 23): block-tree rounds emitted 1.14 tokens in ~62 ms of wall time
while the target alone's bursts took ~44 ms a token, so goodput, pricing only the forwards,
drafted in 86% of rounds at 0.80x AR.

RoundPolicy asks `gate` after goodput chose k > 0: where drafting's seconds per token exceed the
target alone's by more than `margin`, the round runs with k = 0, except every `every`-th round of
that drafter, which drafts anyway (the request then drafts PROBE_ROUNDS rounds in a row) so its
arm keeps being measured. Each probe that finds the drafter still losing doubles the wait for the
next one, up to `every_max` rounds; the first round that finds it paying resets it to `every`. A
fixed 1-in-16 probe of 3 rounds drafted in ~17% of a losing drafter's rounds: at concurrency 4 on
a 2-core Zen 4 the block tree drafted in 17-22% of its rounds at ~1.03 tokens a step, 0.85-0.94x
AR (sessions 47-48), where the gate meant it to run as the target alone. And every `every`-th
drafting round runs with k = 0 while the target alone's arm has fewer than `min_rounds` rounds or
has not been measured for `stale` rounds of the drafter, so both arms stay current as load moves.
A request's drafting round right after a round that did not draft (its first, or after k = 0) is
not counted: it waits for a draft that steady drafting has ready (the block drafter's table), so
counting it biased a probe against drafting (a first version turned the block tree off at
concurrency 1, where it paid 1.10x).

A chain round's drafting seconds per token are priced at the request's own expected tokens (its
goodput rates at the chosen k) over the drafting arm's seconds a round, not at the tokens all
requests' drafting rounds emitted: the arm is process-wide, so a drafter that loses on most text
lost on every request. Seen on a 2-core Zen 4 once the one-token step got 1.4x cheaper (session
40): the population's n-gram rounds lost to the target alone, the gate held k = 0 in 76% of
rounds at concurrency 1, and extraction prompts, 2.5 tokens a round before, read 1.15x AR
instead of 2.13x. Trees keep the arm's tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PROBE_ROUNDS = 3  # a probe of a losing drafter: this many drafting rounds in a row (the first uncounted)


@dataclass
class Arm:
    seconds: float = 0.0  # EMA of a round's wall seconds
    tokens: float = 0.0  # EMA of a round's emitted tokens
    rounds: int = 0
    last: int = 0  # the drafter's round count at this arm's latest round

    @property
    def s_per_token(self) -> float:  # a ratio of means: a 1-token and a 4-token round weigh by tokens
        return self.seconds / self.tokens if self.tokens > 0 else 0.0


class PaceBook:
    def __init__(self, alpha: float = 0.1, min_rounds: int = 8, margin: float = 0.05, every: int = 16,
                 stale: int = 128, every_max: int = 128):
        self.alpha, self.min_rounds, self.margin, self.every, self.stale = alpha, min_rounds, margin, every, stale
        self.every_max = max(every, every_max)
        self._arms: dict[tuple[str, bool], Arm] = {}
        self._ticks: dict[str, int] = {}
        self._probe_at: dict[str, tuple[int, int]] = {}  # drafter -> (tick of its next probe, wait after it)
        self._lock = threading.Lock()

    def observe(self, method: str, drafted: bool, seconds: float, tokens: int) -> None:
        """Fold one round in: did it draft, its wall seconds, the tokens it emitted."""
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            arm = self._arms.setdefault((method, drafted), Arm())
            if arm.rounds == 0:
                arm.seconds, arm.tokens = seconds, float(tokens)
            else:
                arm.seconds += self.alpha * (seconds - arm.seconds)
                arm.tokens += self.alpha * (tokens - arm.tokens)
            arm.rounds += 1
            arm.last = self._ticks.get(method, 0)

    def loses(self, method: str, expected: float | None = None) -> bool:
        """Whether drafting with `method` emits slower than the target alone, both arms measured:
        at the drafting rounds' measured tokens, or at `expected` tokens a drafting round."""
        with self._lock:
            return self._loses(method, expected)

    def _loses(self, method: str, expected: float | None = None) -> bool:
        draft, alone = self._arms.get((method, True)), self._arms.get((method, False))
        if draft is None or alone is None or min(draft.rounds, alone.rounds) < self.min_rounds:
            return False
        per_token = draft.seconds / expected if expected else draft.s_per_token
        return per_token > alone.s_per_token * (1.0 + self.margin)

    def gate(self, method: str, k: int, expected: float | None = None) -> int:
        """This round's k once goodput chose k (> 0: drafting): 0 where drafting loses (but every
        `every`-th round drafts), or to measure the target alone (module docstring)."""
        return self.decide(method, k, expected)[0]

    def decide(self, method: str, k: int, expected: float | None = None) -> tuple[int, bool]:
        """(gate's k, whether that k > 0 is the probe of a drafter that loses), under one lock.
        expected: the round's expected tokens (the request's own rates), where known."""
        if k <= 0:
            return k, False
        with self._lock:
            tick = self._ticks.get(method, 0) + 1
            self._ticks[method] = tick
            probe = tick % self.every == 0
            if self._loses(method, expected):
                due, wait = self._probe_at.get(method, (-(-tick // self.every) * self.every, self.every))
                if tick < due:
                    self._probe_at[method] = (due, wait)
                    return 0, False
                wait = min(2 * wait, self.every_max)  # still losing: the next probe waits twice as long
                self._probe_at[method] = (tick + wait, wait)
                return k, True
            self._probe_at.pop(method, None)  # paying (or unmeasured): probes every `every` again
            alone = self._arms.get((method, False))
            unknown = alone is None or alone.rounds < self.min_rounds or tick - alone.last > self.stale
            return (0 if probe and unknown else k), False

    def snapshot(self) -> dict:
        """{drafter: {'draft' | 'alone': (ms per token, rounds)}} for reports."""
        with self._lock:
            out: dict[str, dict] = {}
            for (method, drafted), arm in self._arms.items():
                out.setdefault(method, {})["draft" if drafted else "alone"] = (round(arm.s_per_token * 1e3, 2),
                                                                              arm.rounds)
            return out
