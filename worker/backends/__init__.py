"""Engine backends: what runs the jobs. `base` says what every backend offers (the `ModelBackend`,
`EngineBackend` and `EmbeddingContext` protocols, and the types they share, free of llama.cpp);
`llama_model`, `llama_engine` and `llama_embedder` are the real one (llama.cpp, CPU or GPU);
`simulated` paces tokens without a model, for coordinator-scale benchmarks only. The `load_model`
and `build_*` functions pick one from the settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from worker.backends.base import EngineBackend, ModelBackend
    from worker.engine.embedder import EmbeddingContext
    from worker.engine.jobs import EngineConfig, EngineObserver
    from worker.settings import WorkerSettings


def load_model(settings: WorkerSettings) -> ModelBackend:
    """The model of the backend the settings name (`--engine`); llama.cpp unless asked otherwise."""
    if settings.engine == "simulated":
        from worker.backends.simulated import SimulatedModel

        return SimulatedModel(bytes_per_token=settings.sim_bytes_per_token)
    from worker.backends.llama_model import Model

    return Model(settings.model_path, gpu_layers=settings.gpu_layers)


def build_engine(settings: WorkerSettings, model: ModelBackend, config: EngineConfig, *, observer: EngineObserver,
                 clock: Callable[[], float]) -> EngineBackend:
    """The engine of the same backend as `model` (from `load_model` with the same settings)."""
    if settings.engine == "simulated":
        from worker.backends.simulated import SimulatedEngine, SimulatedModel

        return SimulatedEngine(cast(SimulatedModel, model), config, token_rate=settings.sim_token_rate,
                               prefill_rate=settings.sim_prefill_rate, observer=observer, clock=clock)
    from worker.backends.llama_engine import Engine
    from worker.backends.llama_model import Model

    return Engine(cast(Model, model), config, observer=observer, clock=clock)


def build_embedding_context(settings: WorkerSettings, model: ModelBackend) -> EmbeddingContext | None:
    """The embedding context of the same backend as `model`, sharing its weights; None when the
    settings turn embeddings off."""
    if not settings.embeddings:
        return None
    if settings.engine == "simulated":
        from worker.backends.simulated import SimulatedEmbeddingContext

        return SimulatedEmbeddingContext(max_tokens=settings.embedding_ctx, max_inputs=settings.embedding_batch_inputs)
    from worker.backends.llama_embedder import LlamaEmbeddingContext
    from worker.backends.llama_model import Model

    return LlamaEmbeddingContext(cast(Model, model), ctx_tokens=settings.embedding_ctx,
                                 max_inputs=settings.embedding_batch_inputs, threads=settings.embedding_threads)
