"""Benchmark metric math on request timelines. Pure functions: no I/O, no clocks, no grpc.

A request's timeline is what the client saw: `chunk_times[i]` seconds after the request was
sent, a stream message arrived carrying `chunk_tokens[i]` tokens; `latency` is the time until
the stream closed. One message may carry several tokens (all accepted in one verify round).

    TTFT  = chunk_times[0]                                 (first message with a token)
    E2E   = latency
    TPOT  = (latency - TTFT) / (output_len - 1)            (requests with >= 2 output tokens)
    ITL   = chunk_times[i] - chunk_times[i-1], i >= 1      (one gap per message arrival)

ITL follows vLLM's serving benchmark: one inter-token latency per *stream message* arrival,
whatever the number of tokens in it, so a multi-token message contributes one (longer) gap, not
n gaps. `itl_token_gaps` gives the per-token variant (the message's gap for its first token,
then n-1 zero gaps), reported as `itl_token_ms`; its mean equals TPOT's ratio of sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request produced, as seen by the client."""

    prompt_id: str
    category: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # s since send, messages with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each such message
    token_ids: list[int] = field(default_factory=list)
    latency: float | None = None  # s from send until the stream closed
    error: str | None = None
    finish_reason: str = ""
    spec: dict | None = None  # the final message's SpecStats as a dict (mesh runs)
    round_tokens: list[int] | None = None  # tokens emitted per target forward (in-process peers)

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def output_len(self) -> int:
        return len(self.token_ids)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict:
    """{"p50", "p90", "p99", "mean", "n"} of values * scale (None entries when empty)."""
    out = {f"p{q}": _scaled(percentile(values, q), scale) for q in PERCENTILES}
    out["mean"] = _scaled(sum(values) / len(values), scale) if values else None
    out["n"] = len(values)
    return out


def _scaled(v: float | None, scale: float) -> float | None:
    return None if v is None else v * scale


def ttft(rec: RequestRecord) -> float | None:
    return rec.chunk_times[0] if rec.chunk_times else None


def tpot(rec: RequestRecord) -> float | None:
    first = ttft(rec)
    if rec.latency is None or first is None or rec.output_len < 2:
        return None
    return (rec.latency - first) / (rec.output_len - 1)


def itl_chunk_gaps(rec: RequestRecord) -> list[float]:
    """vLLM-style ITL: one gap per stream message after the first."""
    t = rec.chunk_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def itl_token_gaps(rec: RequestRecord) -> list[float]:
    """Per-token ITL: a message of n tokens adds its arrival gap once, then n - 1 zero gaps."""
    gaps: list[float] = [0.0] * max(0, (rec.chunk_tokens[0] if rec.chunk_tokens else 0) - 1)
    for gap, n in zip(itl_chunk_gaps(rec), rec.chunk_tokens[1:]):
        gaps.append(gap)
        gaps.extend([0.0] * max(0, n - 1))
    return gaps


def spec_acceptance_counts(spec: dict) -> list[int]:
    """Rounds by number of accepted drafts, from the chain stats: counts[n] = rounds accepting
    exactly n drafts. Chain verification accepts a prefix, so accepted_per_position[i] is the
    number of rounds accepting more than i drafts."""
    rounds = int(spec.get("rounds", 0))
    acc = [int(a) for a in spec.get("accepted_per_position", [])]
    if rounds <= 0:
        return []
    at_least = [rounds] + acc  # at_least[n] = rounds accepting >= n drafts
    counts = [at_least[n] - at_least[n + 1] for n in range(len(acc))] + [at_least[-1]]
    while len(counts) > 1 and counts[-1] == 0:
        counts.pop()
    return counts


def acceptance_histogram(records: list[RequestRecord]) -> dict[str, int]:
    """{acceptance length (tokens per target step) as a string: rounds}; {} without rounds."""
    hist: dict[int, int] = {}
    for rec in records:
        if rec.spec:
            for n, c in enumerate(spec_acceptance_counts(rec.spec)):
                hist[n + 1] = hist.get(n + 1, 0) + c
        elif rec.round_tokens:
            for n in rec.round_tokens:
                hist[n] = hist.get(n, 0) + 1
    return {str(k): v for k, v in sorted(hist.items()) if v}


