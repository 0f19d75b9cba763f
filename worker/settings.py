"""Worker settings: one validated model, read from the environment and command-line flags.

Owns: every tunable of a worker, its default, its environment name and its flag.
Must not: read the environment anywhere else; `create_app` receives a `WorkerSettings`.
Flags win over environment variables, which win over defaults. Invalid values are all reported at once.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.health import MAX_SESSIONS
from protocol.worker import MAX_EMBED_INPUTS, MODEL_NAME_PATTERN
from worker.provision import DEFAULT_MODEL_PATH

MAX_MODELS = 8  # WORKER_MAX_MODELS: the slots a worker serves models in at once (worker/api/slots.py)
SLOTS_PATH = "/slots"  # slot k > 0 is reached at <worker URL>/slots/k
MAX_COORDINATORS = 64  # URLs in COORDINATOR_URL, and addresses heartbeaten in all (worker/heartbeat.py)


def slot_prefix(slot: int) -> str:
    """The path before a route of slot `slot` (worker/api/slots.py): "" for the first, the worker itself."""
    return f"{SLOTS_PATH}/{slot}" if slot else ""


# field name -> environment variable (design.md keeps the original system's names where it has them)
ENV_NAMES = {
    "model_path": "MODEL_PATH",
    "model_name": "MODEL_NAME",
    "model_aliases": "MODEL_ALIASES",
    "model_dir": "WORKER_MODEL_DIR",
    "model_memory": "WORKER_MODEL_MEMORY",
    "model_rescan": "WORKER_MODEL_RESCAN",
    "keep_alive": "WORKER_KEEP_ALIVE",
    "keep_alive_max": "WORKER_KEEP_ALIVE_MAX",
    "max_models": "WORKER_MAX_MODELS",
    "worker_id": "WORKER_ID",
    "worker_url": "WORKER_URL",
    "coordinator_url": "COORDINATOR_URL",
    "coordinator_resolve_all": "COORDINATOR_RESOLVE_ALL",
    "worker_token": "WORKER_TOKEN",
    "host": "WORKER_HOST",
    "port": "WORKER_PORT",
    "threads": "WORKER_THREADS",
    "gpu_layers": "N_GPU_LAYERS",
    "ctx_size": "WORKER_CTX_SIZE",
    "max_sessions": "WORKER_MAX_SESSIONS",
    "session_max_tokens": "WORKER_SESSION_MAX_TOKENS",
    "kv_unified": "WORKER_KV_UNIFIED",
    "flash_attn": "WORKER_FLASH_ATTN",
    "prefill_chunk": "WORKER_PREFILL_CHUNK",
    "prefill_stall": "WORKER_PREFILL_STALL",
    "session_ttl": "WORKER_SESSION_TTL",
    "sweep_interval": "WORKER_SWEEP_INTERVAL",
    "heartbeat_interval": "HEARTBEAT_INTERVAL",
    "stream_buffer": "WORKER_STREAM_BUFFER",
    "slow_consumer_deadline": "WORKER_SLOW_CONSUMER_DEADLINE",
    "stream_interval": "WORKER_STREAM_INTERVAL",
    "request_timeout": "WORKER_REQUEST_TIMEOUT",
    "prompt_cache": "WORKER_PROMPT_CACHE",
    "prefix_min_tokens": "WORKER_PREFIX_MIN_TOKENS",
    "host_cache_mib": "WORKER_HOST_CACHE_MIB",
    "cut_batch_steps": "WORKER_CUT_BATCH_STEPS",
    "batch_slowdown": "WORKER_BATCH_SLOWDOWN",
    "embeddings": "WORKER_EMBEDDINGS",
    "embedding_threads": "WORKER_EMBEDDING_THREADS",
    "embedding_ctx": "WORKER_EMBEDDING_CTX",
    "embedding_batch_inputs": "WORKER_EMBEDDING_BATCH_INPUTS",
    "embedding_queue": "WORKER_EMBEDDING_QUEUE",
    "embedding_timeout": "WORKER_EMBEDDING_TIMEOUT",
    "kv_transfers": "WORKER_KV_TRANSFERS",
    "kv_transfer_max_bytes": "WORKER_KV_TRANSFER_MAX_BYTES",
    "responses_per_tenant": "WORKER_RESPONSES_PER_TENANT",
    "responses_bytes_per_tenant": "WORKER_RESPONSES_BYTES_PER_TENANT",
    "responses_ttl": "WORKER_RESPONSES_TTL",
    "peer_prefix_min_tokens": "WORKER_PEER_PREFIX_MIN_TOKENS",
    "peer_prefix_timeout": "WORKER_PEER_PREFIX_TIMEOUT",
    "room_wait": "WORKER_ROOM_WAIT",
    "drain_timeout": "WORKER_DRAIN_TIMEOUT",
    "max_body_bytes": "WORKER_MAX_BODY_BYTES",
    "max_header_bytes": "WORKER_MAX_HEADER_BYTES",
    "max_headers": "WORKER_MAX_HEADERS",
    "header_timeout": "WORKER_HEADER_TIMEOUT",
    "body_timeout": "WORKER_BODY_TIMEOUT",
    "max_connections": "WORKER_MAX_CONNECTIONS",
    "log_level": "LOG_LEVEL",
    "engine": "WORKER_ENGINE",
    "sim_token_rate": "SIM_TOKEN_RATE",
    "sim_prefill_rate": "SIM_PREFILL_RATE",
    "sim_bytes_per_token": "SIM_BYTES_PER_TOKEN",
}


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path = Field(default=DEFAULT_MODEL_PATH, description="GGUF file to serve")
    model_name: str = Field(default="", pattern=r"^$|" + MODEL_NAME_PATTERN,
                            description="public name of the model; default: derived from the GGUF's general.name")
    model_aliases: tuple[str, ...] = Field(default=(), max_length=16,
                                           description="comma-separated other names requests may use")
    model_dir: Path | None = Field(default=None, description="a folder whose GGUF files the worker offers (its "
                                   "heartbeats list them, with why one cannot be); without --model it serves the "
                                   "first it can, in name order")
    model_memory: int = Field(default=0, ge=0, description="bytes the folder's models may take, weights and KV; "
                              "0: the machine's memory less a margin (the larger of 1 GiB and a tenth)")
    model_rescan: float = Field(default=10.0, ge=0, description="seconds between two reads of the folder: new "
                                "files offered, removed ones withdrawn, and a served model whose file was "
                                "replaced or removed swapped for what is there now; 0: read once, at start")
    keep_alive: float = Field(default=0.0, ge=0, description="seconds a model of the folder stays loaded with "
                              "no request and no kept session, then it is unloaded and the worker holds no model "
                              "until one is asked for (its heartbeats say `standby`); 0: never unloaded. A request's "
                              "`keep_alive` (Ollama's) may only lengthen it, for its own tenant, within "
                              "--keep-alive-max. Needs --model-dir")
    keep_alive_max: float = Field(default=3600.0, ge=-1, description="the longest a request's `keep_alive` keeps a "
                                  "model of the folder loaded once idle (a longer one, or a negative one, gets "
                                  "this); -1: no bound, and a request's negative keep_alive keeps it for good. No "
                                  "request shortens --keep-alive or another tenant's stay")
    max_models: int = Field(default=1, ge=1, le=MAX_MODELS, description="models of the folder loaded at once, "
                            "within --model-memory; each serves under its own worker id and URL "
                            "(worker-<port>.m1 at <url>/slots/1, ...; the first as the worker's own). Needs --model-dir")
    worker_id: str = Field(default="", max_length=128, description="default: worker-<port>")
    worker_url: str = Field(default="", description="URL the coordinator uses; default http://host:port")
    coordinator_url: str = Field(default="http://127.0.0.1:1337", max_length=4096,
                                 description="comma-separated: heartbeats go to every one; empty: none")
    coordinator_resolve_all: bool = Field(default=False, description="heartbeat every address a coordinator "
                                          "URL's name resolves to (a Kubernetes headless Service), each interval")
    worker_token: str = Field(default="", description="shared secret sent with heartbeats")
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=3001, ge=0, le=65535, description="port to listen on")
    threads: int = Field(default=os.cpu_count() or 1, ge=1, le=256, description="llama.cpp threads")
    gpu_layers: int = Field(default=-1, ge=-1, description="layers offloaded to the GPU; -1: all when the "
                            "llama.cpp build can offload, else 0")
    ctx_size: int = Field(default=0, ge=0, description="KV cells in all; 0: derived from the limits")
    max_sessions: int = Field(default=16, ge=1, le=MAX_SESSIONS, description="llama.cpp sequences, busy or idle")
    session_max_tokens: int = Field(default=2048, ge=16, description="KV cells one session may hold")
    kv_unified: bool = Field(default=False, description="one KV buffer shared by all sequences")
    flash_attn: str = Field(default="auto", pattern=r"^(auto|on|off)$", description="llama.cpp's flash attention: "
                            "auto (on where the device runs it, as on the CPU), on or off. On the CPU, off prefills a "
                            "prompt deep in a conversation faster (55 tokens after 400: 1.2x the time of 49 after "
                            "none, 1.55x on) and decodes 8-15% slower (docs/benchmarks.md, \"Flash attention on "
                            "the CPU\")")
    prefill_chunk: int | None = Field(default=None, ge=16, le=8192, description="prompt tokens per decode step, "
                                      "at most; default 64 on the CPU (the least batch llama.cpp's CPU kernels run "
                                      "at full speed), 256 with layers on a GPU")
    prefill_stall: float = Field(default=1.5, ge=0, le=100, description="while sequences are decoding, the steps "
                                 "that carry prompt tokens take at most this many times the decode-only steps' time "
                                 "(measured as it runs; a joining sequence is owed the step it waited out), so a "
                                 "long prompt slows them at most this much; 1 or less: "
                                 "off, every step may carry a chunk")
    session_ttl: float = Field(default=300.0, gt=0, description="idle seconds before a session expires")
    sweep_interval: float = Field(default=1.0, gt=0, description="seconds between expiry sweeps")
    heartbeat_interval: float = Field(default=10.0, gt=0, description="seconds between two heartbeats to each "
                                      "coordinator")
    stream_buffer: int = Field(default=64, ge=1, le=65536, description="items buffered per stream")
    slow_consumer_deadline: float = Field(default=10.0, gt=0, description="seconds a full stream may wait")
    stream_interval: float = Field(default=0.04, ge=0, le=1.0, description="seconds between two hand-overs of "
                                   "running streams' tokens to their responses, at most: steps shorter than this "
                                   "send several tokens a write (a first token and an ending go at once); 0: "
                                   "every step")
    prompt_cache: bool = Field(default=True, description="freed sequences keep their tokens for a next prompt")
    prefix_min_tokens: int = Field(default=8, ge=1, le=1 << 20,
                                   description="split KV: copy another sequence's cells when they hold at least "
                                               "this many more leading prompt tokens than the request's own")
    host_cache_mib: int = Field(default=256, ge=0, le=1 << 20,
                                description="split KV, prompt cache on: MiB of host memory that keep an "
                                            "interactive request's leftover cells when another request (a batch "
                                            "job's, say) takes their sequence, for the same tenant's next prompt "
                                            "that starts with them; 0: off")
    cut_batch_steps: bool = Field(default=True, description="a decode step carrying batch requests' rows is cut "
                                  "short when an interactive request comes while it runs (llama.cpp's CPU "
                                  "backend), so that request's prompt goes in at once; the cut step's rows go in "
                                  "again after it, and the step after a cut one is never cut")
    batch_slowdown: float = Field(default=1.2, ge=0, le=100, description="while interactive requests decode, batch "
                                  "requests' decoding rows join a step only as far as the interactive rows' decode "
                                  "steps stay within this factor of their time without them, on average (the batch "
                                  "sequences keep their KV and sit the other steps out; a batch prompt's chunk that "
                                  "joins such a step is not counted, docs/benchmarks.md \"A batch on idle "
                                  "capacity\"); 1: never beside them; 0: every step")
    request_timeout: float = Field(default=600.0, gt=0, description="seconds a request may run in all")
    embeddings: bool = Field(default=True, description="serve POST /worker/embed from a second llama.cpp context "
                             "on the same weights (its own thread), and say so in heartbeats")
    embedding_threads: int = Field(default=1, ge=1, le=256, description="llama.cpp threads of the embedding "
                                   "context (1: the decode loop keeps the other core of a 2-core machine)")
    embedding_ctx: int = Field(default=512, ge=16, le=1 << 20, description="tokens of the embedding context: "
                               "the longest input embedded (longer: 413), and the tokens decoded in one batch")
    embedding_batch_inputs: int = Field(default=16, ge=1, le=MAX_SESSIONS,
                                        description="inputs of one request decoded together in one llama_decode")
    embedding_queue: int = Field(default=16, ge=1, le=MAX_EMBED_INPUTS,
                                 description="embedding requests held at once, running or waiting; past them 503")
    embedding_timeout: float = Field(default=30.0, gt=0, description="seconds an embedding request may wait and "
                                     "run on the worker; past them 504 deadline_exceeded")
    kv_transfers: int = Field(default=2, ge=1, le=64, description="sessions' KV exported or imported at once "
                              "(worker/api/transfer.py); past them 503 transfers_full")
    responses_per_tenant: int = Field(default=1000, ge=1, le=1_000_000,
                                      description="stored Responses (`store: true`) each tenant may keep on this "
                                                  "worker; past it the tenant's oldest goes")
    responses_bytes_per_tenant: int = Field(default=32 * 1024 * 1024, ge=64 * 1024, le=1 << 34,
                                            description="bytes of stored Responses each tenant may keep on this "
                                                        "worker; past it the tenant's oldest go")
    responses_ttl: float = Field(default=86400.0, gt=0, le=30 * 86400,
                                 description="seconds a stored response is kept (its KV may go sooner: a turn on "
                                             "it is then prefilled whole)")
    kv_transfer_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024,
                                       description="largest KV blob a worker takes in, bytes (413 before it is read)")
    peer_prefix_min_tokens: int = Field(default=128, ge=1, description="prompt tokens a prefix fetched from a peer "
                                        "worker must save before it is asked for (below: prefilled here)")
    peer_prefix_timeout: float = Field(default=5.0, gt=0, description="seconds a peer has to answer with a "
                                       "prefix's cells; past them the prompt is prefilled here")
    room_wait: float | None = Field(
        default=None, ge=0, le=60, description="seconds a request refused for capacity (sessions_full, kv_full) "
        "waits here for a sequence or KV to free up, in arrival order, before its 503; default 2 with several "
        "coordinators (COORDINATOR_URL lists several, or COORDINATOR_RESOLVE_ALL), whose views miss each other's "
        "newest streams, and 0 with one, whose view of this worker is exact: a refusal then sends the request "
        "on to another worker at once")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024,
                                description="largest request body, bytes (413 before it is read)")
    max_header_bytes: int = Field(default=16_384, ge=1024, le=1 << 20,
                                  description="request line and headers together, bytes (431)")
    max_headers: int = Field(default=100, ge=8, le=10_000, description="headers per request (431)")
    header_timeout: float = Field(default=10.0, gt=0, description="seconds for a request's headers to arrive (408)")
    body_timeout: float = Field(default=30.0, gt=0, description="seconds for a request's body to arrive (408)")
    max_connections: int = Field(default=2_048, ge=1, description="open connections and requests; past it 503")
    drain_timeout: float = Field(default=30.0, ge=0, le=3600,
                                 description="on SIGTERM: seconds open streams may still run before they are "
                                 "ended with an error event (new requests get 503 draining meanwhile)")
    log_level: str = Field(default="info", pattern="^(debug|info|warning|error)$",
                           description="debug, info, warning or error")
    engine: str = Field(
        default="llama", pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="the engine backend, by the name it registers (worker/backends/): llama, the real model; "
        "simulated, timed tokens and no model (benchmarks)")
    sim_token_rate: float = Field(default=50.0, gt=0, le=10_000, description="simulated tokens/s per stream")
    sim_prefill_rate: float = Field(default=5000.0, gt=0, description="simulated prompt tokens/s")
    sim_bytes_per_token: int = Field(default=23040, ge=1, description="simulated KV bytes per token")

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _split_aliases(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(a.strip() for a in value.split(",") if a.strip())
        return value

    @field_validator("model_aliases")
    @classmethod
    def _aliases_are_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for alias in value:
            if not re.match(MODEL_NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} is not a valid model name")
        return value

    @field_validator("coordinator_url")
    @classmethod
    def _coordinator_urls_are_http(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if len(urls) > MAX_COORDINATORS:
            raise ValueError(f"at most {MAX_COORDINATORS} coordinator URLs")
        for url in urls:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"coordinator URL {url!r} is not an http(s) URL")
        return value

    @property
    def room_wait_seconds(self) -> float:
        """`room_wait`, or its default for this worker's coordinators."""
        if self.room_wait is not None:
            return self.room_wait
        return 2.0 if len(self.coordinator_urls) > 1 or self.coordinator_resolve_all else 0.0

    def for_slot(self, slot: int) -> WorkerSettings:
        """The settings of the slot `slot` serves a model in (`max_models`): the first is the worker itself,
        each other one is its own worker to coordinators, `<worker_id>.m<k>` at `<worker_url>/slots/<k>`."""
        if slot == 0:
            return self
        return self.model_copy(update={"worker_id": f"{self.worker_id[:124]}.m{slot}",
                                       "worker_url": self.worker_url.rstrip("/") + slot_prefix(slot)})

    @property
    def coordinator_urls(self) -> tuple[str, ...]:
        return tuple(u.strip() for u in self.coordinator_url.split(",") if u.strip())

    @model_validator(mode="after")
    def _derive(self) -> WorkerSettings:
        if self.keep_alive > 0 and self.model_dir is None:
            raise ValueError("keep_alive unloads an idle model of a folder: give --model-dir too (a worker with "
                             "no model loaded loads one of its folder when asked)")
        if self.max_models > 1 and self.model_dir is None:
            raise ValueError("max_models loads several models of a folder: give --model-dir too")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"worker-{self.port}")
        if not self.worker_url:
            object.__setattr__(self, "worker_url", f"http://{self.host}:{self.port}")
        if self.ctx_size == 0:
            # Split KV: each sequence owns ctx/max_sessions cells. Unified: sessions share one pool.
            per_session = self.session_max_tokens if not self.kv_unified else self.session_max_tokens // 2
            object.__setattr__(self, "ctx_size", max(self.session_max_tokens, per_session * self.max_sessions))
        elif not self.kv_unified and self.ctx_size // self.max_sessions < self.session_max_tokens:
            raise ValueError(
                f"ctx_size {self.ctx_size} split over max_sessions {self.max_sessions} gives each session "
                f"{self.ctx_size // self.max_sessions} KV cells, below session_max_tokens "
                f"{self.session_max_tokens}: raise ctx_size, lower one of the others, or use kv_unified")
        return self

    @classmethod
    def load(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, *,
             engines: Sequence[str] = ()) -> WorkerSettings:
        """`engines`: the backends present (worker/backends' catalog), the choices of `--engine`."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {
            field: environ[env] for field, env in ENV_NAMES.items() if environ.get(env, "") != ""
        }
        flags = _parser(engines).parse_args(argv)
        values.update({k: v for k, v in vars(flags).items() if v is not None})
        return cls.model_validate(values)


def _parser(engines: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-worker", description="A llama.cpp inference worker.")
    for name, info in WorkerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{info.description or name} (env {ENV_NAMES[name]}, default {info.default!r})"
        if name == "engine" and engines:
            parser.add_argument(flag, dest=name, default=None, choices=list(engines), help=help_text)
        elif info.annotation is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    return parser
