"""Run fuzz cases against a mesh and classify every answer.

A step fails when it answers UNKNOWN / INTERNAL / DATA_LOSS, when it runs into its deadline
(a hang) unless the case asked for a tiny deadline, or when the case names the statuses it
accepts and the answer is another one (a limit not enforced, garbage accepted). After the cases:
every process must still run, the target must hold no sequence, and a greedy generation must
equal the one made before the fuzz.

The mesh is anything with channel(service, own_connection=True), metadata(key_name) and dead()
(specmesh.reliability.harness.SuiteMesh).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from specmesh.reliability.cases import DOCUMENTED, NEVER, Case, Step
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

HANG_GRACE_S = 5.0
KNOWN_GOOD = pb.GenerateRequest(prompt="List the days of the week.", max_tokens=24)


@dataclass
class Outcome:
    case: Case
    statuses: list = field(default_factory=list)
    failure: str = ""  # empty: passed
    seconds: float = 0.0


@dataclass
class FuzzResult:
    seed: int
    outcomes: list = field(default_factory=list)
    post: dict = field(default_factory=dict)  # name -> "ok" | what went wrong
    seconds: float = 0.0

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failure]

    def histogram(self, part: str | None = None) -> Counter:
        return Counter(s for o in self.outcomes if part in (None, o.case.part) for s in o.statuses)

    def passed(self) -> bool:
        return not self.failures() and all(v == "ok" for v in self.post.values())


def _auth(mesh, who: str) -> list[tuple[str, str]]:
    if who in ("user", "other", "admin"):
        return mesh.metadata(who)
    return {"none": [], "bad": [("authorization", "Bearer sk-not-a-key")],
            "huge": [("authorization", "Bearer " + "k" * 20000)]}[who]


def call(channel: grpc.Channel, step: Step, metadata, deadline_s: float) -> tuple[str, str]:
    """(status name, details) of one raw call; a stream is read to its end."""
    timeout = step.deadline_s or deadline_s
    md = list(metadata) + list(step.metadata)
    try:
        if step.stream:
            for _ in channel.unary_stream(step.method)(step.payload, timeout=timeout, metadata=md):
                pass
        else:
            channel.unary_unary(step.method)(step.payload, timeout=timeout, metadata=md)
        return "OK", ""
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        return (code.name if code is not None else "UNKNOWN"), str(err.details() if hasattr(err, "details") else err)


def judge(step: Step, status: str, seconds: float, deadline_s: float) -> str:
    """'' when the answer is acceptable, else why not."""
    if status in NEVER:
        return f"{status} from our code"
    if seconds > (step.deadline_s or deadline_s) + HANG_GRACE_S:
        return f"hang: {seconds:.1f}s"
    if step.expect is not None:
        return "" if status in step.expect else f"{status}, expected {'|'.join(sorted(step.expect))}"
    if status == "DEADLINE_EXCEEDED":
        return f"hang: deadline exceeded after {seconds:.1f}s"
    return "" if status in DOCUMENTED else f"undocumented status {status}"


class _Channels:
    """Each worker thread's own channels (its own TCP connections), all closed by close()."""

    def __init__(self, mesh):
        self.mesh, self.local, self.opened = mesh, threading.local(), []
        self._lock = threading.Lock()

    def get(self, service: str) -> grpc.Channel:
        mine = self.local.__dict__.setdefault("by_service", {})
        if service not in mine:
            mine[service] = self.mesh.channel(service, own_connection=True)
            with self._lock:
                self.opened.append(mine[service])
        return mine[service]

    def close(self) -> None:
        for channel in self.opened:
            channel.close()


def run_case(mesh, case: Case, channels: _Channels, deadline_s: float) -> Outcome:
    out = Outcome(case)
    t0 = time.monotonic()
    channel = channels.get(case.service)
    for i, step in enumerate(case.steps):
        started = time.monotonic()
        status, details = call(channel, step, _auth(mesh, step.auth), deadline_s)
        out.statuses.append(status)
        why = judge(step, status, time.monotonic() - started, deadline_s)
        if why and not out.failure:
            out.failure = f"step {i} {step.method}: {why} ({details[:200]})"
    out.seconds = time.monotonic() - t0
    return out


def generate_tokens(mesh, request=KNOWN_GOOD, timeout: float = 120.0) -> list[int]:
    with mesh.channel("gateway", own_connection=True) as ch:
        resp = pb_grpc.GatewayStub(ch).Generate(request, timeout=timeout, metadata=mesh.metadata("user"))
    return list(resp.token_ids)


def live_sequences(mesh) -> tuple[int, int]:
    """(sequences, KV bytes) held, summed over every target replica."""
    seqs = kv = 0
    launcher = getattr(mesh, "launcher", None)  # the in-process mesh (CI slice) has one target, no launcher
    for address in (launcher.addresses.get("target_worker") if launcher else None) or [mesh.address("target_worker")]:
        with mesh.channel_to(address, own_connection=True, public=False) as ch:
            st = pb_grpc.TargetWorkerStub(ch).Status(pb.WorkerStatusRequest(), timeout=10)
        seqs, kv = seqs + st.live_sequences, kv + st.kv_cache_bytes
    return seqs, kv


def reset_speculation(mesh) -> None:
    with mesh.channel("gateway", own_connection=True) as ch:
        apb_grpc.AdminStub(ch).SetSpeculation(apb.SetSpeculationRequest(reset=True), timeout=30,
                                              metadata=mesh.metadata("admin"))


def post_checks(mesh, baseline: list[int], settle_s: float = 20.0) -> dict:
    post = {"processes": "ok"}
    dead = mesh.dead()
    if dead:
        post["processes"] = "died: " + ", ".join(dead)
        return post
    deadline = time.monotonic() + settle_s
    held = live_sequences(mesh)
    while held != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
        held = live_sequences(mesh)
    post["sequences_released"] = "ok" if held == (0, 0) else f"target still holds {held[0]} sequences ({held[1]} B)"
    reset_speculation(mesh)
    after = generate_tokens(mesh)
    post["generation_unchanged"] = "ok" if after == baseline else f"greedy output changed: {baseline} -> {after}"
    return post


def run_cases(mesh, cases: list[Case], concurrency: int = 4, deadline_s: float = 60.0,
              progress=None, time_limit_s: float | None = None) -> list[Outcome]:
    """time_limit_s: cases not started by then are not run (each recorded as a failure)."""
    channels = _Channels(mesh)
    done = []
    stop_at = None if time_limit_s is None else time.monotonic() + time_limit_s

    def one(case: Case) -> Outcome:
        if stop_at is not None and time.monotonic() > stop_at:
            return Outcome(case, failure="not run: the time limit was reached")
        return run_case(mesh, case, channels, deadline_s)

    try:
        with ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz") as pool:
            for outcome in pool.map(one, cases):
                done.append(outcome)
                if progress is not None:
                    progress(outcome, len(done))
    finally:
        channels.close()
    return done
