"""Wire types only the coordinator serves: heartbeat acknowledgements and its health listings.

Owns: the bodies of `POST /coordinator/health/heartbeat` (200), `GET /coordinator/health` and
`GET /coordinator/health/workers`. Must not: hold logic; the coordinator fills these in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from protocol.health import (
    MAX_HEARTBEAT_TENANTS,
    MAX_POOL_WORKERS,
    EmbeddingService,
    OfferedModel,
    TenantName,
)

WorkerState = Literal["alive", "stale"]


class HeartbeatAck(BaseModel):
    """The coordinator's answer to a heartbeat it accepted."""

    worker_id: str
    state: WorkerState
    heartbeat_interval: float = Field(description="seconds the coordinator expects between heartbeats")
    workers: int = Field(default=0, ge=0, le=MAX_POOL_WORKERS, description="alive workers this coordinator knows: "
                         "the worker passes "
                         "the most it was told on to every coordinator (`Heartbeat.pool_workers`)")
    waiting: list[TenantName] = Field(default_factory=list, max_length=MAX_HEARTBEAT_TENANTS,
                                      description="tenants with requests waiting in this coordinator's queue for "
                                      "the worker's model: the worker passes them on to every coordinator "
                                      "(`WorkerLoad.waiting`)")


class WorkerCounts(BaseModel):
    alive: int = Field(ge=0, description="heartbeating now: schedulable")
    stale: int = Field(ge=0, description="missed heartbeats: not scheduled, removed when dead")
    total: int = Field(ge=0)


class CoordinatorReadiness(BaseModel):
    """`GET /coordinator/ready`: 200 once the coordinator has heard from the pool (a worker registered
    and about a second passed for the rest, or `JOIN_WAIT` passed with none); 503 while it is still
    joining, and once it is draining. A load balancer or Kubernetes sends client traffic only to a
    ready one; with a shared port (REUSE_PORT) the process joins the port at the same moment."""

    status: Literal["ready", "joining", "draining"]
    workers: int = Field(ge=0, description="alive workers it knows")


class CoordinatorHealth(BaseModel):
    """`GET /coordinator/health`: 200 while the coordinator runs, whatever its workers' state; 503
    with status `draining` once it is shutting down (a load balancer should move away)."""

    status: Literal["ok", "no_workers", "draining"]
    workers: WorkerCounts
    models: list[str] = Field(description="models served by at least one alive worker")
    requests_running: int = Field(ge=0)
    kv_reserved_bytes: int = Field(ge=0, description="KV bytes reserved by the coordinator's in-flight requests")
    cache: Literal["off", "on", "disabled"] = Field(
        default="off", description="the response cache: not configured, working, or disabled after a failure")
    cache_failure: str | None = Field(default=None, description="why the response cache disabled itself")


class WorkerStatus(BaseModel):
    worker_id: str
    url: str
    model: str
    state: WorkerState
    heartbeat_age_s: float = Field(ge=0.0, description="seconds since its last heartbeat arrived")
    sessions: int = Field(ge=0, description="last reported sessions plus the coordinator's unreported ones")
    max_sessions: int
    active_streams: int
    queue_depth: int
    kv_used_bytes: int = Field(description="as last reported")
    kv_reserved_bytes: int = Field(description="last reported reservation plus the coordinator's unreported ones")
    kv_capacity_bytes: int
    bytes_per_token: int
    session_max_tokens: int
    draining: bool
    score: float | None = Field(description="the policy's weighted total (lower is better); null if stale")
    score_parts: dict[str, float] = Field(default_factory=dict,
                                          description="each scorer's weighted part of the score")
    breaker: Literal["closed", "open", "probing"] = "closed"
    in_flight: int = Field(default=0, description="streams the coordinator has on it now")
    ttft_ewma_ms: float | None = Field(default=None, description="recent time to first token through it")
    picked_age_s: float | None = Field(default=None, description="seconds since the coordinator last reserved "
                                       "on it (score ties go to the oldest); null: never")
    embeddings: EmbeddingService | None = Field(default=None, description="what it says it embeds (size, "
                                                "longest input, pooling, requests at once); null: it does not")
    embedding_requests: int = Field(default=0, ge=0, description="the coordinator's embedding requests on it now")
    offered: list[OfferedModel] = Field(default_factory=list, description="the models of its folder (--model-dir) "
                                        "with each one's state, need and reason, as its latest heartbeat says")
    swapping: str = Field(default="", description="the model of its folder it swaps to now; \"\": none")
    standby: bool = Field(default=False, description="no model loaded: `model` was unloaded, idle past the "
                          "worker's keep-alive; it loads one of its folder's models when asked")
    last_swap_s: float | None = Field(default=None, description="seconds its last model swap took (its drain and "
                                      "the load), from its heartbeats; null: none seen")


class WorkerStatusList(BaseModel):
    routing_policy: str = Field(default="score", description="the named policy ordering eligible workers")
    scorers: str = Field(default="", description="the scheduling policy's scorers and weights")
    workers: list[WorkerStatus]
