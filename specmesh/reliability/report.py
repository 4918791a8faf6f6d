"""The suite's JSON results as markdown tables, written between markers in docs/reliability.md
(<!-- chaos:<part>:begin --> ... <!-- chaos:<part>:end -->), so a run refreshes the figures and
leaves the prose alone."""

from __future__ import annotations

import re
from pathlib import Path

CODES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
         "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "CANCELLED", "DEADLINE_EXCEEDED", "UNKNOWN",
         "INTERNAL", "DATA_LOSS")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fuzz_markdown(res: dict, run: dict) -> str:
    parts = sorted(res["cases"])
    codes = [c for c in CODES if any(c in res["statuses"][p] for p in parts)]
    rows = [[p, res["cases"][p], res["calls"][p]] + [res["statuses"][p].get(c, 0) for c in codes] for p in parts]
    never = sum(res["statuses"][p].get(c, 0) for p in parts for c in ("UNKNOWN", "INTERNAL", "DATA_LOSS"))
    hangs = sum(1 for f in res["failures"] if "hang" in f["failure"])
    kinds = [[k, v["cases"], v["failed"]] for k, v in res["kinds"].items()]
    post = ", ".join(f"{k}: {v}" for k, v in res["post"].items())
    return "\n\n".join([
        f"Run: {run['when']} on {run['machine']}, seed {res['seed']}, {res['seconds']:.0f} s "
        f"(`{run['command']}`).",
        _table(["part", "cases", "calls"] + codes, rows),
        f"Failures: {len(res['failures'])} (UNKNOWN/INTERNAL/DATA_LOSS answers: {never}; hangs: {hangs}). "
        f"DEADLINE_EXCEEDED: {res.get('deadline_asked', 0)} from cases that set a 1 ms or 2 s deadline on purpose. "
        f"After the fuzz: {post}.",
        _table(["generator", "cases", "failed"], kinds)])


def limits_markdown(res: dict) -> str:
    rows = [[r["limit"], f"`{r['key']}`", r["value"], r["status_at"], r["status_past"],
             ("pass" if r["passed"] else "FAIL") + (f" ({r['note']})" if r["note"] else "")] for r in res["rows"]]
    return _table(["limit", "set by", "value in the run", "at the limit", "one past", "result"], rows)


def security_markdown(res: dict) -> str:
    rows = [[c["check"], c["target"], c["expected"], c["got"], "pass" if c["passed"] else "FAIL"]
            for c in res["checks"]]
    return _table(["check", "where", "expected", "got", "result"], rows)


def update_doc(path: Path, part: str, body: str) -> None:
    text = path.read_text()
    begin, end = f"<!-- chaos:{part}:begin -->", f"<!-- chaos:{part}:end -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path}: no {begin} ... {end} markers")
    path.write_text(pattern.sub(lambda _m: f"{begin}\n{body}\n{end}", text))
