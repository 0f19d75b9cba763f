"""Wire types of worker load: heartbeats, worker health and session listings.

Owns: what a worker tells the coordinator about its capacity and what `/worker/health` returns.
Must not: compute load (the worker does) or judge it (the coordinator's registry and scheduler do).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from protocol.worker import (
    MAX_EMBED_DIMENSIONS,
    MAX_EMBED_INPUTS,
    MAX_STREAM_REF,
    MODEL_NAME_PATTERN,
    PREFIX_BLOCK_PATTERN,
    PROTOCOL_VERSION,
    TENANT_PATTERN,
)

ModelName = Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN)]
TenantName = Annotated[str, StringConstraints(pattern=TENANT_PATTERN)]
# Ids and URLs end up in logs, metrics labels and headers: no whitespace, no control characters.
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
WORKER_URL_PATTERN = r"^https?://[A-Za-z0-9._~%:\[\]-]+(/[A-Za-z0-9._~%/-]*)?$"
# llama.cpp's own limit on a context's sequences (LLAMA_MAX_SEQ); a worker's --max-sessions is bounded
# by it, so a heartbeat that claims more is a lie, refused, not a capacity to schedule on.
MAX_SESSIONS = 256
MAX_BYTES = 1 << 50  # a pebibyte of KV cache: far past any device, far below a 400-digit number
MAX_TOKENS = 1 << 24
SESSION_DIGEST_PATTERN = r"^[0-9a-f]{16}$"
# Prefix blocks a heartbeat lists at most: with everything else it stays well inside the coordinator's
# 64 KiB limit on a heartbeat's body (19 bytes each as JSON).
MAX_HELD_PREFIX_BLOCKS = 2048
# Seconds after which a worker beats again to a coordinator it has not reached yet (down, restarted, new,
# or refusing), instead of waiting its whole interval. A coordinator takes client traffic only once it
# has heard from the pool, and waits about two of these for the rest of the workers after the first.
REACH_RETRY = 0.5
# Tenants a heartbeat lists at most (those with the most running, then the most served): at most about
# 160 bytes each as JSON, so the largest heartbeat stays inside the 64 KiB limit on its body
# (tests/coordinator/pool/test_heartbeat.py).
MAX_HEARTBEAT_TENANTS = 64
# Models a worker offers from its folder (`--model-dir`) that a heartbeat lists at most, and the longest
# reason one is not offered: all full, about 34 KiB as JSON.
MAX_OFFERED = 32
MAX_OFFER_REASON = 200
OfferState = Literal["loaded", "offered", "unavailable", "too_large"]
MAX_POOL_WORKERS = 1_000_000  # the workers a coordinator may say it knows (HeartbeatAck, Heartbeat)
JOIN_SETTLE = 2 * REACH_RETRY


@functools.lru_cache(maxsize=4096)  # a request asks for its session's digest several times
def session_digest(tenant: str, session_id: str) -> str:
    """What a heartbeat says of a session it holds: 8 bytes of BLAKE2b over its tenant and id, so
    every coordinator can find a session's worker without the ids crossing in the clear."""
    return hashlib.blake2b(f"{tenant}\0{session_id}".encode(), digest_size=8).hexdigest()


