"""The llama.cpp backend, by name (`--engine llama`, the default): `llama_model` loads the GGUF,
`llama_engine` runs the continuously batched decode loop, `llama_embedder` a second context on the
same weights for embeddings. Its modules are imported when it is chosen, not when it is listed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from worker.backends.plugin import Backend

if TYPE_CHECKING:
    from worker.backends.base import EngineBackend, ModelBackend
    from worker.engine.embedder import EmbeddingContext
    from worker.engine.jobs import EngineConfig, EngineObserver
    from worker.settings import WorkerSettings


def _model(settings: WorkerSettings) -> ModelBackend:
    from worker.backends.llama_model import Model

    return Model(settings.model_path, gpu_layers=settings.gpu_layers)


def _engine(settings: WorkerSettings, model: ModelBackend, config: EngineConfig, observer: EngineObserver,
            clock: Callable[[], float]) -> EngineBackend:
    from worker.backends.llama_engine import Engine
    from worker.backends.llama_model import Model

    return Engine(cast(Model, model), config, observer=observer, clock=clock)


def _embeddings(settings: WorkerSettings, model: ModelBackend) -> EmbeddingContext:
    from worker.backends.llama_embedder import LlamaEmbeddingContext
    from worker.backends.llama_model import Model

    return LlamaEmbeddingContext(cast(Model, model), ctx_tokens=settings.embedding_ctx,
                                 max_inputs=settings.embedding_batch_inputs, threads=settings.embedding_threads)


BACKEND = Backend("llama", _model, _engine, _embeddings)
