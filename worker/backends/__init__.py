"""Engine backends: what runs the jobs. `base` says what every backend offers (the `ModelBackend` and
`EngineBackend` protocols, and the optional capabilities `KvTransfer` and `PrefixExport`, free of
llama.cpp); `llama` registers the real one (`llama_model`, `llama_engine`, `llama_embedder`: llama.cpp,
CPU or GPU); `simulated` paces tokens without a model, for coordinator-scale benchmarks only. Each
backend registers itself by name (`BACKEND`, plugin.py); `load_model` and the `build_*` functions pick
the one the settings name (`--engine`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from serving.plugins import discover
from worker.backends.plugin import Backend

if TYPE_CHECKING:
    from worker.backends.base import EngineBackend, ModelBackend
    from worker.engine.embedder import EmbeddingContext
    from worker.engine.jobs import EngineConfig, EngineObserver
    from worker.settings import WorkerSettings


@functools.cache
def backends() -> Mapping[str, Backend]:
    """Every backend present, by name: the modules of this package that define a `BACKEND`."""
    return discover(__name__, "BACKEND", Backend, "engine backends")


def backend(name: str) -> Backend:
    found = backends()
    if name not in found:
        raise ValueError(f"no engine backend {name!r} (known: {', '.join(found)})")
    return found[name]


def load_model(settings: WorkerSettings) -> ModelBackend:
    """The model of the backend the settings name (`--engine`); llama.cpp unless asked otherwise."""
    return backend(settings.engine).load_model(settings)


def build_engine(settings: WorkerSettings, model: ModelBackend, config: EngineConfig, *, observer: EngineObserver,
                 clock: Callable[[], float]) -> EngineBackend:
    """The engine of the same backend as `model` (from `load_model` with the same settings)."""
    return backend(settings.engine).build_engine(settings, model, config, observer, clock)


def build_embedding_context(settings: WorkerSettings, model: ModelBackend) -> EmbeddingContext | None:
    """The embedding context of the same backend as `model`, sharing its weights; None when the
    settings turn embeddings off. A backend that has none is refused here (`--no-embeddings`)."""
    if not settings.embeddings:
        return None
    chosen = backend(settings.engine)
    if chosen.embedding_context is None:
        raise ValueError(f"the {chosen.name} engine computes no embeddings: start it with --no-embeddings")
    return chosen.embedding_context(settings, model)
