"""docs/deploy.md names only metrics the services export, and the files it points to exist."""

from __future__ import annotations

import re

from coordinator.metrics import CoordinatorMetrics
from tests.deploy.manifests import ROOT
from worker.metrics import WorkerMetrics

DOC = ROOT / "docs" / "deploy.md"


def _exported() -> set[str]:
    """Every series name the two registries can produce: counters as *_total, histograms' parts."""
    suffixes = {"counter": ["_total"], "histogram": ["", "_bucket", "_sum", "_count"], "gauge": [""]}
    return {family.name + suffix for metrics in (CoordinatorMetrics(), WorkerMetrics())
            for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def test_every_metric_the_monitoring_section_names_is_exported() -> None:
    text = DOC.read_text()
    section = text[text.index("## What to monitor"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"\b(?:coordinator|worker)_[a-z0-9_]+\b", section))
    assert len(named) >= 15, named
    assert named <= _exported(), sorted(named - _exported())


def test_the_paths_the_doc_points_to_exist() -> None:
    paths = set(re.findall(r"`((?:deploy|docs|scripts|tests|coordinator|worker)/[\w./-]+)`", DOC.read_text()))
    assert paths, "no paths found"
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, missing
