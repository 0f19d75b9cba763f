"""Coordinator settings: one pydantic model, read from the environment and command-line flags.

Owns: every tunable of the coordinator, its default, its environment name and its flag.
Must not: read the environment anywhere else; the app receives a `Settings` instance.

Each field `name` is read from the environment variable `NAME` (upper case) and from the flag
`--name` (dashes); a flag wins over the environment, which wins over the default. All validation
errors are reported together by pydantic at start-up.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.scheduling import catalog
from coordinator.scheduling.plugin import GENERATION
from coordinator.scheduling.policy import DEFAULT_SCORERS, parse_scorers
from protocol.health import JOIN_SETTLE
from protocol.worker import MAX_CHOICES, PING_INTERVAL


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=1337, ge=0, le=65535, description="port to listen on (with reuse_port, shared with "
                      "the other coordinator processes)")
    reuse_port: bool = Field(default=False, description="share `port` with other coordinator processes "
                             "(SO_REUSEPORT): the kernel spreads new connections over them")
    own_port: int = Field(default=0, ge=0, le=65535, description="a port of this process alone, besides "
                          "`port`: where workers heartbeat and Prometheus scrapes when several processes share "
                          "`port`; 0: none")
    worker_token: str | None = Field(
        default=None, repr=False, description="shared secret workers must send as `Authorization: Bearer ...` (heartbeats); "
        "also sent to workers with each request. Without it the coordinator warns at start")
    api_keys: str | None = Field(
        default=None, repr=False, description="client API keys: comma-separated, or a file with one per line; "
        "set, /coordinator/infer and /v1/* need `Authorization: Bearer <key>` or `X-API-Key` (401 otherwise)")
    cors_origins: str = Field(
        default="", max_length=4096, description="origins whose web pages may call the coordinator "
        "(comma-separated, e.g. https://app.example.com; * for any): preflights answered, CORS headers on "
        "their responses; none by default")
    open_metrics: bool = Field(default=False, description="with api_keys: /metrics and /coordinator/status answer "
                               "without a key too (a scraper that cannot send one); by default they need one")
    worker_url_pattern: str | None = Field(
        default=None, max_length=512, description="regular expression a worker's advertised URL must match "
        r"(e.g. ^http://10\.0\.\d+\.\d+:3001$); unset: any http(s) URL")
    heartbeat_interval: float = Field(default=10.0, gt=0, description="seconds between worker heartbeats")
    stale_after_intervals: float = Field(default=3, gt=0, description="no heartbeat this long: not scheduled")
    dead_after_intervals: float = Field(default=6, gt=0, description="no heartbeat this long: removed")
    heartbeat_max_skew: float = Field(
        default=30.0, gt=0, description="seconds a heartbeat timestamp may be ahead of the coordinator's clock"
    )
    max_failover_attempts: int = Field(default=3, ge=1, le=16, description="workers tried before the first token")
    continuations: int = Field(default=2, ge=0, le=8, description="times one stream may go on on another worker "
                               "after its worker failed mid-stream (the prompt and the tokens sent prefilled there); "
                               "0: a broken stream ends with an error event")
    continuation_timeout: float = Field(
        default=30.0, gt=0, description="seconds a broken stream waits, at most, for another worker to take its "
        "continuation (in its model's queue, ahead of new requests of its class); then its error event")
    relay_buffer_events: int = Field(default=64, ge=1, le=100_000, description="events buffered per client stream")
    relay_write_deadline: float = Field(
        default=10.0, gt=0, description="seconds a client may leave its buffer full before it is disconnected"
    )
    client_send_buffer_bytes: int = Field(
        default=32_768, ge=0, description="socket and transport send buffer per client connection (0: OS default)"
    )
    ping_interval: float = Field(default=15.0, gt=0,
                                 description="seconds of silence before an SSE comment ping to a client")
    worker_connect_timeout: float = Field(default=2.0, gt=0, description="seconds to open a connection to a worker")
    worker_first_event_timeout: float = Field(
        default=120.0, gt=0, description="seconds from sending a request to a worker until its first event "
        "(its prefill), however busy; a worker that goes silent is found sooner by worker_read_timeout")
    worker_read_timeout: float = Field(
        default=5.0, gt=0, description="longest silence from a worker, response head included (workers ping "
        f"every {PING_INTERVAL:g} s): a hung worker is failed over before the first token, or its stream "
        "ends with an error event after it")
    worker_probe_timeout: float = Field(
        default=3.0, gt=0, description="seconds a new worker's health (or a known one's at a new URL) has to "
        "answer before the coordinator registers it; its heartbeat is refused with the reason until it does")
    session_move_timeout: float = Field(
        default=30.0, gt=0, description="seconds one kept session's move from a draining worker may take (its KV "
        "fetched and put to another worker); past them it stays and is lost with its worker")
    session_move_deadline: float = Field(
        default=120.0, gt=0, description="seconds a draining worker's sessions are moved for, in all")
    session_move_max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024 * 1024, description="largest session KV blob moved (a worker's "
        "WORKER_KV_TRANSFER_MAX_BYTES bounds what it takes in)")
    worker_max_connections: int = Field(default=1_000, ge=1,
                                        description="open connections to workers, all of them together")
    worker_keepalive_expiry: float = Field(
        default=2.0, ge=0, description="seconds an idle connection to a worker is kept; below the worker's "
        "own keep-alive timeout (uvicorn: 5 s) so we never send on a connection it is closing")
    retry_after: int = Field(default=1, ge=0, description="seconds in the Retry-After header of a 503")
    scorers: str = Field(
        default=DEFAULT_SCORERS, max_length=512,
        description="scheduling scorers and their weights, name:weight,... "
        f"({', '.join(catalog.named(GENERATION, catalog.scorers()))})")
    routing_policy: str = Field(
        default="score", description="how eligible workers are ordered: score (the weighted scorers), "
        f"{', '.join(name for name in catalog.pickers() if name != 'score')}")
    routing_seed: int = Field(default=0, ge=0, description="seed of the random policy's draws")
    latency_half_life: float = Field(default=10.0, gt=0,
                                     description="least-latency: seconds for an idle worker's TTFT average to halve")
    prefix_block_chars: int = Field(default=256, ge=16, le=65_536,
                                    description="characters per block of the prefix index's hashes")
    prefix_index_blocks: int = Field(default=100_000, ge=0, le=10_000_000,
                                     description="block hashes the prefix index remembers (0: off)")
    disaggregate_prompt_bytes: int = Field(
        default=0, ge=0, le=1 << 30,
        description="a new one-shot request (no session_id, one choice) whose prompt has at least this many "
        "UTF-8 bytes is prefilled on one worker (the policy's first) and decoded on another, which fetches the "
        "prompt's cells from the first (`prefix_peer`; the workers' WORKER_PEER_PREFIX_MIN_TOKENS applies) "
        "instead of prefilling them; 0: off. docs/benchmarks.md measures when it pays")
    prefix_balance_threshold: float = Field(
        default=0.3, ge=0.0, le=1.0,
        description="the prefix scorer gives no credit to a worker this much busier (0-1 load) than the least busy")
    cache_entries: int = Field(default=0, ge=0, le=10_000_000,
                               description="response cache entries (0: no cache); only greedy or seeded requests")
    cache_bytes: int = Field(default=64 * 1024 * 1024, ge=0, description="response cache size bound, bytes")
    cache_ttl: float = Field(default=3600.0, gt=0, description="seconds a cached response stays valid")
    cache_path: str | None = Field(default=None, description="SQLite file that keeps the cache across restarts")
    breaker_failures: int = Field(default=3, ge=1, le=1000,
                                  description="failures in a row that take a worker out of scheduling")
    breaker_cooldown: float = Field(default=2.0, gt=0, description="seconds out after the first trip; doubles each trip")
    breaker_max_cooldown: float = Field(default=60.0, gt=0, description="longest cool-down, seconds")
    queue_size: int = Field(
        default=256, ge=0, le=100_000,
        description="requests that may wait per model (and per tenant, with fair shares) when capacity is short "
        "(0: 503 at once, no queue)")
    queue_timeout: float = Field(default=30.0, gt=0, description="seconds a request may wait in the queue")
    fair_share: bool = Field(default=True, description="with api_keys: the tenant whose weighted tokens served are "
                             "fewest goes next where requests wait (off: first come, first served)")
    fair_prompt_weight: float = Field(default=1.0, ge=0, le=1000,
                                      description="fair shares: what one prompt token counts")
    fair_output_weight: float = Field(default=2.0, ge=0, le=1000,
                                      description="fair shares: what one generated token counts")
    fair_idle_grace: float = Field(default=1.0, ge=0, le=60,
                                   description="fair shares: seconds a tenant whose last request ended still counts "
                                   "as active, so its next request (a closed-loop client's, a chat's next turn) finds "
                                   "a free sequence kept for it")
    embedding_max_inputs: int = Field(default=256, ge=1, le=2_048,
                                      description="inputs one /v1/embeddings request may have (more: 400)")
    embedding_max_bytes: int = Field(default=1_048_576, ge=1, description="UTF-8 bytes of all the inputs of one "
                                     "/v1/embeddings request together (more: 400)")
    embedding_timeout: float = Field(default=60.0, gt=0, description="seconds an embedding request may take "
                                     "from its dispatch, every worker tried included (then 504)")
    session_table_size: int = Field(default=100_000, ge=1, description="session-to-worker entries remembered")
    conversation_table_size: int = Field(
        default=100_000, ge=0, description="conversation fingerprints remembered for prefix affinity (0: off)")
    default_model: str | None = Field(
        default=None, max_length=256, description="model for requests that name none (default: the only model)")
    model_loads: bool = Field(
        default=True, description="a request for a model that a worker offers from its folder (--model-dir) but "
        "none serves makes one worker load it, and waits (QUEUE_TIMEOUT, QUEUE_SIZE of them a model); off: 503 "
        "model_unavailable")
    any_model_name: bool = Field(
        default=False, description="a request naming a model no worker serves goes where one naming none goes "
        "(DEFAULT_MODEL, or the only model served) instead of 404, as llama-server serves its one model under any "
        "name: for clients that insist on a name of their own")
    max_choices: int = Field(
        default=8, ge=1, le=MAX_CHOICES, description="the most choices one request may ask for (OpenAI's `n`; "
        "more: 400). All of a request's choices run on one worker, a sequence and a KV reservation each, so keep "
        "it within the workers' WORKER_MAX_SESSIONS")
    max_body_bytes: int = Field(default=4_194_304, ge=1024, description="largest request body, bytes (413)")
    max_header_bytes: int = Field(default=16_384, ge=1024, le=1 << 20,
                                  description="request line and headers together, bytes (431)")
    max_headers: int = Field(default=100, ge=8, le=10_000, description="headers per request (431)")
    header_timeout: float = Field(default=10.0, gt=0, description="seconds for a request's headers to arrive, "
                                  "from the connection's start or the last response (408; slowloris)")
    body_timeout: float = Field(default=30.0, gt=0, description="seconds for a request's body to arrive (408)")
    max_streams: int = Field(
        default=1_500, ge=1, le=1_000_000, description="streams this process relays at once; past it new "
        "requests get 503 streams_full instead of every stream slowing (one coordinator core relays ~10k tokens/s)")
    max_connections: int = Field(default=10_000, ge=1, description="open client connections and requests; "
                                 "past it new requests get 503 (uvicorn's limit_concurrency)")
    responses_sockets: int = Field(
        default=256, ge=0, le=100_000, description="Responses WebSockets (/v1/responses upgraded) open at once on "
        "this coordinator; past it a handshake gets 503 sockets_full; 0: the WebSocket is not served")
    responses_socket_message_bytes: int = Field(
        default=4_194_304, ge=1024, le=16 * 1024 * 1024, description="largest message a Responses WebSocket "
        "takes, bytes; a larger one gets an error event and is dropped (the socket stays open)")
    responses_socket_idle: float = Field(
        default=600.0, gt=0, le=86_400, description="seconds a Responses WebSocket may stay quiet (no message "
        "from its client, no response running) before it is closed (1001)")
    responses_socket_chain_bytes: int = Field(
        default=8 * 1024 * 1024, ge=0, le=1 << 30, description="bytes (as JSON) of earlier responses' input and "
        "output items one Responses WebSocket keeps, so that a response.create with previous_response_id sends "
        "only its new input; past it the oldest are forgotten (previous_response_not_found)")
    responses_socket_chain_items: int = Field(
        default=4_096, ge=0, le=1_000_000, description="items of earlier responses one Responses WebSocket keeps "
        "(all its kept responses together), as responses_socket_chain_bytes")
    responses_store: bool = Field(
        default=True, description="keep `store: true` Responses (OpenAI's default) on the worker that ran each, "
        "next to its KV, for previous_response_id, GET and DELETE /v1/responses/{id} through any coordinator; "
        "off: store is taken as false and previous_response_id over HTTP gets previous_response_not_found")
    responses_record_bytes: int = Field(
        default=4 * 1024 * 1024, ge=64 * 1024, le=1 << 30, description="largest stored response (its whole "
        "conversation as JSON), bytes; a larger one is answered but not stored (previous_response_not_found later)")
    responses_store_timeout: float = Field(
        default=5.0, gt=0, le=600, description="seconds a worker has to keep, give back or forget a stored response")
    # The Batch API (/v1/files, /v1/batches; coordinator/batches/)
    batch_dir: str = Field(
        default="", max_length=4096, description="directory of the batch store (SQLite, and the files' bytes): "
        "jobs survive a restart there, and coordinators that share it (a shared volume) share jobs; empty: a "
        "temporary directory removed at exit (jobs do not survive a restart)")
    batch_file_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=1 << 31,
                                      description="largest file uploaded for a batch, bytes (413)")
    batch_file_max_lines: int = Field(default=50_000, ge=1, le=1_000_000,
                                      description="most lines (requests) in a batch's input file (400)")
    batch_tenant_max_files: int = Field(default=500, ge=1, le=1_000_000,
                                        description="most files a tenant keeps (uploads and batch outputs)")
    batch_tenant_max_bytes: int = Field(default=1 << 30, ge=1024, le=1 << 40,
                                        description="most bytes of files a tenant keeps; past it an upload gets 413")
    batch_retention: int = Field(default=7 * 86_400, ge=60, le=365 * 86_400,
                                 description="seconds files and ended batches are kept, then removed")
    batch_jobs: int = Field(default=4, ge=0, le=1_000, description="batches this coordinator runs at once; 0: "
                            "it runs none (another coordinator sharing BATCH_DIR does)")
    batch_lease: float = Field(default=30.0, gt=0, le=3600, description="seconds a coordinator holds a batch "
                               "job without renewing it; a coordinator that died loses its jobs to another then")
    batch_max_in_flight: int = Field(default=256, ge=1, le=100_000, description="lines of one batch running at "
                                     "once at most; below it the pool's free capacity sets the pace")
    keep_alive_timeout: int = Field(default=5, ge=1, le=3600, description="seconds an idle keep-alive connection stays")
    drain_timeout: float = Field(
        default=30.0, ge=0, le=3600, description="on SIGTERM: seconds streams in flight may still run before "
        "they are ended with an error event (new requests get 503 draining meanwhile)")
    join_wait: float | None = Field(
        default=None, ge=0, le=3600, description="the longest a starting coordinator waits to know the pool before "
        "it answers ready on /coordinator/ready and joins a shared port (reuse_port with own_port); it is ready "
        "sooner once it has registered as many workers as its siblings count. Default: one heartbeat round, "
        "heartbeat_interval + 1 s")
    refusal_log_rate: float = Field(default=20.0, gt=0, description="refused requests logged per second at "
                                    "most (all are counted in metrics; the next line says how many were left out)")
    log_level: str = Field(default="info", pattern=r"^(?i:debug|info|warning|error|critical)$",
                           description="debug, info, warning, error or critical")

    @field_validator("worker_url_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value:
            re.compile(value)
        return value

    @field_validator("scorers")
    @classmethod
    def _scorers_known(cls, value: str) -> str:
        parse_scorers(value)
        return value

    @field_validator("routing_policy")
    @classmethod
    def _routing_known(cls, value: str) -> str:
        if value not in catalog.pickers():
            raise ValueError(f"unknown routing policy {value!r} (known: {', '.join(catalog.pickers())})")
        return value

    @model_validator(mode="after")
    def _dead_after_stale(self) -> Settings:
        if self.dead_after_intervals < self.stale_after_intervals:
            raise ValueError("dead_after_intervals must be >= stale_after_intervals")
        if self.worker_read_timeout <= PING_INTERVAL:
            raise ValueError(f"worker_read_timeout must be above the workers' ping interval ({PING_INTERVAL:g} s)")
        return self

    @property
    def join_after(self) -> float:
        return self.join_wait if self.join_wait is not None else self.heartbeat_interval + JOIN_SETTLE

    @property
    def stale_after(self) -> float:
        return self.heartbeat_interval * self.stale_after_intervals

    @property
    def dead_after(self) -> float:
        return self.heartbeat_interval * self.dead_after_intervals

    @classmethod
    def load(cls, environ: Mapping[str, str], argv: Sequence[str] | None = None) -> Settings:
        """Build settings from an environment mapping and flags (argv without the program name)."""
        values: dict[str, str] = {}
        for name in cls.model_fields:
            if name.upper() in environ and environ[name.upper()] != "":
                values[name] = environ[name.upper()]
        flags = _parser().parse_args(list(argv or []))
        values.update({k: v for k, v in vars(flags).items() if v is not None})
        return cls.model_validate(values)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-coordinator", description="LLM inference coordinator")
    for name, field in Settings.model_fields.items():
        default = field.default
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{field.description or ''} (env {name.upper()}, default {default})",
        )
    return parser
