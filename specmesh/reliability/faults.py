"""The faults part: a scaled mesh (two replicas of every tier, workers in the registry on the
suite's Redis) under steady load (load.py: 16 streaming clients, T=0, the client's retry over both
gateways); one fault at a time, each in its own episode:

    steady load 3 s -> the fault -> its repair (a supervisor's restart after a kill, SIGCONT after
    a stop, Redis started again) -> until the faulted part serves again -> settle -> pause the load
    and let every call in flight end -> count that episode's calls.

Per episode: calls, OK (and how many needed the client's retry), failed by final status, hung
(waited out the deadline or never returned: must be 0), outputs that differ from the fault-free
reference at T=0 (must be 0), the seconds until the part served again (`back_s`) and until the last
call that failed or needed the client's retry ended (`disruption_s`)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

from specmesh.reliability import weights
from specmesh.reliability.load import Load


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | stop | redis | weights
    child: str = ""  # the launcher's child name (replica 0 of a tier: its service name)

    @property
    def label(self) -> str:
        return {"kill": f"kill -9 {self.child}", "stop": f"SIGSTOP {self.child}", "redis": "Redis stopped, restarted",
                "weights": f"{self.child} restarted with changed weights"}[self.kind]


TIERS = ("draft_worker", "target_worker", "coordinator", "gateway")
KILLS = tuple(Fault("kill", t) for t in TIERS)
FULL = KILLS + tuple(Fault("stop", t) for t in TIERS) + (Fault("redis"), Fault("weights", "target_worker_1"))


def _child(mesh, name: str):
    return next(c for c in mesh.launcher.children if c.name == name)


def _registered(mesh, child) -> bool:
    from specmesh.registry.store import Registry, RegistryError

    tier = {"target_worker": "target", "draft_worker": "draft"}.get(child.service)
    if tier is None:
        return True
    reg = Registry(mesh.redis.url, mesh.cfg.registry.namespace, mesh.cfg.registry.ttl_s)
    try:
        return any(r.address == child.address and r.pid == child.proc.pid for r in reg.list(tier))
    except RegistryError:
        return False
    finally:
        reg.close()


def wait_back(mesh, name: str, timeout_s: float = 300.0) -> float:
    """Until child `name` is SERVING (and, for a worker, registered); the monotonic time then."""
    from specmesh.health_probe import check_serving

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        child = _child(mesh, name)
        if child.proc.poll() is None and check_serving(child.address, tls=child.probe) and _registered(mesh, child):
            return time.monotonic()
        time.sleep(0.25)
    raise RuntimeError(f"{name} did not serve again within {timeout_s:.0f} s")


def _kill_and_restart(mesh, name: str, restart_after_s: float) -> None:
    child = _child(mesh, name)
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    time.sleep(restart_after_s)  # a supervisor's restart delay
    mesh.launcher.respawn(name)


def _stop_and_continue(mesh, name: str, hold_s: float) -> None:
    pid = _child(mesh, name).proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def inject(mesh, fault: Fault, hold_s: float, notes: list) -> str:
    """Apply the fault and its repair; the child whose return ends the episode ("" = Redis)."""
    if fault.kind == "kill":
        _kill_and_restart(mesh, fault.child, 1.0)
    elif fault.kind == "stop":
        _stop_and_continue(mesh, fault.child, hold_s)
    elif fault.kind == "redis":
        mesh.redis.stop()
        time.sleep(hold_s)
        mesh.redis.start()
    else:
        notes += weights.changed_weights_episode(mesh, fault.child, hold_s)
    return fault.child


def episode_result(calls, reference: dict, t0: float, back: float) -> dict:
    failed = Counter(c.status for c in calls if c.status != "OK")
    first_errors = Counter(e for c in calls for e in c.errors)
    differs = [c for c in calls if c.status == "OK" and c.tokens != reference[c.prompt]]
    last_fail = max((c.end for c in calls if c.status != "OK" or c.attempts > 1), default=t0)
    return {"calls": len(calls), "ok": sum(c.status == "OK" for c in calls),
            "ok_after_retry": sum(c.status == "OK" and c.attempts > 1 for c in calls),
            "failed": dict(failed), "attempt_errors": dict(first_errors), "hung": sum(c.hung for c in calls),
            "differs": len(differs), "differs_examples": [(c.prompt, c.method) for c in differs[:5]],
            "back_s": round(back - t0, 1), "disruption_s": round(max(0.0, last_fail - t0), 1)}


def run_faults(mesh, faults=FULL, clients: int = 16, max_tokens: int = 24, hold_s: float = 20.0,
               settle_s: float = 10.0, deadline_s: float = 60.0, log=print) -> dict:
    gateways = mesh.launcher.addresses["gateway"]
    load = Load(mesh, gateways, clients, max_tokens, deadline_s)
    reference = load.reference()
    episodes = []
    for fault in faults:
        begin = time.monotonic()
        load.start()
        time.sleep(3.0)
        notes: list = []
        t0 = time.monotonic()
        name = inject(mesh, fault, hold_s, notes)
        back = wait_back(mesh, name) if name else _redis_back(mesh)
        time.sleep(settle_s)
        never = load.stop()
        calls = [c for c in load.snapshot() if c.start >= begin]
        res = {"fault": fault.label, "kind": fault.kind, **episode_result(calls, reference, t0, back),
               "never_returned": never, "notes": notes}
        res["hung"] += never
        episodes.append(res)
        log(f"faults: {fault.label}: {res['ok']}/{res['calls']} OK ({res['ok_after_retry']} after a retry), "
            f"failed {res['failed']}, hung {res['hung']}, differs {res['differs']}, back in {res['back_s']} s")
    return {"clients": clients, "max_tokens": max_tokens, "hold_s": hold_s, "episodes": episodes}


def _redis_back(mesh) -> float:
    import redis

    client = redis.Redis.from_url(mesh.redis.url)
    try:
        while not client.ping():
            time.sleep(0.1)
    finally:
        client.close()
    return time.monotonic()


def to_json(res: dict, after: dict) -> dict:
    eps = res["episodes"]
    res = dict(res, after=after)
    res["passed"] = bool(eps) and all(e["hung"] == 0 and e["differs"] == 0 for e in eps) and \
        all(v == "ok" for v in after.values())
    return res


def markdown(res: dict, run_line: str = "") -> str:
    lines = ([run_line, ""] if run_line else []) + [f"{res['clients']} streaming clients (T=0, {res['max_tokens']} tokens, the client's retry over both "
             f"gateways), one fault at a time; a stop lasts {res['hold_s']:.0f} s.", "",
             "| fault | calls | OK | OK after the client's retry | failed (final status) | errors seen by attempts "
             "| hung | differ from fault-free | back in (s) | disrupted for (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in res["episodes"]:
        fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"  # noqa: E731
        lines.append(f"| {e['fault']} | {e['calls']} | {e['ok']} | {e['ok_after_retry']} | {fmt(e['failed'])} | "
                     f"{fmt(e['attempt_errors'])} | {e['hung']} | {e['differs']} | {e['back_s']} | {e['disruption_s']} |")
    notes = [f"- {e['fault']}: {n}" for e in res["episodes"] for n in e["notes"]]
    after = ", ".join(f"{k}: {v}" for k, v in res.get("after", {}).items())
    return "\n".join(lines + ([""] + notes if notes else []) + ["", f"After the faults: {after}."])
