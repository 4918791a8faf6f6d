"""The soak part: N concurrent streaming clients (each with its own connection and API key) send a
mix of requests for a while: 10% cancelled by their client mid-stream, 5% sent with a deadline
that expires mid-generation. Nothing may be lost: every other request ends with a finish_reason
and its usage matches the tokens streamed; a deadline request ends DEADLINE_EXCEEDED (or
finishes); the only other errors allowed are retryable refusals (UNAVAILABLE, RESOURCE_EXHAUSTED),
retried. Each mesh process's RSS, open fds and threads must stay flat after warm-up, and at the
end the target holds no sequence and no KV, and the draft tier keeps no sequence."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specmesh.reliability.runner import live_sequences
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

PROMPTS = ("Count from 1 to 40.", "Write a haiku about the sea.", "Explain what a hash map is.",
           "List five fruits and their colours.", "Write a Python function that reverses a string.",
           "Tell a very short story about a robot.")
RETRYABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
CALL_TIMEOUT_S = 120.0  # an ordinary request's deadline: reaching it is a hang (lost)
DEADLINE_TOKENS = 64  # max_tokens of a deadline request


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / deadline / retried / lost
    deadline_mid_stream: int = 0  # deadline requests that hit it after their first chunk
    lost: list = field(default_factory=list)  # the first few lost requests, described
    samples: dict = field(default_factory=dict)  # process -> [(t, rss_kb, fds, threads)]
    draft_cache: list = field(default_factory=list)  # [(t, sequences, KV slots)] the draft tier keeps
    end_state: str = ""


class Pace:
    """A client's running estimate of its requests' time to the first chunk and per token after it;
    a deadline request's timeout is drawn from it, to expire part-way through its 64 tokens."""

    def __init__(self):
        self.ttft, self.per_token = 2.0, 0.1

    def learn(self, ttft: float, seconds: float, tokens: int) -> None:
        if tokens > 1:
            self.ttft = 0.7 * self.ttft + 0.3 * ttft
            self.per_token = 0.7 * self.per_token + 0.3 * (seconds - ttft) / (tokens - 1)

    def deadline(self, rng: random.Random) -> float:
        return 1.5 * self.ttft + self.per_token * DEADLINE_TOKENS * rng.uniform(0.2, 0.6)


def _request(rng: random.Random, deadline: bool = False) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=rng.choice(PROMPTS), max_tokens=rng.choice((8, 16, 32, 64)))
    if rng.random() < 0.4:
        req.sampling.temperature, req.sampling.seed = rng.choice((0.7, 1.0)), rng.randrange(1 << 30)
    req.speculation.method = rng.choice(("", "ngram", "draft_model", "off"))
    if deadline:
        req.max_tokens = DEADLINE_TOKENS  # long enough to be cut by its deadline
    elif rng.random() < 0.2:
        req.stop.append(rng.choice((".", "\n")))
    return req


def _one(stub, req, metadata, cancel_after: int | None, timeout: float | None, pace: Pace) -> str:
    """completed | cancelled | deadline[:before its first chunk] | retried | lost:<why> for one
    streamed request; timeout: a deadline request's own (None: CALL_TIMEOUT_S, never expected)."""
    t0 = time.monotonic()
    call = stub.GenerateStream(req, timeout=timeout or CALL_TIMEOUT_S, metadata=metadata)
    tokens, chunks, last, ttft = 0, 0, None, 0.0
    try:
        for chunk in call:
            ttft = ttft or time.monotonic() - t0
            chunks += 1
            tokens += len(chunk.token_ids)
            last = chunk
            if cancel_after is not None and chunks >= cancel_after:
                call.cancel()
                return "cancelled"
    except grpc.RpcError as err:
        code = err.code().name
        if code == "DEADLINE_EXCEEDED" and timeout is not None:
            return "deadline" if chunks else "deadline:before its first chunk"
        return "retried" if code in RETRYABLE else f"lost:{code}: {err.details()}"[:200]
    if last is None or not last.finish_reason:
        return "lost:no finish_reason"
    if last.usage.completion_tokens != tokens:
        return f"lost:usage says {last.usage.completion_tokens} tokens, {tokens} streamed"
    pace.learn(ttft, time.monotonic() - t0, tokens)
    return "completed"


