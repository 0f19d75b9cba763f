"""A plugin of the scheduling policy, registered by name in the module that defines it.

Every filter, scorer and picker module ends with `PLUGIN = Plugin(name, build, ...)`; `catalog.py` finds
them by looking through its package, so adding one is adding its module and its test. No list of them
is kept anywhere else: the policy, the settings' choices and their help text read the catalogs.

Owns: `Plugin` (a name, how to build one from the `Options`, which requests' policies use it, where a
filter runs) and `Options` (the settings a plugin may be built with).
Must not: import the plugins' packages (they import this module) or choose between plugins (policy.py
does, from settings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

GENERATION, EMBEDDINGS = "generation", "embeddings"
BOTH = frozenset({GENERATION, EMBEDDINGS})
T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    """What a plugin may be built with (from the coordinator's settings)."""

    stale_after: float = 6.0  # seconds without a heartbeat before a worker is not scheduled
    latency_half_life: float = 10.0  # least-latency: an idle worker's TTFT average halves in this long


@dataclass(frozen=True)
class Plugin(Generic[T]):
    name: str  # what settings call it
    build: Callable[[Options], T]
    kinds: frozenset[str] = frozenset({GENERATION})  # the policies that use it (filters and scorers)
    order: int = 0  # a filter's place: lower runs first, and the first that leaves nobody names the reason
