"""Prometheus metrics of one coordinator app, in a `CollectorRegistry` of its own.

Owns: metric names, labels and buckets, and one named helper per event. Names follow vLLM's where
the meaning matches (requests running, time to first token, end-to-end latency).
Must not: touch prometheus_client's global default registry (two apps in one test process must not
share counters) or decide anything.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FILL_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def tenant_label(tenant: str) -> str:
    """A tenant as metrics name it: `t:NAME` for a named one, `k:` and a hash for a key's own, and
    `default` without keys."""
    return tenant or "default"


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("coordinator_requests_running", "Streams being relayed now", registry=r)
        self.admission = Counter("coordinator_admission_decisions", "Admission decisions",
                                 ["outcome", "reason"], registry=r)
        self.finished = Counter("coordinator_request_finished", "Requests whose stream ended",
                                ["finish_reason"], registry=r)
        self.failovers = Counter("coordinator_failovers", "Workers given up on before the first token",
                                 ["reason"], registry=r)
        self.prefills = Counter("coordinator_disaggregated_prefills", "Prompts prefilled on one worker for another "
                                "to decode (DISAGGREGATE_PROMPT_BYTES), by outcome: prefilled, failed",
                                ["outcome"], registry=r)
        self.stream_breaks = Counter("coordinator_stream_breaks", "Worker streams that broke off after their first "
                                     "token, by outcome: continued (on another worker), ended (with an error event)",
                                     ["outcome"], registry=r)
        self.stream_moves = Counter("coordinator_stream_moves", "Tries to move a stream off a draining worker, by "
                                    "outcome: moved, stayed (no worker had room: it finishes in place)",
                                    ["outcome"], registry=r)
        self.continuation_pause = Histogram("coordinator_continuation_pause_seconds", "A broken stream's pause: "
                                            "from the break to the continuing worker's first event",
                                            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        self.slow_clients = Counter("coordinator_slow_client_disconnects",
                                    "Clients disconnected for not reading past the write deadline", registry=r)
        self.client_disconnects = Counter("coordinator_client_disconnects",
                                          "Clients that went away before their stream ended", registry=r)
        self.heartbeats = Counter("coordinator_heartbeats", "Heartbeats received", ["outcome"], registry=r)
        self.workers = Gauge("coordinator_workers", "Registered workers by state", ["state"], registry=r)
        self.reserved_kv = Gauge("coordinator_kv_reserved_bytes", "KV bytes reserved by in-flight requests",
                                 registry=r)
        self.buffer_fill = Histogram("coordinator_relay_buffer_fill_ratio",
                                     "Fill of a stream's relay buffer when an event is queued",
                                     buckets=FILL_BUCKETS, registry=r)
        self.ttft = Histogram("coordinator_time_to_first_token_seconds", "Request received to first token sent",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("coordinator_e2e_request_latency_seconds", "Request received to stream end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter("coordinator_generation_tokens", "Token events relayed", registry=r)
        self._response_cache(r)
        self.breaker_transitions = Counter("coordinator_breaker_transitions", "Circuit breakers opened or closed",
                                           ["to"], registry=r)
        self.breakers_open = Gauge("coordinator_breakers_open", "Workers out of scheduling by their breaker now",
                                   registry=r)
        self.queue_length = Gauge("coordinator_queue_length", "Requests waiting for capacity, all models",
                                  registry=r)
        self.queue_wait = Histogram("coordinator_queue_wait_seconds", "Time requests spent in the admission queue",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self._access(r)
        self.internal_errors = Counter("coordinator_internal_errors", "Unexpected exceptions in a supervised task",
                                       ["task"], registry=r)
        self.queue_outcomes = Counter("coordinator_queue_outcomes", "How waits in the admission queue ended",
                                      ["outcome"], registry=r)
        self._embeddings(r)
        self.session_moves = Counter("coordinator_session_moves", "Draining workers' kept sessions moved to "
                                     "another worker (moved) or not, and why", ["outcome"], registry=r)
        self.session_move_bytes = Counter("coordinator_session_move_bytes", "KV bytes of the sessions moved",
                                          registry=r)
        self.session_move_seconds = Histogram("coordinator_session_move_seconds", "One session's move: its KV "
                                              "fetched, put and taken in", buckets=LATENCY_BUCKETS, registry=r)

    def _embeddings(self, r: CollectorRegistry) -> None:
        self.embedding_requests = Counter("coordinator_embedding_requests", "Embedding requests answered",
                                          registry=r)
        self.embedding_inputs = Counter("coordinator_embedding_inputs", "Inputs embedded", registry=r)
        self.embedding_tokens = Counter("coordinator_embedding_tokens", "Input tokens embedded (the usage "
                                        "answered)", registry=r)
        self.embedding_latency = Histogram("coordinator_embedding_latency_seconds", "Embedding request received "
                                           "to its answer", buckets=LATENCY_BUCKETS, registry=r)
        self.embeddings_running = Gauge("coordinator_embedding_requests_running", "Embedding requests on a worker "
                                        "now", registry=r)

    def _response_cache(self, r: CollectorRegistry) -> None:
        self.cache_lookups = Counter("coordinator_response_cache_lookups", "Response cache lookups of cacheable "
                                     "requests", ["outcome"], registry=r)
        self.cache_evictions = Counter("coordinator_response_cache_evictions",
                                       "Entries evicted (LRU bounds or TTL)", registry=r)
        self.cache_failures = Counter("coordinator_response_cache_failures",
                                      "Times the response cache failed and disabled itself (at most once a "
                                      "process: it stays off until a restart)", registry=r)
        self.cache_bytes = Gauge("coordinator_response_cache_bytes", "Bytes of recorded streams held", registry=r)
        self.cache_entries = Gauge("coordinator_response_cache_entries", "Entries held", registry=r)

    def _access(self, r: CollectorRegistry) -> None:
        self.requests_by_key = Counter("coordinator_requests_by_key", "Requests let in, by API key id (a hash "
                                       "prefix, never the key)", ["key_id"], registry=r)
        self.unauthorized = Counter("coordinator_unauthorized_requests", "Requests refused for a missing or wrong "
                                    "API key", registry=r)
        # Per tenant (one per configured tenant, "default" without keys): what fair shares count.
        self.tenant_tokens = Counter("coordinator_tenant_tokens", "Tokens served per tenant: prompt (counted when "
                                     "a worker admits the request) and generated (as relayed)", ["tenant", "kind"],
                                     registry=r)
        self.tenant_queue_wait = Histogram("coordinator_tenant_queue_wait_seconds", "Time a tenant's requests "
                                           "spent in the admission queue", ["tenant"], buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.tenant_refusals = Counter("coordinator_tenant_refusals", "Requests refused before their first byte, "
                                       "per tenant and reason", ["tenant", "reason"], registry=r)

    def watch(self, alive: Callable[[], int], stale: Callable[[], int], reserved_kv: Callable[[], int],
              queued: Callable[[], int] = lambda: 0, breakers_open: Callable[[], int] = lambda: 0,
              embeddings_running: Callable[[], int] = lambda: 0) -> None:
        """Gauges read at scrape time from O(1) counts."""
        self.embeddings_running.set_function(embeddings_running)
        self.workers.labels(state="alive").set_function(alive)
        self.workers.labels(state="stale").set_function(stale)
        self.reserved_kv.set_function(reserved_kv)
        self.queue_length.set_function(queued)
        self.breakers_open.set_function(breakers_open)

    def dequeued(self, outcome: str, waited: float, tenant: str = "") -> None:
        """One wait in the queue ended: `admitted`, or the reason it did not."""
        self.queue_outcomes.labels(outcome=outcome).inc()
        self.queue_wait.observe(waited)
        self.tenant_queue_wait.labels(tenant=tenant_label(tenant)).observe(waited)

    def admitted(self) -> None:
        self.admission.labels(outcome="admitted", reason="").inc()

    def rejected(self, reason: str) -> None:
        self.admission.labels(outcome="rejected", reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