def chosen_k_histogram(records: list[RequestRecord]) -> dict[str, int]:
    """{k drafted in a round: rounds} over the requests (goodput k: 0 = speculation paused)."""
    hist: dict[int, int] = {}
    for rec in records:
        for k, n in ((rec.spec or {}).get("chosen_k") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(n)
    return {str(k): v for k, v in sorted(hist.items()) if v}


def _emitted_and_rounds(rec: RequestRecord) -> tuple[float, int]:
    if rec.spec and rec.spec.get("rounds"):
        rounds = int(rec.spec["rounds"])
        return float(rec.spec.get("mean_acceptance_length", 0.0)) * rounds, rounds
    if rec.round_tokens:
        return float(sum(rec.round_tokens)), len(rec.round_tokens)
    return 0.0, 0


def mean_acceptance_length(records: list[RequestRecord]) -> float | None:
    """Tokens emitted per target verify step over all rounds of all requests (None: no rounds)."""
    emitted = rounds = 0.0
    for rec in records:
        e, r = _emitted_and_rounds(rec)
        emitted, rounds = emitted + e, rounds + r
    return emitted / rounds if rounds else None


def acceptance_by_category(records: list[RequestRecord]) -> dict[str, float]:
    groups: dict[str, list[RequestRecord]] = {}
    for rec in records:
        if rec.category:
            groups.setdefault(rec.category, []).append(rec)
    out = {c: mean_acceptance_length(rs) for c, rs in sorted(groups.items())}
    return {c: v for c, v in out.items() if v is not None}


def acceptance_per_position(records: list[RequestRecord]) -> list[float]:
    """[i]: fraction of rounds that drafted position i in which draft i was accepted."""
    acc: list[int] = []
    drafted: list[int] = []
    for rec in records:
        if not rec.spec:
            continue
        for name, tot in (("accepted_per_position", acc), ("drafted_per_position", drafted)):
            vals = rec.spec.get(name, [])
            tot.extend([0] * (len(vals) - len(tot)))
            for i, v in enumerate(vals):
                tot[i] += int(v)
    return [a / d for a, d in zip(acc, drafted) if d > 0]


def time_fractions(records: list[RequestRecord]) -> dict | None:
    """Share of summed E2E latency spent drafting / verifying (coordinator-measured)."""
    total = sum(r.latency for r in records if r.latency and r.spec)
    if not total:
        return None
    draft = sum(float(r.spec.get("draft_time_s", 0.0)) for r in records if r.spec and r.latency)
    verify = sum(float(r.spec.get("verify_time_s", 0.0)) for r in records if r.spec and r.latency)
    return {"drafting": draft / total, "verifying": verify / total,
            "draft_share_of_draft_plus_verify": draft / (draft + verify) if draft + verify else None}


def predrafts(records: list[RequestRecord]) -> dict | None:
    """Drafting overlapped with verification: pre-drafts that hit / were dropped, and the seconds
    a round spent waiting for a hit still in flight, per round; None where nothing pre-drafted."""
    spec = [r.spec for r in records if r.spec]
    hits = sum(int(s.get("predraft_hits", 0)) for s in spec)
    misses = sum(int(s.get("predraft_misses", 0)) for s in spec)
    if not hits + misses:
        return None
    rounds = sum(int(s.get("rounds", 0)) for s in spec)
    return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses),
            "wait_s_per_round": sum(float(s.get("draft_wait_s", 0.0)) for s in spec) / max(1, rounds),
            # block candidate tables: share of all rounds that waited for their draft
            "waited_share": sum(int(s.get("draft_waits", 0)) for s in spec) / max(1, rounds)}


def trimmed_share(records: list[RequestRecord]) -> float | None:
    """Share of the drafted tokens the target left unverified beside others (core/trim.py):
    trimmed / (verified drafts + trimmed); None where nothing was drafted."""
    spec = [r.spec for r in records if r.spec]
    cut = sum(int(s.get("trimmed_tokens", 0)) for s in spec)
    drafted = sum(int(s.get("drafted_tokens", 0)) for s in spec) + cut
    return cut / drafted if drafted else None


def grafts(records: list[RequestRecord]) -> dict | None:
    """Block trees carrying an n-gram graft (coordinator.ngram_graft): their share of the
    rounds and the tokens accepted on the graft past the drafter's own nodes; None where none."""
    spec = [r.spec for r in records if r.spec]
    grafted = sum(int(s.get("graft_rounds", 0)) for s in spec)
    if not grafted:
        return None
    rounds = sum(int(s.get("rounds", 0)) for s in spec)
    return {"rounds": grafted, "share": grafted / max(1, rounds), "tokens": sum(int(s.get("graft_tokens", 0)) for s in spec)}


def aggregate(records: list[RequestRecord], wall_s: float) -> dict:
    """The metrics of one run: throughput over wall_s, latency percentiles (ms), acceptance."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    spec_like = any(r.spec or r.round_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": summarize([v for v in map(ttft, ok) if v is not None], 1e3),
        "tpot_ms": summarize([v for v in map(tpot, ok) if v is not None], 1e3),
        "itl_ms": summarize([g for r in ok for g in itl_chunk_gaps(r)], 1e3),
        "itl_token_ms": summarize([g for r in ok for g in itl_token_gaps(r)], 1e3),
        "e2e_ms": summarize([r.latency for r in ok], 1e3),
        "mean_acceptance_length": mean_acceptance_length(ok) if spec_like else None,
        "acceptance_length_histogram": acceptance_histogram(ok),
        "chosen_k_histogram": chosen_k_histogram(ok),
        "acceptance_per_position": acceptance_per_position(ok),
        "acceptance_by_category": acceptance_by_category(ok) if spec_like else {},
        "time_fraction": time_fractions(ok),
        "predraft": predrafts(ok),
        "trimmed_share": trimmed_share(ok),
        "graft": grafts(ok),
        "draft_failures": sum(int(r.spec.get("draft_failures", 0)) for r in ok if r.spec),
        "tier_down_rounds": sum(int(r.spec.get("tier_down_rounds", 0)) for r in ok if r.spec),
    }


def speedup(tokens_per_s: float, baseline_tokens_per_s: float | None) -> float | None:
    if not baseline_tokens_per_s:
        return None
    return tokens_per_s / baseline_tokens_per_s


def break_even(speedups: dict[float, float | None]) -> float | None:
    """The first level (ascending) where speculation no longer beats AR (speedup <= 1)."""
    for level in sorted(speedups):
        s = speedups[level]
        if s is not None and s <= 1.0:
            return level
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
