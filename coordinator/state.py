"""Everything one coordinator app holds at run time, built in its lifespan and kept on `app.state`.

Owns: wiring the parts together (shared clock, metrics gauges reading the registry and admission).
Must not: hold behaviour of its own; no module-level instances, so two apps can run side by side.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.admission.capacity import Admission
from coordinator.admission.embeddings import EmbeddingAdmission
from coordinator.admission.fairness import FairShares
from coordinator.admission.limits import Limits
from coordinator.admission.queue import AdmissionQueue
from coordinator.admission.waiting import WaitingRoom
from coordinator.affinity.conversations import ConversationTable
from coordinator.affinity.placement import Affinity
from coordinator.affinity.prefixes import PrefixIndex
from coordinator.affinity.sessions import SessionTable
from coordinator.attempts import Attempts, EmbeddingAttempts, Tries
from coordinator.auth import ApiKeys
from coordinator.cache import ResponseCache
from coordinator.clock import Clock
from coordinator.metrics import CoordinatorMetrics
from coordinator.pool.breaker import Breakers
from coordinator.pool.loads import ModelLoads
from coordinator.pool.moves import SessionMover
from coordinator.pool.probe import PROBES_AT_ONCE, Probe
from coordinator.pool.readiness import Readiness
from coordinator.pool.records import StoredResponses
from coordinator.pool.registry import Registry
from coordinator.relay.dispatch import Dispatcher
from coordinator.relay.embeddings import EmbeddingDispatcher
from coordinator.relay.requests import RequestLog
from coordinator.relay.stream import Relay
from coordinator.relay.tokens import TokenizerDispatcher
from coordinator.scheduling import Policy
from coordinator.settings import Settings
from coordinator.tokenizing import Tokenizing
from coordinator.upstream import AiohttpWorkerClient, WorkerClient, with_token
from serving.tracing import Tracing


@dataclass(slots=True)
class CoordinatorState:
    settings: Settings
    clock: Clock
    registry: Registry
    sessions: SessionTable
    conversations: ConversationTable
    admission: Admission
    queue: AdmissionQueue
    fair: FairShares  # the tenants' fair-share counters, which order the queue's lines
    limits: Limits  # each API key's counters against its limits
    prefixes: PrefixIndex
    cache: ResponseCache
    policy: Policy
    turns: Iterator[int]  # requests scheduled, for round-robin
    rng: random.Random  # the random policy's seeded source
    metrics: CoordinatorMetrics
    client: WorkerClient  # carries the worker token (upstream.with_token)
    attempts: Attempts
    breakers: Breakers
    probe: Probe
    log: logging.Logger
    started_at: float  # wall time the app started (OpenAI's `created` of the models it lists)
    affinity: Affinity
    requests: RequestLog  # the account (metrics, log line) of every request
    # Embedding requests: their own slots, queue and policy (no sequence, no KV), the same registry,
    # breakers, worker client and error family.
    embedding_admission: EmbeddingAdmission
    embedding_queue: AdmissionQueue
    embedding_policy: Policy
    embedder: EmbeddingAttempts
    mover: SessionMover  # draining workers' kept sessions, moved to the others
    loads: ModelLoads  # models offered from workers' folders, loaded when asked for (pool/loads.py)
    waiting: WaitingRoom  # what a request waits for in the queue, and in which line (admission/waiting.py)
    readiness: Readiness  # whether it has heard from the pool (joins a shared port and answers ready then)
    tokenizing: Tokenizing  # /tokenize, /detokenize, /tokenizer_info: the model's workers, tried in turn
    stored: StoredResponses  # stored Responses, on the workers that ran them (pool/records.py)
    api_keys: ApiKeys | None = None  # None: no client key is needed
    tracing: Tracing | None = None  # None: this coordinator exports no traces (no OTEL_* set)
    # The relays of the streams open now (drain ends them at its deadline), and whether it is draining.
    streams: set[Relay] = field(default_factory=set)
    draining: bool = False


def _forget(worker_id: str, prefixes: PrefixIndex, fair: FairShares) -> None:
    """A worker removed from the registry: what it held or ran no longer counts."""
    prefixes.forget_worker(worker_id)
    fair.forget(worker_id)


def build_state(settings: Settings, clock: Clock, client: WorkerClient | None,
                tracing: Tracing | None = None) -> CoordinatorState:
    """Runs inside the event loop (the app's lifespan): the worker client's pool belongs to it."""
    prefixes = PrefixIndex(block_chars=settings.prefix_block_chars, capacity=settings.prefix_index_blocks)
    api_keys = ApiKeys.from_setting(settings.api_keys)
    fair = FairShares(prompt_weight=settings.fair_prompt_weight, output_weight=settings.fair_output_weight,
                      weights=api_keys.weights if api_keys is not None else None,
                      idle_grace=settings.fair_idle_grace, now=clock.monotonic)
    registry = Registry(stale_after=settings.stale_after, dead_after=settings.dead_after,
                        on_removed=lambda record: _forget(record.worker_id, prefixes, fair),
                        on_identity_gone=lambda identity: cache.forget_identity(identity))
    sessions = SessionTable(settings.session_table_size, held_by=registry.holder)
    queue = AdmissionQueue(size=settings.queue_size, timeout=settings.queue_timeout,
                           retry_after=settings.retry_after, fair=fair if settings.fair_share else None)
    admission = Admission(registry, clock, retry_after=settings.retry_after, on_release=queue.wake,
                          fair=fair if settings.fair_share and api_keys is not None else None)
    embedding_queue = AdmissionQueue(size=settings.queue_size, timeout=settings.queue_timeout,
                                     retry_after=settings.retry_after)
    embedding_admission = EmbeddingAdmission(registry, clock, retry_after=settings.retry_after,
                                             on_release=embedding_queue.wake)
    metrics = CoordinatorMetrics()
    breakers = Breakers(registry, clock.monotonic, threshold=settings.breaker_failures,
                        cooldown=settings.breaker_cooldown, max_cooldown=settings.breaker_max_cooldown,
                        on_change=lambda to: metrics.breaker_transitions.labels(to=to).inc())
    cache = ResponseCache(entries=settings.cache_entries, max_bytes=settings.cache_bytes, ttl=settings.cache_ttl,
                          clock=clock.time,
                          path=Path(settings.cache_path) if settings.cache_path else None,
                          on_evict=metrics.cache_evictions.inc, on_failure=metrics.cache_failures.inc)
    metrics.cache_bytes.set_function(lambda: cache.bytes)
    metrics.cache_entries.set_function(lambda: len(cache))
    metrics.watch(alive=lambda: registry.alive_count, stale=lambda: registry.stale_count,
                  reserved_kv=lambda: admission.in_flight_kv_bytes,
                  queued=lambda: queue.length + embedding_queue.length,
                  # At scrape time only: O(workers), like the listing.
                  breakers_open=lambda: sum(1 for w in registry.all() if w.breaker_trips),
                  embeddings_running=lambda: embedding_admission.in_flight)
    if client is None:
        client = AiohttpWorkerClient(max_connections=settings.worker_max_connections,
                                     connect_timeout=settings.worker_connect_timeout,
                                     read_timeout=settings.worker_read_timeout,
                                     keepalive_expiry=settings.worker_keepalive_expiry)
    client = with_token(client, settings.worker_token)  # the one place the worker token goes in
    attempts = Attempts(Dispatcher(client, first_event_timeout=settings.worker_first_event_timeout),
                        admission, breakers, metrics, max_attempts=settings.max_failover_attempts,
                        retry_after=settings.retry_after, fair=fair)
    conversations = ConversationTable(settings.conversation_table_size)
    loads = ModelLoads(registry, client, now=clock.monotonic, retry_after=settings.retry_after)
    log = logging.getLogger("coordinator.requests")
    return CoordinatorState(
        settings=settings, clock=clock, registry=registry, sessions=sessions,
        conversations=conversations, admission=admission, queue=queue, prefixes=prefixes, cache=cache,
        policy=Policy.build(stale_after=settings.stale_after, scorers=settings.scorers,
                           balance_threshold=settings.prefix_balance_threshold, routing=settings.routing_policy,
                           latency_half_life=settings.latency_half_life),
        turns=itertools.count(), rng=random.Random(settings.routing_seed), metrics=metrics,
        client=client, attempts=attempts, breakers=breakers, log=log,
        probe=Probe(client, timeout=settings.worker_probe_timeout, at_once=PROBES_AT_ONCE),
        affinity=Affinity(sessions, conversations, prefixes, registry),
        requests=RequestLog(metrics, registry, log, now=clock.monotonic, refusal_log_rate=settings.refusal_log_rate),
        started_at=clock.time(), api_keys=api_keys, fair=fair, limits=Limits(clock.time), tracing=tracing,
        embedding_admission=embedding_admission, embedding_queue=embedding_queue,
        embedding_policy=Policy.build_embeddings(stale_after=settings.stale_after, routing=settings.routing_policy,
                                                 latency_half_life=settings.latency_half_life),
        embedder=EmbeddingAttempts(
            EmbeddingDispatcher(client, timeout=settings.embedding_timeout),
            embedding_admission, breakers, metrics, max_attempts=settings.max_failover_attempts,
            timeout=settings.embedding_timeout, now=clock.monotonic, retry_after=settings.retry_after),
        loads=loads, waiting=WaitingRoom(registry, loads, default_model=settings.default_model,
                                         any_model_name=settings.any_model_name, model_loads=settings.model_loads),
        mover=SessionMover(registry, sessions.remember, client, metrics,
                           timeout=settings.session_move_timeout, max_bytes=settings.session_move_max_bytes,
                           deadline=settings.session_move_deadline, now=clock.monotonic, tracing=tracing),
        readiness=Readiness(clock=clock, join_wait=settings.join_after, workers=lambda: registry.alive_count,
                            gated=settings.reuse_port and settings.own_port > 0),
        tokenizing=Tokenizing(registry, Policy.build_tokenizer(stale_after=settings.stale_after),
                              Tries(breakers, metrics),
                              TokenizerDispatcher(client, read_timeout=settings.worker_read_timeout), settings,
                              now=clock.monotonic),
        stored=StoredResponses(registry, client, timeout=settings.responses_store_timeout,
                               limit=settings.responses_record_bytes))
