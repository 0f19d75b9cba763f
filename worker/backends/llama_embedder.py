"""The llama.cpp embedding context: a second context on the already loaded weights, with embeddings on.

Owns: that context and its batch, the pooling it uses, one `llama_decode` per batch of inputs, and
turning each sequence's pooled state into a unit-length float32 vector.
Must not: be called from more than one thread (worker/engine/embedder.py owns the one that calls it),
or touch the generation context: the two share only the model's weights, which llama.cpp reads from
any number of contexts at once.

Pooling is the model's own when llama.cpp reports one (an embedding GGUF says `mean`, `cls` or
`last` in its metadata). A generation model such as SmolLM2 reports none, and then this context
asks for mean pooling: the average of the last layer's states over the input's tokens. Such vectors
are what the generation model happens to represent, not what an embedding model was trained to
(docs/benchmarks.md, "Embeddings", has the figure). Every vector is normalised to unit length, as
OpenAI's are, so a dot product is a cosine.

Every input must fit whole in one micro-batch (llama.cpp pools per micro-batch, and a non-causal
model attends only within one), so the context's batch and micro-batch are both its full size:
one input of `max_tokens` tokens, or several shorter ones, decode in one call.
"""

from __future__ import annotations

import llama_cpp as ll
import numpy as np

from worker.backends.llama_model import Model
from worker.engine.embedder import Pooling

POOLING_NAMES: dict[int, Pooling] = {ll.LLAMA_POOLING_TYPE_MEAN: "mean", ll.LLAMA_POOLING_TYPE_CLS: "cls",
                 ll.LLAMA_POOLING_TYPE_LAST: "last"}


class LlamaEmbeddingContext:
    def __init__(self, model: Model, *, ctx_tokens: int, max_inputs: int, threads: int) -> None:
        self._model = model
        ctx = self._context(ll.LLAMA_POOLING_TYPE_UNSPECIFIED, ctx_tokens, max_inputs, threads)
        if ll.llama_pooling_type(ctx) not in POOLING_NAMES:  # none (a generation model), or rank (a reranker)
            ll.llama_free(ctx)
            ctx = self._context(ll.LLAMA_POOLING_TYPE_MEAN, ctx_tokens, max_inputs, threads)
        self._ctx = ctx
        self._closed = False
        self.pooling = POOLING_NAMES[ll.llama_pooling_type(ctx)]
        self._mem = ll.llama_get_memory(ctx)  # NULL for an encoder-only model: it keeps no cells
        self.dimensions = ll.llama_model_n_embd_out(model.handle)
        self.max_tokens = min(ll.llama_n_ctx(ctx), ll.llama_n_batch(ctx), model.shape.n_ctx_train)
        self.max_inputs = ll.llama_n_seq_max(ctx)
        self._batch = ll.llama_batch_init(self.max_tokens, 0, 1)

    def _context(self, pooling: int, ctx_tokens: int, max_inputs: int, threads: int) -> ll.llama_context_p:
        params = ll.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = ctx_tokens
        params.n_seq_max = max_inputs
        params.kv_unified = True  # one input may take every cell, or several may share them
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = pooling
        params.no_perf = True
        ctx = ll.llama_init_from_model(self._model.handle, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the embedding context with these settings")
        return ctx

    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        if len(inputs) > self.max_inputs or sum(map(len, inputs)) > self.max_tokens:
            raise ValueError(f"a batch holds at most {self.max_inputs} inputs and {self.max_tokens} tokens")
        batch, n = self._batch, 0
        for seq_id, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = True  # pooling reads every token's state
                n += 1
        batch.n_tokens = n
        if self._mem:
            ll.llama_memory_clear(self._mem, True)  # each batch starts from empty cells
        status = ll.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode (embeddings) returned {status}")
        vectors = []
        for seq_id in range(len(inputs)):
            pooled = ll.llama_get_embeddings_seq(self._ctx, seq_id)
            if not pooled:
                raise RuntimeError(f"llama.cpp gave no pooled embedding for sequence {seq_id}")
            vector = np.ctypeslib.as_array(pooled, shape=(self.dimensions,)).astype(np.float64)
            norm = float(np.linalg.norm(vector))
            vectors.append((vector / norm if norm > 0 else vector).astype("<f4").tobytes())
        return vectors

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
