"""The Grafana dashboard (compose/grafana/dashboards/specmesh.json) against the code: the operator's
panels are there, every series a panel queries is one the services declare, its label matchers name
real labels. The same check against real running services: tests/e2e/test_operator_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from specmesh.telemetry import metrics
from specmesh.telemetry.promql import dashboard_queries, exposed_series, queried_series

DASHBOARD = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "dashboards" / "specmesh.json"
FROM_PROMETHEUS = {"up"}  # series Prometheus writes itself
TARGET_LABELS = {"job", "instance"}  # labels Prometheus adds to every scraped series
# what an operator needs to see, by the series that show it
REQUIRED = {
    "tokens/s": "specmesh_completion_tokens_total", "TTFT": "specmesh_ttft_seconds_bucket",
    "TPOT": "specmesh_tpot_seconds_bucket", "acceptance length": "specmesh_acceptance_length_count",
    "per-position acceptance": "specmesh_accepted_per_position_total", "chosen k": "specmesh_chosen_k_bucket",
    "draft failures": "specmesh_draft_failures_total", "KV usage": "specmesh_kv_cache_usage_ratio",
    "admission queues": "specmesh_queue_length", "model-thread queues": "specmesh_batch_queue_length",
    "overload rejections": "specmesh_overload_rejections_total",
    "rate-limit rejections": "specmesh_ratelimit_rejections_total", "auth rejections": "specmesh_auth_failures_total",
    "errors": "specmesh_rpc_requests_total",
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for _, expr in dashboard_queries(dashboard()):
        for name, labels in queried_series(expr).items():
            out.setdefault(name, set()).update(labels)
    return out


def declared_labels() -> dict[str, set[str]]:
    """series name -> the label names the code declares for its family (histograms: + le)."""
    out = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            labels = set(obj._labelnames)
            for series in exposed_series(generate_latest(_Only(obj)).decode()):
                out[series] = labels | ({"le"} if series.endswith("_bucket") else set())
    return out


class _Only:
    """A registry-like collector of one metric (generate_latest takes anything with collect())."""

    def __init__(self, metric):
        self.metric = metric

    def collect(self):
        return self.metric.collect()


def test_queries_are_parsed_for_series_and_matchers():
    q = queried_series('histogram_quantile(0.99, sum by (le, arm)(rate(specmesh_ttft_seconds_bucket'
                       '{service="x", le!="+Inf"}[$__rate_interval]))) * 1e3')
    assert q == {"specmesh_ttft_seconds_bucket": {"service", "le"}}
    q = queried_series("sum by (method)(rate(a_sum[5m])) / on (method) sum without (x)(rate(a_count[5m])) > 0.5")
    assert q == {"a_sum": set(), "a_count": set()}
    assert queried_series('up{job=~"a|b"} offset 5m and min(b{c="sum(x)"})') == {"up": {"job"}, "b": {"c"}}


def test_exposed_series_cover_families_without_samples():
    text = ("# HELP c_total a counter\n# TYPE c_total counter\n"
            "# HELP h a histogram\n# TYPE h histogram\n"
            "# HELP g a gauge\n# TYPE g gauge\ng{service=\"x\"} 1.0\n")
    assert set(exposed_series(text)) == {"c_total", "c_created", "h_bucket", "h_sum", "h_count", "h_created", "g"}
    assert exposed_series(text)["g"] == {"service"}


def test_the_operator_panels_are_there():
    q = queried()
    missing = [what for what, series in REQUIRED.items() if series not in q]
    assert not missing, f"no panel shows: {missing}"
    arms = [title for title, expr in dashboard_queries(dashboard()) if "arm)" in expr or "arm," in expr]
    assert len(arms) >= 3, "per canary arm: group the coordinator's request metrics by arm"
    titles = [p["title"] for p in dashboard()["panels"]]
    assert len(titles) == len(set(titles)), "panel titles repeat"


def test_every_queried_series_is_declared_with_the_labels_it_matches():
    declared = declared_labels()
    for name, labels in queried().items():
        if name in FROM_PROMETHEUS:
            continue
        assert name in declared, f"{name}: queried by the dashboard, declared by no service"
        unknown = labels - declared[name] - TARGET_LABELS
        assert not unknown, f"{name}: matches on labels it does not carry: {sorted(unknown)}"


def test_every_exposed_family_parses_from_the_real_registry():
    exposed = exposed_series(generate_latest(REGISTRY).decode())
    assert "specmesh_chosen_k_bucket" in exposed and "specmesh_auth_failures_total" in exposed