@dataclass(frozen=True)
class Mix:
    cancel_share: float  # cancelled by their client after 1 to 3 chunks
    deadline_share: float  # sent with a deadline that expires mid-generation

    def draw(self, rng: random.Random, pace: Pace) -> tuple[pb.GenerateRequest, int | None, float | None]:
        """(request, cancel after this many chunks, its own timeout)."""
        r = rng.random()
        if r < self.cancel_share:
            return _request(rng), rng.randint(1, 3), None
        if r < self.cancel_share + self.deadline_share:
            return _request(rng, deadline=True), None, pace.deadline(rng)
        return _request(rng), None, None


def _client(mesh, key: str, seed: int, stop_at: float, result: SoakResult, lock, mix: Mix) -> None:
    rng, pace = random.Random(seed), Pace()
    with mesh.channel("gateway", own_connection=True) as ch:
        stub = pb_grpc.GatewayStub(ch)
        while time.monotonic() < stop_at:
            req, cancel_after, timeout = mix.draw(rng, pace)
            outcome = _one(stub, req, mesh.metadata(key), cancel_after, timeout, pace)
            with lock:
                result.outcomes[outcome.split(":")[0]] += 1
                result.deadline_mid_stream += outcome == "deadline"
                if outcome.startswith("lost") and len(result.lost) < 20:
                    result.lost.append(f"{outcome} ({req.prompt!r}, max_tokens {req.max_tokens})")
            if outcome == "retried":
                time.sleep(0.5)


