"""Prometheus metrics of one worker, in a registry of its own (two apps can share a process).

Owns: metric names, help texts, buckets, and the engine observer that feeds them.
Must not: hold state the worker needs to run; gauges read live values through callbacks.
Names follow vLLM's and llama.cpp server's where the meaning is the same (see docs/metrics.md).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from worker.engine.embedder import EmbeddingObserver
from worker.engine.jobs import EngineObserver, Failed, Finished, Job

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256)
PROMPT_STEP_BUCKETS = (0, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class WorkerMetrics(EngineObserver, EmbeddingObserver):
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("worker_prompt_tokens", "Prompt tokens prefilled (cached ones excluded)",
                                     registry=r)
        self.cached_tokens = Counter("worker_cached_prompt_tokens", "Prompt tokens reused from a session's KV",
                                     registry=r)
        self.copied_tokens = Counter("worker_copied_prompt_tokens",
                                     "Of the reused prompt tokens, those copied from another sequence's cells",
                                     registry=r)
        self.generation_tokens = Counter("worker_generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter("worker_requests_finished", "Requests ended, by finish reason or error reason",
                                ["finish_reason"], registry=r)
        self.admission = Counter("worker_admission_decisions", "Admission decisions by outcome and reason",
                                 ["outcome", "reason"], registry=r)
        self.internal_errors = Counter("worker_internal_errors", "Unexpected exceptions in a supervised task "
                                       "(engine step, heartbeats, session sweeper, a model swap)", ["task"], registry=r)
        self.steps = Counter("worker_decode_steps", "llama_decode calls made by the batch loop", registry=r)
        self.decode_cpu_seconds = Counter("worker_decode_cpu_seconds", "CPU seconds of the engine thread inside "
                                          "llama_decode (its own threads' CPU when it runs on one; wall time "
                                          "is worker_decode_step_seconds)", registry=r)
        self.model_swaps = Counter("worker_model_swaps", "Swaps to another model of the folder, by outcome "
                                   "(loaded; added: loaded into a free slot of WORKER_MAX_MODELS, nothing unloaded; "
                                   "failed: the model served before, if any, is loaded again; unloaded: idle "
                                   "past the keep-alive, or to make room)", ["outcome"], registry=r)
        self.model_swap_seconds = Gauge("worker_model_swap_seconds", "The last swap's seconds: waiting for its "
                                        "streams and sessions to leave (wait), then loading (load)", ["phase"],
                                        registry=r)
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, buckets=buckets, registry=r)

        self.batch_size = histogram("worker_batch_size", "Sequences in one llama_decode call", BATCH_BUCKETS)
        self.step_seconds = histogram("worker_decode_step_seconds", "Duration of one llama_decode call",
                                      TOKEN_LATENCY_BUCKETS)
        self.step_prompt_tokens = Histogram(
            "worker_step_prompt_tokens", "Prompt tokens in one llama_decode call, beside decoding sequences or "
            "alone (the prefill budget: WORKER_PREFILL_STALL)", ["beside"], buckets=PROMPT_STEP_BUCKETS, registry=r)
        self.ttft = histogram("worker_time_to_first_token_seconds", "Admission to first token", LATENCY_BUCKETS)
        self.tpot = histogram("worker_time_per_output_token_seconds", "Mean time between output tokens of one "
                              "request", TOKEN_LATENCY_BUCKETS)
        self.itl = histogram("worker_inter_token_latency_seconds", "Time between two tokens of one request",
                             TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("worker_e2e_request_latency_seconds", "Admission to last token", LATENCY_BUCKETS)
        self.queue_time = histogram("worker_request_queue_time_seconds", "Admission to first decode step",
                                    LATENCY_BUCKETS)
        self.running = Gauge("worker_num_requests_running", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("worker_num_requests_waiting", "Admitted requests not yet in the batch", registry=r)
        self.kv_usage = Gauge("worker_kv_cache_usage_ratio", "KV cells holding tokens / all KV cells", registry=r)
        self.kv_reserved = Gauge("worker_kv_cache_reserved_ratio", "KV cells promised to requests / all",
                                 registry=r)
        self.sessions = Gauge("worker_sessions", "Sequences holding KV (streaming or kept)", registry=r)
        self.sessions_expired = Gauge("worker_sessions_expired_total", "Idle sessions dropped by TTL", registry=r)
        self.sessions_evicted = Gauge("worker_sessions_evicted_total", "Idle sessions evicted for room",
                                      registry=r)
        self._embeddings(r)
        self.kv_transfers = Counter("worker_kv_transfers", "Sessions' KV exported or imported, by direction and "
                                    "outcome (ok, refused)", ["direction", "outcome"], registry=r)
        self.kv_transfer_bytes = Counter("worker_kv_transfer_bytes", "Bytes of KV blobs exported or imported "
                                         "(refused ones included)", ["direction"], registry=r)
        self.parks = Counter("worker_preemptions", "Batch requests parked for an interactive request (their "
                             "cells saved to host memory, their sequence freed)", registry=r)
        self.park_bytes = Counter("worker_preempted_kv_bytes", "Bytes of KV saved to host memory by parking",
                                  registry=r)
        self.park_seconds = histogram("worker_preempted_seconds", "A parked request's pause, parked to resumed",
                                      LATENCY_BUCKETS)
        self.parked_now = Gauge("worker_num_requests_parked", "Batch requests parked now", registry=r)
        self.step_spent_seconds = Counter("worker_decode_busy_seconds", "Seconds in llama_decode, by the priority classes of "
                                          "the rows the step carried (interactive, batch, both) or cut: thrown away "
                                          "when an interactive request cut the step short", ["rows"], registry=r)
        # Each series from the start (0 until a step of that kind), and no label lookup a step.
        self._busy = {rows: self.step_spent_seconds.labels(rows) for rows in ("interactive", "batch", "both", "cut")}
        self.steps_cut = Counter("worker_steps_cut", "Decode steps carrying batch requests' rows cut short for an "
                                 "interactive request (their rows went in again after it)", registry=r)
        self.host_cache_saves = Counter("worker_host_cache_saves", "Interactive requests' leftover cells saved to "
                                        "host memory when another request took their sequence", registry=r)
        self.host_cache_saved_bytes = Counter("worker_host_cache_saved_bytes", "Bytes of leftover cells saved to "
                                              "host memory", registry=r)
        self.host_cache_restored_tokens = Counter("worker_host_cache_restored_tokens", "Prompt tokens whose cells "
                                                  "came back from host memory instead of being prefilled", registry=r)

    def _embeddings(self, r: CollectorRegistry) -> None:
        self.embedding_requests = Counter("worker_embedding_requests", "Embedding requests answered (ok) or "
                                          "refused, by reason", ["outcome"], registry=r)
        self.embedding_inputs = Counter("worker_embedding_inputs", "Inputs embedded", registry=r)
        self.embedding_tokens = Counter("worker_embedding_tokens", "Input tokens embedded", registry=r)
        self.embedding_batch_size = Histogram("worker_embedding_batch_size", "Inputs in one llama_decode of the "
                                              "embedding context", buckets=BATCH_BUCKETS, registry=r)
        self.embedding_step_seconds = Histogram("worker_embedding_decode_seconds", "Duration of one llama_decode "
                                                "of the embedding context", buckets=LATENCY_BUCKETS, registry=r)
        self.embeddings_held = Gauge("worker_embedding_requests_held", "Embedding requests running or waiting",
                                     registry=r)

    def bind(self, *, running: Callable[[], float], waiting: Callable[[], float],
             kv_usage: Callable[[], float], kv_reserved: Callable[[], float], sessions: Callable[[], float],
             expired: Callable[[], float], evicted: Callable[[], float],
             embeddings_held: Callable[[], float] = lambda: 0, parked: Callable[[], float] = lambda: 0) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)
        self.kv_reserved.set_function(kv_reserved)
        self.sessions.set_function(sessions)
        self.sessions_expired.set_function(expired)
        self.sessions_evicted.set_function(evicted)
        self.embeddings_held.set_function(embeddings_held)
        self.parked_now.set_function(parked)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- EngineObserver (engine thread; prometheus-client is thread-safe) ----------------------------

    def step(self, sequences: int, prefill_tokens: int, seconds: float, decoding: int = 0) -> None:
        self.steps.inc()
        self.batch_size.observe(sequences)
        self.step_seconds.observe(seconds)
        if prefill_tokens:
            self.step_prompt_tokens.labels("decoding" if decoding else "alone").observe(prefill_tokens)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def decode_cpu(self, seconds: float) -> None:
        self.decode_cpu_seconds.inc(seconds)

    def token_gaps(self, gaps: list[float]) -> None:
        """A step's gaps at once: the histogram's sum once, and each bucket once by how many fall in it
        (a step's gaps are nearly all alike), not `observe` per token."""
        if gaps:
            observe_many(self.itl, gaps)

    def finished(self, job: Job, item: Finished | Failed) -> None:
        if isinstance(item, Failed):
            self.requests_finished.labels(item.reason).inc()
            return
        self.requests_finished.labels(item.reason).inc()
        self.prompt_tokens.inc(item.prompt_tokens - item.cached_tokens)
        self.cached_tokens.inc(item.cached_tokens)
        self.copied_tokens.inc(job.copied_tokens)
        self.generation_tokens.inc(item.completion_tokens)
        self.queue_time.observe(item.queue_s)
        if item.completion_tokens:
            self.ttft.observe(item.ttft_s)
            self.e2e.observe(item.total_s)
        # Time per output token of one sequence: with several choices, of the longest (they decode side by side).
        longest = max((end.completion_tokens for end in item.choices), default=item.completion_tokens)
        if longest > 1:
            self.tpot.observe((item.total_s - item.ttft_s) / (longest - 1))

    def embedding_batch(self, inputs: int, tokens: int, seconds: float) -> None:
        self.embedding_inputs.inc(inputs)
        self.embedding_tokens.inc(tokens)
        self.embedding_batch_size.observe(inputs)
        self.embedding_step_seconds.observe(seconds)

    def kv_moved(self, direction: str, outcome: str, size: int) -> None:
        self.kv_transfers.labels(direction=direction, outcome=outcome).inc()
        self.kv_transfer_bytes.labels(direction=direction).inc(size)

    def internal_error(self, task: str) -> None:
        self.internal_errors.labels(task=task).inc()

    def parked(self, cell_bytes: int) -> None:
        self.parks.inc()
        self.park_bytes.inc(cell_bytes)

    def resumed(self, paused_s: float) -> None:
        self.park_seconds.observe(paused_s)

    def spilled(self, cell_bytes: int) -> None:
        self.host_cache_saves.inc()
        self.host_cache_saved_bytes.inc(cell_bytes)

    def restored(self, tokens: int) -> None:
        self.host_cache_restored_tokens.inc(tokens)

    def step_cut(self, seconds: float) -> None:
        self.steps_cut.inc()
        self._busy["cut"].inc(seconds)

    def step_spent(self, rows: str, seconds: float) -> None:
        self._busy[rows].inc(seconds)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """As `histogram.observe` each of `values`, with one increment per bucket touched. Leans on
    prometheus-client's Histogram internals (`_upper_bounds`, `_buckets`, `_sum`: what `observe` itself
    updates); tests/worker/test_metrics.py checks it against `observe`."""
    bounds = histogram._upper_bounds
    counts = collections.Counter(bisect.bisect_left(bounds, value) for value in values)
    histogram._sum.inc(sum(values))
    for bucket, count in counts.items():
        histogram._buckets[bucket].inc(count)
