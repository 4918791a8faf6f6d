"""The soak part: N concurrent streaming clients (each with its own connection and API key) send a
mix of requests for a while, some cancelled mid-stream on purpose. Nothing may be lost: every
request not cancelled ends with a finish_reason and its usage matches the tokens streamed; the
only errors allowed are retryable refusals (UNAVAILABLE, RESOURCE_EXHAUSTED), retried. Each mesh
process's RSS, open fds and threads must stay flat after warm-up, and at the end the target holds
no sequence and no KV."""

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


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / retried / lost:<why>
    lost: list = field(default_factory=list)  # the first few lost requests, described
    samples: dict = field(default_factory=dict)  # process -> [(t, rss_kb, fds, threads)]
    end_state: str = ""


def _request(rng: random.Random) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=rng.choice(PROMPTS), max_tokens=rng.choice((8, 16, 32, 64)))
    if rng.random() < 0.4:
        req.sampling.temperature, req.sampling.seed = rng.choice((0.7, 1.0)), rng.randrange(1 << 30)
    req.speculation.method = rng.choice(("", "ngram", "draft_model", "off"))
    if rng.random() < 0.2:
        req.stop.append(rng.choice((".", "\n")))
    return req


def _one(stub, req, metadata, cancel_after: int | None) -> str:
    """completed | cancelled | retried | lost:<why> for one streamed request."""
    call = stub.GenerateStream(req, timeout=120, metadata=metadata)
    tokens, chunks, last = 0, 0, None
    try:
        for chunk in call:
            chunks += 1
            tokens += len(chunk.token_ids)
            last = chunk
            if cancel_after is not None and chunks >= cancel_after:
                call.cancel()
                return "cancelled"
    except grpc.RpcError as err:
        code = err.code().name
        return "retried" if code in RETRYABLE else f"lost:{code}: {err.details()}"[:200]
    if last is None or not last.finish_reason:
        return "lost:no finish_reason"
    if last.usage.completion_tokens != tokens:
        return f"lost:usage says {last.usage.completion_tokens} tokens, {tokens} streamed"
    return "completed"


def _client(mesh, key: str, seed: int, stop_at: float, result: SoakResult, lock, cancel_share: float) -> None:
    rng = random.Random(seed)
    with mesh.channel("gateway", own_connection=True) as ch:
        stub = pb_grpc.GatewayStub(ch)
        while time.monotonic() < stop_at:
            req = _request(rng)
            cancel_after = rng.randint(1, 3) if rng.random() < cancel_share else None
            outcome = _one(stub, req, mesh.metadata(key), cancel_after)
            with lock:
                result.outcomes[outcome.split(":")[0]] += 1
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


def _sampler(pids: dict, stop: threading.Event, result: SoakResult, every_s: float) -> None:
    t0 = time.monotonic()
    while not stop.wait(every_s):
        for name, pid in pids.items():
            result.samples.setdefault(name, []).append((round(time.monotonic() - t0, 1), *process_sample(pid)))


def run_soak(mesh, clients: int, seconds: float, seed: int = 1, cancel_share: float = 0.15,
             sample_every_s: float = 5.0) -> SoakResult:
    """mesh.add_key(name) makes an API key per client (each client: its own key and connection)."""
    keys = [mesh.add_key(f"soak-{i}") for i in range(clients)]
    result, lock, stop = SoakResult(), threading.Lock(), threading.Event()
    sampler = threading.Thread(target=_sampler, args=(mesh.pids(), stop, result, sample_every_s), daemon=True)
    sampler.start()
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=_client, args=(mesh, key, seed * 1000 + i, stop_at, result, lock,
                                                      cancel_share)) for i, key in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    deadline = time.monotonic() + 30
    held = live_sequences(mesh)
    while held != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
        held = live_sequences(mesh)
    result.end_state = "ok" if held == (0, 0) else f"target still holds {held[0]} sequences ({held[1]} B)"
    return result


# RSS may grow this much after warm-up (allocator caches settle); fds and threads hardly at all
RSS_SLACK = (0.10, 64 * 1024)  # share, kB: the larger of the two
FD_SLACK, THREAD_SLACK = 8, 8


def flatness(samples: list, warmup_share: float = 0.3) -> dict:
    """After warm-up: the median of its first three samples against the median of the last three."""
    if len(samples) < 6:
        return {"verdict": f"too few samples ({len(samples)})", "flat": False}
    steady = samples[int(len(samples) * warmup_share):]
    if len(steady) < 6:
        steady = samples[-6:]

    def med(rows, i):
        return sorted(r[i] for r in rows)[len(rows) // 2]

    start, end = steady[:3], steady[-3:]
    rss0, rss1 = med(start, 1), med(end, 1)
    fd0, fd1, th0, th1 = med(start, 2), med(end, 2), med(start, 3), med(end, 3)
    flat = (rss1 - rss0 <= max(RSS_SLACK[0] * rss0, RSS_SLACK[1]) and fd1 - fd0 <= FD_SLACK
            and th1 - th0 <= THREAD_SLACK)
    return {"rss_mb": [round(rss0 / 1024), round(rss1 / 1024)], "fds": [fd0, fd1], "threads": [th0, th1],
            "flat": flat}


def to_json(result: SoakResult, clients: int, seconds: float) -> dict:
    processes = {name: flatness(rows) for name, rows in result.samples.items()}
    lost = sum(n for k, n in result.outcomes.items() if k.startswith("lost"))
    return {"clients": clients, "seconds": seconds, "outcomes": dict(result.outcomes), "lost": lost,
            "lost_examples": result.lost, "processes": processes, "end_state": result.end_state,
            "passed": lost == 0 and result.outcomes["completed"] > 0 and result.end_state == "ok"
            and all(p["flat"] for p in processes.values())}


def markdown(res: dict) -> str:
    out = res["outcomes"]
    lines = [f"{res['clients']} streaming clients for {res['seconds']:.0f} s: {out.get('completed', 0)} requests "
             f"completed, {out.get('cancelled', 0)} cancelled by their client on purpose, {out.get('retried', 0)} "
             f"refused as retryable and retried, **{res['lost']} lost**. At the end: {res['end_state']}.", "",
             "| process | RSS after warm-up -> end (MB) | open fds | threads | flat |", "| --- | --- | --- | --- | --- |"]
    for name, p in res["processes"].items():
        if "rss_mb" in p:
            lines.append(f"| {name} | {p['rss_mb'][0]} -> {p['rss_mb'][1]} | {p['fds'][0]} -> {p['fds'][1]} | "
                         f"{p['threads'][0]} -> {p['threads'][1]} | {'yes' if p['flat'] else 'NO'} |")
        else:
            lines.append(f"| {name} | {p['verdict']} | | | NO |")
    return "\n".join(lines)
