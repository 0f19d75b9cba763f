"""One request's sampler: a llama.cpp sampler chain built from its parameters.

Owns: the chain's construction and lifetime, and the sampled token's probability.
Must not: touch the batch or the KV cache. Used only on the engine thread.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import llama_cpp as ll
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    banned_tokens: tuple[int, ...] = ()  # end-of-generation tokens when ignore_eos is asked


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        chain_params = ll.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = ll.llama_sampler_chain_init(chain_params)
        if params.banned_tokens:
            bias = (ll.llama_logit_bias * len(params.banned_tokens))(
                *(ll.llama_logit_bias(t, -math.inf) for t in params.banned_tokens)
            )
            self._add(ll.llama_sampler_init_logit_bias(n_vocab, len(params.banned_tokens), bias))
        if params.temperature <= 0.0:
            self._add(ll.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            self._add(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            self._add(ll.llama_sampler_init_top_p(params.top_p, 1))
        self._add(ll.llama_sampler_init_temp(params.temperature))
        seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
        self._add(ll.llama_sampler_init_dist(seed))

    def _add(self, sampler: ll.llama_sampler_p) -> None:
        ll.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it from here

    def sample(self, ctx: ll.llama_context_p, batch_index: int) -> tuple[int, float]:
        """Samples from the logits of one batch row; returns the token and its raw softmax probability."""
        token = ll.llama_sampler_sample(self._chain, ctx, batch_index)  # also accepts it into the chain
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, batch_index), shape=(self._n_vocab,))
        top = float(logits.max())
        total = float(np.exp(logits - top, dtype=np.float32).sum())
        probability = math.exp(float(logits[token]) - top) / total
        return int(token), min(1.0, probability)

    def close(self) -> None:
        if self._chain:
            ll.llama_sampler_free(self._chain)
            self._chain = ctypes.c_void_p(0)
