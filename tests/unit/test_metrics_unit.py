"""specmesh.telemetry.metrics: the documented families exist, /metrics serves them, helpers count."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client import REGISTRY

from specmesh.config import ConfigError, load_config
from specmesh.telemetry import metrics

README = Path(__file__).resolve().parents[2] / "docs" / "operations.md"  # the metrics reference


def documented_names() -> set[str]:
    text = README.read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(specmesh_[a-z0-9_]+)`", section))


def families() -> set[str]:
    """Family names (a counter's without its _total suffix)."""
    return {f.name for f in REGISTRY.collect() if f.name.startswith("specmesh_")}


def test_every_documented_metric_exists():
    missing = {n for n in documented_names() if n.removesuffix("_total") not in families()}
    assert len(documented_names()) >= 20
    assert not missing, f"documented but not defined: {sorted(missing)}"


def test_every_specmesh_metric_is_documented():
    doc = {n.removesuffix("_total") for n in documented_names()}
    undocumented = families() - doc
    assert not undocumented, f"defined but not in docs/operations.md: {sorted(undocumented)}"


def test_observe_round_counts_tokens_and_positions():
    def val(name, labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def read(arm):
        return (val("specmesh_drafted_tokens_total", {"method": "unit", "arm": arm}),
                val("specmesh_accepted_per_position_total", {"method": "unit", "position": "1", "arm": arm}),
                val("specmesh_acceptance_length_count", {"method": "unit", "arm": arm}),
                val("specmesh_verify_latency_seconds_count", {"arm": arm}))

    before, before_control = read("spec"), read("control")
    metrics.observe_round("unit", drafted=4, accepted=2, emitted=3, verify_s=0.01, arm="spec")
    after = read("spec")
    assert [a - b for a, b in zip(after, before)] == [4, 1, 1, 1]
    assert read("control") == before_control  # the arm label keeps the arms apart
    assert val("specmesh_accepted_per_position_total", {"method": "unit", "position": "2", "arm": "spec"}) == 0


def test_observe_chosen_k_counts_rounds_per_k():
    def val(name, labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    labels = {"method": "unitk", "arm": "spec"}
    count, total = val("specmesh_chosen_k_count", labels), val("specmesh_chosen_k_sum", labels)
    metrics.observe_chosen_k("unitk", {0: 2, 3: 1, 5: 4})
    assert val("specmesh_chosen_k_count", {"method": "unitk", "arm": "spec"}) - count == 7
    assert val("specmesh_chosen_k_sum", {"method": "unitk", "arm": "spec"}) - total == 3 + 20
    assert val("specmesh_chosen_k_bucket", {"method": "unitk", "arm": "spec", "le": "0.0"}) == 2
    assert val("specmesh_chosen_k_bucket", {"method": "unitk", "arm": "spec", "le": "4.0"}) == 3


def test_serve_off_and_on_a_free_port():
    assert metrics.serve("127.0.0.1", 0, "unit") is None
    port = metrics.serve("127.0.0.1", -1, "unit")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "specmesh_rpc_requests_total" in body or "specmesh_inflight_requests" in body


def test_metrics_config():
    cfg = load_config(environ={})
    assert cfg.metrics.gateway_port == 0  # off unless configured
    cfg = load_config(environ={"SPECMESH_METRICS__TARGET_WORKER_PORT": "9100"})
    assert cfg.metrics.target_worker_port == 9100
    try:
        load_config(environ={}, overrides={"metrics": {"gateway_port": 70000}})
    except ConfigError as exc:
        assert str(exc).startswith("metrics.gateway_port:")
    else:
        raise AssertionError("port 70000 accepted")
