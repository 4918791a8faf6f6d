"""`specmesh admin speculation` (the hot switch and the canary's share / keys) and `specmesh admin
canary` (TPOT and E2E p50/p99 and error rate per arm). Both talk to specmesh.v1.Admin on every
--target: a gateway (admin key required) or a coordinator's mesh port; docs/rollout.md."""

from __future__ import annotations

import json
import sys

from specmesh.auth.cli import add_client_arguments, call_metadata, client_channel
from specmesh.core.canary import ARMS
from specmesh.core.canary_stats import ArmStats


def _targets(args) -> list[str]:
    out = []
    for t in args.target or [args.default_target]:
        out += [x.strip() for x in t.split(",") if x.strip()]
    return out


def _call(args, target: str, fn):
    """fn(stub, metadata, timeout) on target's Admin service; (result, None) or (None, error text)."""
    import argparse

    import grpc

    from specmesh.v1 import admin_pb2_grpc as apb_grpc

    one = argparse.Namespace(**{**vars(args), "target": target})
    with client_channel(one) as channel:
        try:
            return fn(apb_grpc.AdminStub(channel), call_metadata(args), args.timeout), None
        except grpc.RpcError as err:
            return None, f"{err.code().name}: {err.details()}"


def state_json(state) -> dict:
    return {"enabled": state.enabled, "method": state.method or None,
            "num_speculative_tokens": None if state.num_speculative_tokens < 0 else state.num_speculative_tokens,
            "version": state.version, "share": state.share, "keys": list(state.keys),
            "guard_tripped": state.guard_tripped or None}


def speculation_request(args):
    """The SetSpeculationRequest the flags ask for, or None when they only ask to show."""
    from specmesh.v1 import admin_pb2 as apb

    req = apb.SetSpeculationRequest(reset=args.reset)
    if args.on or args.off:
        req.enabled = bool(args.on)
    if args.method is not None:
        req.method = args.method
    if args.k is not None:
        req.num_speculative_tokens = args.k
    if args.share is not None:
        req.share = args.share
    if args.keys is not None:
        req.keys = args.keys
    fields = ("enabled", "method", "num_speculative_tokens", "share", "keys")
    return req if args.reset or any(req.HasField(f) for f in fields) else None


def cmd_speculation(args) -> int:
    from specmesh.v1 import admin_pb2 as apb

    req, targets, rc = speculation_request(args), _targets(args), 0
    for target in targets:
        if req is not None:
            state, err = _call(args, target, lambda s, md, t: s.SetSpeculation(req, timeout=t, metadata=md))
        else:
            state, err = _call(args, target, lambda s, md, t: s.GetSpeculation(
                apb.GetSpeculationRequest(), timeout=t, metadata=md))
        if err:
            print(err if len(targets) == 1 else f"{target}: {err}", file=sys.stderr)
            rc = 1
            continue
        out = state_json(state)
        print(json.dumps(out if len(targets) == 1 else {"target": target, **out}))
    return rc


def _arm_stats(pb_arm) -> ArmStats:
    def hist(h):
        return tuple(zip(h.upper_bounds, h.cumulative_counts))

    return ArmStats(dict(pb_arm.codes), hist(pb_arm.tpot), hist(pb_arm.e2e))


def merge_reports(reports: list) -> dict[str, ArmStats]:
    """CanaryReport messages of several coordinators -> one ArmStats per arm (summed)."""
    arms = {arm: ArmStats() for arm in ARMS}
    for report in reports:
        for a in report.arms:
            if a.arm in arms:
                arms[a.arm] = arms[a.arm].merged(_arm_stats(a))
    return arms


def _ms(s):
    return "-" if s is None else f"{s * 1000:.1f} ms"


def _sec(s):
    return "-" if s is None else f"{s:.2f} s"


def format_table(arms: dict[str, ArmStats]) -> list[str]:
    lines = [f"{'arm':<8} {'requests':>8} {'errors':>6} {'error rate':>10} {'TPOT p50':>9} {'TPOT p99':>9} "
             f"{'E2E p50':>8} {'E2E p99':>8}"]
    for arm in ARMS:
        s = arms[arm].summary()
        rate = "-" if s["error_rate"] is None else f"{s['error_rate']:.1%}"
        lines.append(f"{arm:<8} {s['requests']:>8} {s['errors']:>6} {rate:>10} {_ms(s['tpot_p50_s']):>9} "
                     f"{_ms(s['tpot_p99_s']):>9} {_sec(s['e2e_p50_s']):>8} {_sec(s['e2e_p99_s']):>8}")
    return lines


def format_header(target: str, report, since_start: bool) -> str:
    st = report.state
    guard = "off" if st.guard_margin < 0 else f"margin {st.guard_margin:.0%}"
    guard += f", TRIPPED: {st.guard_tripped}" if st.guard_tripped else ""
    window = "since start" if since_start else "since the canary last changed"
    return (f"{target}: share {st.share:g}, keys {','.join(st.keys) or '(every request)'}, guard {guard}; "
            f"window {report.window_s:.0f} s ({window})")


def cmd_canary(args) -> int:
    from specmesh.v1 import admin_pb2 as apb

    req, reports, rc = apb.GetCanaryRequest(since_start=args.since_start), [], 0
    for target in _targets(args):
        report, err = _call(args, target, lambda s, md, t: s.GetCanary(req, timeout=t, metadata=md))
        if err:
            print(f"{target}: {err}", file=sys.stderr)
            rc = 1
        else:
            reports.append((target, report))
    if not reports:
        return 1
    arms = merge_reports([r for _, r in reports])
    if args.json:
        print(json.dumps({"coordinators": [{"target": t, "window_s": r.window_s, **state_json(r.state),
                                            "guard_margin": None if r.state.guard_margin < 0 else r.state.guard_margin}
                                           for t, r in reports],
                          "arms": {arm: arms[arm].summary() for arm in ARMS}}))
        return rc
    for target, report in reports:
        print(format_header(target, report, args.since_start))
    print("\n".join(format_table(arms)))
    return rc


def add_admin_commands(sub, default_target: str) -> None:
    p = sub.add_parser("admin", help="run-time operations through the gateway (an admin key is required)")
    ad = p.add_subparsers(dest="admin_command", required=True)
    s = ad.add_parser("speculation", help="show, or switch speculation for new rounds: --on/--off, --method, --k; "
                                          "the canary: --share, --keys")
    onoff = s.add_mutually_exclusive_group()
    onoff.add_argument("--on", action="store_true", help="speculate again")
    onoff.add_argument("--off", action="store_true", help="every round: the target alone")
    s.add_argument("--method", help="drafter for speculating requests ('' = each request's own)")
    s.add_argument("--k", type=int, help="speculative tokens per round (-1 = each request's own)")
    s.add_argument("--share", type=float, help="canary: share of new requests that speculate, 0..1")
    s.add_argument("--keys", help="canary: only requests of these API key names (comma list; '' = every request)")
    s.add_argument("--reset", action="store_true", help="back to the configuration first")
    s.set_defaults(fn=cmd_speculation)
    c = ad.add_parser("canary", help="TPOT and E2E p50/p99 and error rate per canary arm (spec, control)")
    c.add_argument("--since-start", action="store_true", help="the coordinators' whole life, not since the "
                                                                "canary last changed")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_canary)
    for q in (s, c):
        q.add_argument("--target", action="append", help="gateway (or coordinator) host:port; repeat or comma-"
                                                         f"separate for several (default {default_target})")
        q.add_argument("--timeout", type=float, default=30.0)
        q.set_defaults(default_target=default_target)
        add_client_arguments(q)