def process_sample(pid: int) -> tuple[int, int, int]:
    """(RSS in kB, open fds, threads) of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.split()
    return int(fields["VmRSS"][0]), len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"][0])


def _draft_cache(mesh) -> tuple[int, int] | None:
    """(sequences, KV slots) the draft tier keeps, when the mesh can tell (None: it cannot)."""
    read = getattr(mesh, "draft_cache", None)
    try:
        return read() if read is not None else None
    except OSError:
        return None


def _sampler(mesh, stop: threading.Event, result: SoakResult, every_s: float) -> None:
    t0, pids = time.monotonic(), mesh.pids()
    while not stop.wait(every_s):
        t = round(time.monotonic() - t0, 1)
        for name, pid in pids.items():
            result.samples.setdefault(name, []).append((t, *process_sample(pid)))
        cache = _draft_cache(mesh)
        if cache is not None:
            result.draft_cache.append((t, *cache))


def _end_state(mesh, settle_s: float = 30.0) -> str:
    """ok once the target holds no sequence and no KV and the draft tier keeps no sequence."""
    deadline = time.monotonic() + settle_s
    while True:
        held, cache = live_sequences(mesh), _draft_cache(mesh)
        if held == (0, 0) and (cache is None or cache[0] == 0):
            return "ok"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = [] if held == (0, 0) else [f"target still holds {held[0]} sequences ({held[1]} B)"]
    if cache is not None and cache[0]:
        out.append(f"draft tier still keeps {cache[0]} sequences ({cache[1]} KV slots)")
    return "; ".join(out)


def run_soak(mesh, clients: int, seconds: float, seed: int = 1, cancel_share: float = 0.10,
             deadline_share: float = 0.05, sample_every_s: float = 5.0) -> SoakResult:
    """mesh.add_key(name) makes an API key per client (each client: its own key and connection)."""
    keys = [mesh.add_key(f"soak-{i}") for i in range(clients)]
    result, lock, stop = SoakResult(), threading.Lock(), threading.Event()
    sampler = threading.Thread(target=_sampler, args=(mesh, stop, result, sample_every_s), daemon=True)
    sampler.start()
    stop_at, mix = time.monotonic() + seconds, Mix(cancel_share, deadline_share)
    threads = [threading.Thread(target=_client, args=(mesh, key, seed * 1000 + i, stop_at, result, lock, mix))
               for i, key in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    result.end_state = _end_state(mesh)
    return result


# RSS growth allowed after warm-up, as (share, kB): the larger of the two. The full run judges by
# the issue's bound (under 5%); the CI slice (45 s, in one pytest process) by a looser one, as its
# few samples after a short warm-up still see allocator caches settle. fds and threads: hardly any.
ISSUE_RSS_SLACK = (0.05, 0)
CI_RSS_SLACK = (0.10, 64 * 1024)
FD_SLACK, THREAD_SLACK = 8, 8


def _med(rows, i):
    return sorted(r[i] for r in rows)[len(rows) // 2]


def flatness(samples: list, warmup_share: float = 0.3, rss_slack: tuple = ISSUE_RSS_SLACK) -> dict:
    """After warm-up: the median of its first three samples against the median of the last three;
    RSS may grow by less than rss_slack (share, kB: the larger), fds and threads by FD/THREAD_SLACK."""
    if len(samples) < 6:
        return {"verdict": f"too few samples ({len(samples)})", "flat": False}
    steady = samples[int(len(samples) * warmup_share):]
    if len(steady) < 6:
        steady = samples[-6:]
    start, end = steady[:3], steady[-3:]
    rss0, rss1 = _med(start, 1), _med(end, 1)
    fd0, fd1, th0, th1 = _med(start, 2), _med(end, 2), _med(start, 3), _med(end, 3)
    flat = (rss1 - rss0 < max(rss_slack[0] * rss0, rss_slack[1]) and fd1 - fd0 <= FD_SLACK
            and th1 - th0 <= THREAD_SLACK)
    return {"rss_mb": [round(rss0 / 1024), round(rss1 / 1024)], "rss_growth": round((rss1 - rss0) / rss0, 4),
            "fds": [fd0, fd1], "threads": [th0, th1], "flat": flat}


def to_json(result: SoakResult, clients: int, seconds: float, rss_slack: tuple = ISSUE_RSS_SLACK) -> dict:
    processes = {name: flatness(rows, rss_slack=rss_slack) for name, rows in result.samples.items()}
    lost = sum(n for k, n in result.outcomes.items() if k.startswith("lost"))
    return {"clients": clients, "seconds": seconds, "outcomes": dict(result.outcomes), "lost": lost,
            "deadline_mid_stream": result.deadline_mid_stream, "lost_examples": result.lost,
            "rss_slack": {"share": rss_slack[0], "mb": rss_slack[1] / 1024}, "processes": processes,
            "end_state": result.end_state, "samples": result.samples, "draft_cache": result.draft_cache,
            "passed": lost == 0 and result.outcomes["completed"] > 0 and result.end_state == "ok"
            and all(p["flat"] for p in processes.values())}


def _slack_words(slack: dict) -> str:
    share = f"{slack['share']:.0%}"
    return f"under {share}" if not slack["mb"] else f"under {share} or {slack['mb']:.0f} MB"


def markdown(res: dict) -> str:
    out = res["outcomes"]
    lines = [f"{res['clients']} streaming clients for {res['seconds']:.0f} s: {out.get('completed', 0)} requests "
             f"completed, {out.get('cancelled', 0)} cancelled by their client on purpose, {out.get('deadline', 0)} "
             f"ended by their deadline ({res.get('deadline_mid_stream', 0)} of them mid-stream), "
             f"{out.get('retried', 0)} refused as retryable and retried, **{res['lost']} lost**. "
             f"At the end: {res['end_state']}. RSS growth allowed after warm-up: {_slack_words(res['rss_slack'])}.",
             "", "| process | RSS after warm-up -> end (MB) | open fds | threads | flat |",
             "| --- | --- | --- | --- | --- |"]
    for name, p in res["processes"].items():
        if "rss_mb" in p:
            lines.append(f"| {name} | {p['rss_mb'][0]} -> {p['rss_mb'][1]} ({p['rss_growth']:+.1%}) | "
                         f"{p['fds'][0]} -> {p['fds'][1]} | {p['threads'][0]} -> {p['threads'][1]} | "
                         f"{'yes' if p['flat'] else 'NO'} |")
        else:
            lines.append(f"| {name} | {p['verdict']} | | | NO |")
    return "\n".join(lines)
