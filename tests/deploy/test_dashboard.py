"""The Grafana dashboard (deploy/grafana/llm-pool.json) queries only what the services export: every
metric a query names is a sample of the coordinator's or the worker's registry, and every label it
selects or groups by is one of that metric's labels (or one Prometheus adds when it scrapes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.registry import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llm-pool.json"
SCRAPE_LABELS = {"instance", "job"}
SAMPLE = re.compile(r"\b((?:coordinator|worker)_[a-z0-9_]+)\b")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"\b((?:coordinator|worker)_[a-z0-9_]+)\{([^}]*)\}")


def exported() -> dict[str, set[str]]:
    """Every sample name the two registries export, with its labels (histograms' `le` included)."""
    samples: dict[str, set[str]] = {}
    registries: list[CollectorRegistry] = [CoordinatorMetrics().registry, WorkerMetrics().registry]
    for registry in registries:
        for collector in list(registry._collector_to_names):  # the metrics it holds
            labels = set(getattr(collector, "_labelnames", ()))
            kind = getattr(collector, "_type", "")
            name = getattr(collector, "_name", "")
            if kind == "counter":
                samples[name + "_total"] = labels
            elif kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    samples[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
            elif name:
                samples[name] = labels
    return samples


def queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query in the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_query_names_a_metric_the_services_export_with_its_labels() -> None:
    samples = exported()
    found = queries()
    assert len(found) >= 20
    for title, expr in found:
        names = SAMPLE.findall(expr)
        assert names, f"{title}: {expr} names no metric of the pool"
        for name in names:
            assert name in samples, f"{title}: {name} is not a sample either service exports"
        allowed = set().union(*(samples[name] for name in names)) | SCRAPE_LABELS
        for group in GROUPING.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                assert label in allowed, f"{title}: groups by {label!r}, which {names} do not carry"
        for name, selector in SELECTOR.findall(expr):
            for label in re.findall(r"(\w+)\s*[=!]~?", selector):
                assert label in samples[name] | SCRAPE_LABELS, f"{title}: {name} has no label {label!r}"


def test_the_dashboard_covers_what_operators_watch() -> None:
    """The issue's list: admission and refusals, queue wait, TTFT and inter-token latency, KV by worker,
    tokens per tenant, breakers, moves and cache hits."""
    text = " ".join(expr for _, expr in queries())
    for metric in ("coordinator_admission_decisions_total", "coordinator_tenant_refusals_total",
                   "coordinator_queue_wait_seconds_bucket", "coordinator_time_to_first_token_seconds_bucket",
                   "worker_inter_token_latency_seconds_bucket", "worker_kv_cache_usage_ratio",
                   "coordinator_tenant_tokens_total", "coordinator_breakers_open", "coordinator_session_moves_total",
                   "coordinator_response_cache_lookups_total"):
        assert metric in text, metric


def test_a_misspelt_metric_is_caught() -> None:
    """The check itself can fail: a name one letter off is not an exported sample."""
    assert "coordinator_admision_decisions_total" not in exported()
    assert "worker_kv_cache_usage_ratio" in exported()
