"""Machine-readable `reason` strings shared by both services.

The same string appears in the JSON error body, the log line and the metric label. The coordinator
reads a worker's refusal reason to decide whether another worker may succeed (`RETRYABLE_ON_OTHER_WORKER`).
Each reason's HTTP status is in protocol.statuses, once (the groups below follow it).
"""

from __future__ import annotations

# the request
INVALID_REQUEST = "invalid_request"
PROTOCOL_MISMATCH = "protocol_mismatch"
EMBEDDINGS_UNSUPPORTED = "embeddings_unsupported"  # no worker of the model says it serves embeddings
UNAUTHORIZED = "unauthorized"
UNKNOWN_MODEL = "unknown_model"
UNKNOWN_SESSION = "unknown_session"
UNKNOWN_RESPONSE = "unknown_response"  # no stored response of that id for this tenant (here)
SESSION_EXPIRED = "session_expired"
NO_PREFIX = "no_prefix"  # a peer worker holds no long enough prefix of the prompt asked about
KV_REFUSED = "kv_refused"  # a KV blob this worker cannot take in (another model, cut short, damaged)
SESSION_BUSY = "session_busy"
SESSION_EXISTS = "session_exists"  # an imported session's id is already held here
WORKER_CONFLICT = "worker_conflict"  # a heartbeat claims a live worker's id from another URL
PROMPT_TOO_LONG = "prompt_too_long"
# refused at the edge, before the app saw the request (serving/edge.py)
REQUEST_TIMEOUT = "request_timeout"
BODY_TOO_LARGE = "body_too_large"
HEADERS_TOO_LARGE = "headers_too_large"
# an API key's limits
RATE_LIMITED = "rate_limited"  # the API key is over one of its limits (streams, requests or tokens a minute)
BUDGET_EXCEEDED = "budget_exceeded"  # the API key has used its token budget for the period
# capacity: ask again later, or another worker
NO_WORKERS = "no_workers"
MODEL_UNAVAILABLE = "model_unavailable"
SESSIONS_FULL = "sessions_full"
KV_FULL = "kv_full"
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
LOADING = "loading"
MODEL_LOAD_FAILED = "model_load_failed"  # the model could not be loaded (the reason named); tried again after a pause
MODEL_SWAPPING = "model_swapping"  # a worker is swapping to another model: asked for a third, it says which
DRAINING = "draining"
STREAMS_FULL = "streams_full"  # the coordinator relays as many streams as it is set to: it protects itself
EMBEDDINGS_FULL = "embeddings_full"  # every embedding slot (a worker's bounded embedding queue) is taken
TRANSFERS_FULL = "transfers_full"  # a worker moves that many sessions' KV at once (WORKER_KV_TRANSFERS)
# faults, and stream errors
WORKER_UNAVAILABLE = "worker_unavailable"
WORKER_FAILED = "worker_failed"
SLOW_CONSUMER = "slow_consumer"
DEADLINE_EXCEEDED = "deadline_exceeded"
ENGINE_FAILED = "engine_failed"
INTERNAL = "internal"
# The client went away before its answer began (while it waited in the queue): logged, never sent.
CLIENT_GONE = "client_gone"

# A worker refusing for one of these says nothing about the other workers: try the next one.
RETRYABLE_ON_OTHER_WORKER = frozenset({SESSIONS_FULL, KV_FULL, QUEUE_FULL, LOADING, DRAINING, EMBEDDINGS_FULL})
