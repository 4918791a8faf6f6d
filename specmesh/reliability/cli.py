"""`specmesh chaos`: the reliability suite against a mesh it starts on loopback and stops itself.

Parts (--parts, comma-separated; default all): fuzz, limits, security, soak, faults. faults runs
on a mesh of its own (two replicas of every tier, the registry in the suite's Redis), after the
others. Each part writes <out>/<part>.json; --docs refreshes the tables in
docs/reliability.md. Exit 0 only when every part passed and every mesh process is still up.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

PARTS = ("fuzz", "limits", "security", "soak", "faults")
DEFAULT_PARTS = PARTS  # the full run, one command (~35 minutes on 2 cores)


def add_commands(sub) -> None:
    p = sub.add_parser("chaos", help="reliability suite: fuzz, limits, security against a throw-away mesh")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=2000, help="public-API fuzz cases")
    p.add_argument("--internal-cases", type=int, default=500, help="internal-service fuzz cases")
    p.add_argument("--only", help="replay these cases alone, e.g. public:12,internal:3")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--deadline", type=float, default=60.0, help="per-call deadline (s); past it: a hang")
    p.add_argument("--time-limit", type=float, default=60.0, help="minutes the fuzz may run; later cases: not run")
    p.add_argument("--soak-clients", type=int, default=32, help="concurrent streaming clients of the soak")
    p.add_argument("--soak-seconds", type=float, default=600.0)
    p.add_argument("--faults", default="all", choices=("all", "kills"), help="all | kills (one kill -9 per tier: the CI slice)")
    p.add_argument("--fault-clients", type=int, default=16, help="concurrent clients during the faults")
    p.add_argument("--out", default="artifacts/chaos", help="directory for <part>.json")
    p.add_argument("--docs", help="refresh the tables in this markdown file (docs/reliability.md)")
    p.add_argument("--workdir", help="keep the mesh's config, keys, certificates and logs here")
    p.add_argument("--no-tls", action="store_true", help="plaintext mesh ports (the mTLS checks then fail)")
    p.set_defaults(fn=run)


def _parts(raw: str) -> list[str]:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"parts {', '.join(unknown) or '(none)'}: unknown (have: {', '.join(PARTS)})")
    return parts


def run_part(part: str, mesh, args, log) -> tuple[dict, str]:
    from specmesh.reliability import fuzz, limits, report, security
    from specmesh.reliability.runner import generate_tokens, post_checks
    from specmesh.tokenization import model_encoder

    if part == "fuzz":
        only = args.only.split(",") if args.only else None
        res = fuzz.to_json(fuzz.run_fuzz(mesh, mesh.cfg, args.seed, args.cases, args.internal_cases,
                                         args.concurrency, args.deadline, only, log, args.time_limit * 60))
        return res, report.fuzz_markdown(res, _run_facts(args))
    if part == "limits":
        model = fuzz.model_facts(mesh, mesh.cfg)
        res = limits.to_json(limits.public_rows(mesh, model_encoder(mesh.cfg.model)) + limits.internal_rows(mesh, model))
        return res, report.limits_markdown(res)
    if part == "faults":
        from specmesh.reliability import faults

        chosen = faults.KILLS if args.faults == "kills" else faults.FULL
        baseline = generate_tokens(mesh)
        res = faults.run_faults(mesh, chosen, clients=args.fault_clients, log=log)
        res = faults.to_json(res, post_checks(mesh, baseline, settle_s=45.0))
        facts = _run_facts(args)
        return res, faults.markdown(res, f"Run: {facts['when']} on {facts['machine']} "
                                         f"(`specmesh chaos --parts faults --faults {args.faults}`).")
    if part == "soak":
        from specmesh.reliability import soak

        res = soak.to_json(soak.run_soak(mesh, args.soak_clients, args.soak_seconds, args.seed),
                           args.soak_clients, args.soak_seconds)
        return res, soak.markdown(res)
    checks = (security.mtls_checks(mesh) + security.admin_checks(mesh) + security.text_checks(mesh, mesh.logs)
              + security.bind_checks(mesh.pids(), mesh.logs))
    res = security.to_json(checks)
    return res, report.security_markdown(res)


def _run_facts(args) -> dict:
    import os

    cmd = f"specmesh chaos --parts {args.parts} --seed {args.seed} --cases {args.cases} " \
          f"--internal-cases {args.internal_cases} --concurrency {args.concurrency}"
    return {"when": time.strftime("%Y-%m-%d"), "command": cmd,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)"}


def run(args) -> int:
    try:
        parts = _parts(args.parts)
    except ValueError as exc:
        print(f"specmesh chaos: {exc}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    passed = True
    if [p for p in parts if p != "faults"]:
        passed = _run_parts([p for p in parts if p != "faults"], args, out, log)
    if "faults" in parts:
        passed = _run_part_on("faults", start_faults_mesh(args), args, out, log) and passed
    log(f"chaos: {'PASSED' if passed else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if passed else 1


def start_faults_mesh(args):
    from specmesh.launcher import Scale
    from specmesh.reliability.harness import start_suite_mesh

    workdir = Path(args.workdir) / "faults" if args.workdir else None
    return start_suite_mesh(workdir, tls=not args.no_tls, overrides=FAULTS_OVERRIDES, scale=Scale(2, 2, 2, 2),
                            registry=True)


# the faults mesh: fast registry expiry (a dead worker leaves the coordinators' lists within ~3 s),
# a 20 s cap on one target call, abandoned sequences reclaimed after 30 s idle
FAULTS_OVERRIDES = {"registry": {"heartbeat_interval_s": 0.5, "ttl_s": 3.0, "poll_interval_s": 0.3},
                    "coordinator": {"target_call_timeout_s": 20.0},
                    "target_worker": {"cache": {"idle_timeout_s": 30.0, "reclaim_interval_s": 2.0}},
                    "gateway": {"max_streams_per_key": 16}}


def _run_part_on(part: str, mesh, args, out: Path, log) -> bool:
    from specmesh.reliability import report

    try:
        started = time.monotonic()
        res, markdown = run_part(part, mesh, args, log)
        res["seconds"] = round(time.monotonic() - started, 1)
        dead = mesh.dead()
        res["processes_after"] = "all up" if not dead else "died: " + ", ".join(dead)
        ok = res["passed"] and not dead
        (out / f"{part}.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"chaos: {part} {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f}s -> {out / (part + '.json')}")
        if args.docs:
            report.update_doc(Path(args.docs), part, markdown)
        return ok
    finally:
        mesh.stop()


def _run_parts(parts, args, out: Path, log) -> bool:
    from specmesh.reliability import report
    from specmesh.reliability.harness import start_suite_mesh

    t0 = time.monotonic()
    mesh = start_suite_mesh(Path(args.workdir) if args.workdir else None, tls=not args.no_tls)
    log(f"chaos: mesh up in {time.monotonic() - t0:.0f}s (logs: {mesh.log_dir})")
    passed = True
    try:
        for part in parts:
            started = time.monotonic()
            res, markdown = run_part(part, mesh, args, log)
            res["seconds"] = res.get("seconds", round(time.monotonic() - started, 1))
            dead = mesh.dead()
            res["processes_after"] = "all up" if not dead else "died: " + ", ".join(dead)
            passed = passed and res["passed"] and not dead
            (out / f"{part}.json").write_text(json.dumps(res, indent=1, default=str))
            log(f"chaos: {part} {'passed' if res['passed'] and not dead else 'FAILED'} in "
                f"{time.monotonic() - started:.0f}s -> {out / (part + '.json')}")
            if args.docs:
                report.update_doc(Path(args.docs), part, markdown)
    finally:
        mesh.stop()
    return passed
