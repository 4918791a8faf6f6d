"""What a Grafana dashboard queries, checked against what the services expose. No grpc here.

queried_series(expr): the series names a PromQL expression selects (`rate(x_bucket[5m])` -> x_bucket),
with the label names its selectors match on. exposed_series(text): every series name a /metrics
page can carry: a counter family `x` gives x_total (and x_created), a histogram h_bucket / h_sum /
h_count, a gauge its own name; a family counts even before its first labelled sample, so a panel
grouping by a label that a metric does not carry yet (a canary's `arm`) still finds its metric.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_RANGE = re.compile(r"\[[^\[\]]*\]")  # [5m], [$__rate_interval], subqueries
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^{}]*\})")
_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                      "and", "or", "unless", "inf", "nan", "Inf", "NaN"})
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",), "info": ("_info",)}


def queried_series(expr: str) -> dict[str, set[str]]:
    """{series name: label names its selectors match on} for one PromQL expression (metric names
    written as names; a bare {__name__="x"} selector is not read)."""
    text = _RANGE.sub(" ", _STRING.sub('""', expr))
    text = _GROUPING.sub(" ", text)
    found: dict[str, set[str]] = {}
    for m in _SELECTOR.finditer(text):  # name{matchers}
        found.setdefault(m.group(1), set()).update(_LABEL.findall(m.group(2)))
    bare = _MATCHERS.sub(" ", text)
    for m in _IDENT.finditer(bare):
        name, rest = m.group(0), bare[m.end():].lstrip()
        if name in KEYWORDS or rest.startswith("(") or _is_number(bare, m.start()):
            continue  # a keyword, a function or aggregation, or part of a number (1e6) or duration
        found.setdefault(name, set())
    return found


def _is_number(text: str, start: int) -> bool:
    return any(n.start() <= start < n.end() for n in _NUMBER.finditer(text))


def exposed_series(text: str) -> dict[str, set[str]]:
    """{series name: label names seen on it} for one Prometheus text exposition (a /metrics page)."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, set())
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows' nested panels included, and the
    query of every templating variable."""
    out = []
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", "?"), target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and q:
            out.append((f"${var.get('name')}", _label_values_selector(q.strip())))
    return out


def _label_values_selector(query: str) -> str:
    """Grafana's label_values(SELECTOR, LABEL) -> SELECTOR; label_values(LABEL) -> '' (no metric)."""
    m = re.fullmatch(r"label_values\((.*)\)", query, re.S)
    if not m:
        return query
    selector, comma, _label = m.group(1).rpartition(",")
    return selector if comma else ""
