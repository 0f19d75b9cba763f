"""An engine backend, registered by name in the module that defines it: `BACKEND = Backend(...)`.

`worker/backends/__init__.py` finds every such module by looking through this package, so adding a
backend is adding its module (and its test): `--engine NAME` and its `--help` choices come from there.

Owns: `Backend`: a name, how to load its model and build its engine from the settings, and, when it
has one, its embedding context (a backend without is refused at start when embeddings are on).
Must not: import any backend (they import this module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.backends.base import EngineBackend, ModelBackend
    from worker.engine.embedder import EmbeddingContext
    from worker.engine.jobs import EngineConfig, EngineObserver
    from worker.settings import WorkerSettings

    EngineFactory = Callable[[WorkerSettings, ModelBackend, EngineConfig, EngineObserver, Callable[[], float]],
                             EngineBackend]


@dataclass(frozen=True)
class Backend:
    name: str  # what `--engine` calls it
    load_model: Callable[[WorkerSettings], ModelBackend]
    build_engine: EngineFactory  # (settings, its model, config, observer, clock)
    embedding_context: Callable[[WorkerSettings, ModelBackend], EmbeddingContext] | None = None
