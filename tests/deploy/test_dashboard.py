"""The Grafana dashboard (deploy/grafana/rsrv.json): well-formed, and every query names
only metrics that specs/metrics.md documents, by their exposed sample names
(``rsrv_requests_total``, ``rsrv_request_latency_seconds_bucket``, ...), so a renamed
metric fails here rather than as an empty panel. It covers what operators watch: queue
depth, latency, batch sizes, the weight cache's loads, evictions and bytes, and
per-worker placement through the gateway.
"""

from __future__ import annotations

import json
import re

import pytest
from support import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "rsrv.json"
METRIC = re.compile(r"\brsrv_[a-z0-9_]+\b")


def documented() -> set[str]:
    """Sample names in specs/metrics.md's tables (the first column, in backticks)."""
    text = (ROOT / "specs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(rsrv_[a-z0-9_]+)`", text, re.MULTILINE))


def queries(dashboard: dict) -> list[str]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                elif key == "query" and isinstance(value, str | dict):
                    found.append(value if isinstance(value, str) else value.get("query", ""))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return [q for q in found if q and q != "prometheus"]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_documented_metric_list_is_read():
    names = documented()
    assert {"rsrv_requests_total", "rsrv_queue_depth", "rsrv_gateway_worker_load"} <= names
    assert len(names) > 30


def test_every_query_names_documented_metrics(dashboard):
    names = documented()
    used = {m for q in queries(dashboard) for m in METRIC.findall(q)}
    assert used, "no query found"
    assert used <= names, f"not in specs/metrics.md: {sorted(used - names)}"


def test_it_shows_what_operators_watch(dashboard):
    used = {m for q in queries(dashboard) for m in METRIC.findall(q)}
    assert {
        "rsrv_queue_depth",
        "rsrv_request_latency_seconds_bucket",
        "rsrv_batch_executions_total",
        "rsrv_weight_cache_loads_total",
        "rsrv_weight_cache_evictions_total",
        "rsrv_weight_cache_transferred_bytes_total",
        "rsrv_model_device_resident",
        "rsrv_gateway_routed_requests_total",
        "rsrv_gateway_worker_load",
    } <= used


def test_meta_models_are_offered_and_not_counted_twice(dashboard):
    """A meta model has no queue or execution series (specs/metrics.md), and its compute
    seconds are its sub-models': the model picker read rsrv_queue_depth (no metas to
    pick), and the device time share stacked a meta's time on its sub-models'."""
    (picker,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert picker["query"]["query"] == "label_values(rsrv_requests_total, model)"
    share = [q for q in queries(dashboard) if "rsrv_compute_seconds_total" in q]
    assert share and all("and on (instance, model) rsrv_executions_total" in q for q in share)


def test_panels_are_well_formed(dashboard):
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            # every variable the query uses is defined (or is one of Grafana's own)
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables or var.startswith("__"), (var, expr)
