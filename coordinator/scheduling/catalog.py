"""The plugins present, by name: each module of `filters/`, `scorers/` and `pickers/` that defines a
`PLUGIN` (plugin.py), found by looking through the package once per process.

Owns: finding the plugins, refusing two of one name, and the read-only catalogs.
Must not: build a policy (policy.py does) or know any plugin by name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from coordinator.scheduling.filters import Filter
from coordinator.scheduling.pickers import Picker
from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.scorers import Scorer
from serving.plugins import discover


def _found(package: str) -> Mapping[str, Plugin[Any]]:
    return discover(package, "PLUGIN", Plugin, f"{package} plugins")


@functools.cache
def filters() -> Mapping[str, Plugin[Filter]]:
    return _found("coordinator.scheduling.filters")


@functools.cache
def scorers() -> Mapping[str, Plugin[Scorer]]:
    return _found("coordinator.scheduling.scorers")


@functools.cache
def pickers() -> Mapping[str, Plugin[Picker]]:
    """The routing policies (`--routing-policy`)."""
    return _found("coordinator.scheduling.pickers")


def named(kind: str, catalog: Mapping[str, Plugin[Any]]) -> list[str]:
    """The names of the plugins a kind of request's policy may use, in order."""
    return [p.name for p in sorted(catalog.values(), key=lambda p: (p.order, p.name)) if kind in p.kinds]
