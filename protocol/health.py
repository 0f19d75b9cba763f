"""Wire types of worker load: heartbeats, worker health and session listings.

Owns: what a worker tells the coordinator about its capacity and what `/worker/health` returns.
Must not: compute load (the worker does) or judge it (the coordinator's registry and scheduler do).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from protocol.worker import MODEL_NAME_PATTERN, PROTOCOL_VERSION

ModelName = Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN)]


class WorkerLoad(BaseModel):
    """A worker's capacity and use, in the units its admission decides on."""

    model_config = ConfigDict(extra="forbid")

    sessions: int = Field(ge=0, description="sequences holding KV now (streaming or kept for a next turn)")
    max_sessions: int = Field(ge=1)
    active_streams: int = Field(ge=0, description="requests generating or queued now")
    queue_depth: int = Field(ge=0, description="admitted requests not yet in the decode batch")
    kv_used_bytes: int = Field(ge=0, description="bytes of KV cache holding tokens now")
    kv_reserved_bytes: int = Field(ge=0, description="bytes promised to admitted requests (>= used)")
    kv_capacity_bytes: int = Field(ge=1)
    bytes_per_token: int = Field(ge=1, description="KV bytes one token takes, read from the model")
    session_max_tokens: int = Field(ge=1, description="most tokens one session may hold (prompt + output)")
    draining: bool = False


class Heartbeat(BaseModel):
    """`POST /coordinator/health/heartbeat` body, sent by each worker every interval."""

    model_config = ConfigDict(extra="forbid")

    worker_id: str = Field(min_length=1, max_length=128)
    url: str = Field(min_length=1, max_length=512, description="where the coordinator reaches the worker")
    model: str = Field(min_length=1, max_length=256, description="the public name of the model it serves")
    aliases: list[ModelName] = Field(default_factory=list, max_length=16, description="other names it answers to")
    protocol: int = Field(default=PROTOCOL_VERSION, description="version of protocol.worker it speaks")
    load: WorkerLoad
    timestamp: float = Field(description="the worker's clock, Unix seconds, when the heartbeat was made")


class WorkerHealth(BaseModel):
    """`GET /worker/health`: 503 with status `loading` until the model is loaded, then 200."""

    status: Literal["loading", "ok", "draining"]
    worker_id: str
    model: str
    aliases: list[str] = Field(default_factory=list)
    load: WorkerLoad | None = None
    batch_steps: int = Field(default=0, ge=0, description="decode steps run since start")


class SessionInfo(BaseModel):
    session_id: str
    tokens: int = Field(ge=0, description="tokens the session holds in the KV cache")
    kv_bytes: int = Field(ge=0)
    idle_seconds: float = Field(ge=0.0)
    busy: bool = Field(description="a request is generating on it now")


class SessionList(BaseModel):
    ttl_seconds: float
    sessions: list[SessionInfo]