class TenantUse(BaseModel):
    """What one tenant has running on a worker, and what the worker has served it since it started."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tenant: str = Field(pattern=TENANT_PATTERN)
    running: int = Field(default=0, ge=0, le=MAX_SESSIONS, description="its requests generating now")
    prompt_tokens: int = Field(default=0, ge=0, le=1 << 62, description="prompt tokens of its requests that "
                               "ended here, in all (a counter: it only grows while the worker runs)")
    generated_tokens: int = Field(default=0, ge=0, le=1 << 62, description="tokens generated for its requests "
                                  "that ended here, in all")


class WorkerLoad(BaseModel):
    """A worker's capacity and use, in the units its admission decides on."""

    # Strict: a number is a JSON number (not "5", not true), and every claim has a ceiling.
    model_config = ConfigDict(extra="forbid", strict=True)

    sessions: int = Field(ge=0, le=MAX_SESSIONS,
                          description="sequences holding KV now (streaming or kept for a next turn)")
    max_sessions: int = Field(ge=1, le=MAX_SESSIONS)
    active_streams: int = Field(ge=0, le=MAX_SESSIONS, description="requests generating or queued now")
    queue_depth: int = Field(ge=0, le=MAX_SESSIONS, description="admitted requests not yet in the decode batch")
    kv_used_bytes: int = Field(ge=0, le=MAX_BYTES, description="bytes of KV cache holding tokens now")
    kv_reserved_bytes: int = Field(ge=0, le=MAX_BYTES, description="bytes promised to admitted requests (>= used)")
    kv_capacity_bytes: int = Field(ge=1, le=MAX_BYTES)
    bytes_per_token: int = Field(ge=1, le=MAX_TOKENS, description="KV bytes one token takes, read from the model")
    session_max_tokens: int = Field(ge=1, le=MAX_TOKENS,
                                    description="most tokens one session may hold (prompt + output)")
    idle_sessions: int = Field(default=0, ge=0, le=MAX_SESSIONS,
                               description="sessions kept for a next turn with no stream now: evictable when full")
    idle_kv_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="KV bytes those idle sessions hold")
    max_prompt_bytes: int = Field(default=0, ge=0, le=MAX_BYTES,
                                  description="the longest prompt (UTF-8 bytes of its text) that can fit in a "
                                  "session: session_max_tokens x the vocabulary's longest token, since no token "
                                  "covers more bytes; the coordinator refuses a longer one before any worker "
                                  "tokenizes it. 0: not reported (no bound)")
    draining: bool = False
    backend: Literal["cpu", "gpu"] = Field(default="cpu", description="where llama.cpp computes: gpu once any "
                                           "layer is offloaded (then the KV of those layers lives on the device)")
    gpu_layers: int = Field(default=0, ge=0, le=1 << 20, description="layers offloaded to the GPU")
    streams: list[Annotated[int, Field(ge=0, le=MAX_STREAM_REF)]] = Field(
        default_factory=list, max_length=2 * MAX_SESSIONS,
        description="the coordinators' references (`X-Stream-Ref`) of the streams holding a session now, which "
                    "`sessions` counts, and of those parked (`parked`)")
    held: list[Annotated[str, StringConstraints(pattern=SESSION_DIGEST_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_SESSIONS,
        description="`session_digest` of every named session it holds (streaming or kept), so that every "
                    "coordinator knows where a session is, whichever one served its last turn")

    parkable: int = Field(default=0, ge=0, le=MAX_SESSIONS,
                          description="batch requests running now that an interactive request could park")
    parked: int = Field(default=0, ge=0, le=MAX_SESSIONS,
                        description="batch requests parked now (their cells in host memory, no sequence held): "
                        "`streams` lists them, `sessions` does not count them")
    tenants: list[TenantUse] = Field(
        default_factory=list, max_length=MAX_HEARTBEAT_TENANTS,
        description="each tenant it serves: running now and served in all, those with the most running first; "
                    "every coordinator adds what the others gave a tenant to its fair-share counter")
    waiting: list[TenantName] = Field(
        default_factory=list, max_length=MAX_HEARTBEAT_TENANTS,
        description="tenants some coordinator said (`HeartbeatAck.waiting`, its last answer) have requests waiting "
                    "for this worker's model: each coordinator sees the others' waiting demand")
    prefixes: list[Annotated[str, StringConstraints(pattern=PREFIX_BLOCK_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_HELD_PREFIX_BLOCKS,
        description="the prefix blocks (`GenerateRequest.prefix_blocks`) of the prompts its sequences' cells "
                    "hold now, running, kept or left over for reuse, the most recently used first; at most "
                    "MAX_HELD_PREFIX_BLOCKS")

    @model_validator(mode="after")
    def _consistent(self) -> WorkerLoad:
        if self.sessions > self.max_sessions:
            raise ValueError(f"sessions {self.sessions} > max_sessions {self.max_sessions}")
        if len(self.streams) > self.sessions + self.parked:
            raise ValueError(f"{len(self.streams)} streams listed > sessions {self.sessions} + parked {self.parked}")
        if self.parkable > self.sessions:
            raise ValueError(f"parkable {self.parkable} > sessions {self.sessions}")
        if len(self.held) > self.sessions:
            raise ValueError(f"{len(self.held)} sessions held > sessions {self.sessions}")
        if self.idle_sessions > self.sessions:
            raise ValueError(f"idle_sessions {self.idle_sessions} > sessions {self.sessions}")
        if sum(t.running for t in self.tenants) > self.sessions:
            raise ValueError(f"tenants run {sum(t.running for t in self.tenants)} sequences > sessions {self.sessions}")
        # What the context allows: one session cannot hold more than the whole context's cells.
        if self.session_max_tokens * self.bytes_per_token > self.kv_capacity_bytes:
            raise ValueError(f"session_max_tokens {self.session_max_tokens} x bytes_per_token "
                             f"{self.bytes_per_token} > kv_capacity_bytes {self.kv_capacity_bytes}")
        return self

    def clamped(self) -> WorkerLoad:
        """The same load with its capacity cut to what its own sessions could ever use: a claim of more
        KV than `max_sessions` full sessions hold says nothing the scheduler could use, and a forged
        huge one would make every other worker look full by comparison."""
        ceiling = min(self.kv_capacity_bytes, self.bytes_per_token * self.session_max_tokens * self.max_sessions)
        if max(self.kv_capacity_bytes, self.kv_used_bytes, self.kv_reserved_bytes, self.idle_kv_bytes) <= ceiling:
            return self
        return self.model_copy(update={"kv_capacity_bytes": ceiling,
                                       "kv_used_bytes": min(self.kv_used_bytes, ceiling),
                                       "kv_reserved_bytes": min(self.kv_reserved_bytes, ceiling),
                                       "idle_kv_bytes": min(self.idle_kv_bytes, ceiling)})


class EmbeddingService(BaseModel):
    """What a worker that serves `POST /worker/embed` says about it in its heartbeats."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dimensions: int = Field(ge=1, le=MAX_EMBED_DIMENSIONS, description="the size of its vectors")
    max_tokens: int = Field(ge=1, le=MAX_TOKENS, description="the longest input it embeds, in tokens")
    pooling: Literal["mean", "cls", "last"] = Field(description="how a sequence's token states become one vector")
    capacity: int = Field(ge=1, le=MAX_EMBED_INPUTS, description="embedding requests it holds at once (running "
                          "or queued); past them it refuses with 503 `embeddings_full`")


class OfferedModel(BaseModel):
    """One model file of a worker's folder (`--model-dir`), as the worker judged it (worker/models/catalog.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: ModelName = Field(max_length=128)
    aliases: list[ModelName] = Field(default_factory=list, max_length=4)
    identity: str = Field(default="", max_length=128, pattern=r"^[A-Za-z0-9:._-]*$",
                          description="its file's identity digest: a file replaced under the same name differs")
    state: OfferState = Field(description="loaded (served now), offered (it could load it), unavailable (not a "
                              "model it can read) or too_large (past its memory budget)")
    need_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="its weights and its sessions' KV cache")
    reason: str = Field(default="", max_length=MAX_OFFER_REASON, description="why it is not offered")
    beside: bool = Field(default=False, description="offered, and loaded beside the models the worker serves "
                         "now, unloading none (WORKER_MAX_MODELS: a free slot, and the memory for it)")


class Heartbeat(BaseModel):
    """`POST /coordinator/health/heartbeat` body, sent by each worker every interval."""

    model_config = ConfigDict(extra="forbid", strict=True)

    worker_id: str = Field(pattern=WORKER_ID_PATTERN)
    url: str = Field(max_length=512, pattern=WORKER_URL_PATTERN, description="where the coordinator reaches the worker")
    model: ModelName = Field(max_length=256, description="the public name of the model it serves")
    aliases: list[ModelName] = Field(default_factory=list, max_length=16, description="other names it answers to")
    model_identity: str = Field(default="", max_length=128, pattern=r"^[A-Za-z0-9:._-]*$",
                                description="what the model is beyond its name (a digest of its file): cached "
                                "answers are keyed by it, so a model swapped under the same name misses")
    protocol: int = Field(default=PROTOCOL_VERSION, description="version of protocol.worker it speaks")
    embeddings: EmbeddingService | None = Field(default=None, description="set when it serves embeddings "
                                                "(`POST /worker/embed`); only then are they routed to it")
    load: WorkerLoad
    timestamp: float = Field(description="the worker's clock, Unix seconds, when the heartbeat was made")
    pool_workers: int = Field(default=0, ge=0, le=MAX_POOL_WORKERS, description="the most alive workers a coordinator "
                              "said it knows, in its last answer to this worker: a coordinator that has just "
                              "started is ready once it knows as many (coordinator/pool/readiness.py)")
    leaving: bool = Field(default=False, description="its last beat: the worker stops now (after its drain), so "
                          "the coordinator stops scheduling on it at once rather than when its beats stop")
    swapping: ModelName | Literal[""] = Field(default="", max_length=128, description="the model of its folder it "
                                              "is swapping to (draining the one it served, then loading it); "
                                              "\"\": none")
    standby: bool = Field(default=False, description="no model loaded: the one it served (`model`) was unloaded "
                          "after WORKER_KEEP_ALIVE idle; it drains, holds nothing, and loads one of its `offered` "
                          "models when asked")
    offered: list[OfferedModel] = Field(default_factory=list, max_length=MAX_OFFERED,
                                        description="the models of its folder (`--model-dir`), the one it serves "
                                        "among them as loaded; empty without a folder")


class WorkerHealth(BaseModel):
    """`GET /worker/health`: 503 with status `loading` until the model is loaded, then 200; 200 with
    `standby` while its model is unloaded (idle past WORKER_KEEP_ALIVE) and none is loaded."""

    status: Literal["loading", "ok", "draining", "standby"]
    worker_id: str
    model: str
    aliases: list[str] = Field(default_factory=list)
    load: WorkerLoad | None = None
    embeddings: EmbeddingService | None = None
    batch_steps: int = Field(default=0, ge=0, description="decode steps run since start")


class SessionInfo(BaseModel):
    session_id: str
    tenant: str = Field(default="", description="the tenant whose session it is: ids are per tenant, so two "
                        "tenants may each hold a session of the same id")
    tokens: int = Field(ge=0, description="tokens the session holds in the KV cache")
    kv_bytes: int = Field(ge=0)
    idle_seconds: float = Field(ge=0.0)
    busy: bool = Field(description="a request is generating on it now")


class SessionList(BaseModel):
    ttl_seconds: float
    sessions: list[SessionInfo]
