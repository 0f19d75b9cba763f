"""The worker token as a benchmark holds it: the header that carries it, and where to find it for a
pool the benchmark did not start.

Owns: the one place a benchmark turns a worker token into a request header, and the order it looks
for one. Must not: start servers (processes.py does, and `processes.pool` makes its own token) or send
requests.

With a token set, a worker answers only its holder on every route but `GET /worker/health`
(worker/api/app.py: generate, `/worker/sessions`, `/metrics`). A benchmark that starts its workers knows
the token it gave them; one pointed at a running pool finds it, first found wins, in the flag, in
`WORKER_TOKEN`, or in `$LOG_DIR/worker-token`, the file start.sh writes when it makes one up.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

ENV = "WORKER_TOKEN"
FILE_NAME = "worker-token"  # under $LOG_DIR (start.sh)


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers a request to a worker's guarded routes needs: none without a token."""
    return {"authorization": f"Bearer {token}"} if token else {}


def find_token(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The worker token of a running pool: `flag`, else `environ`'s WORKER_TOKEN, else the file
    start.sh left in `environ`'s LOG_DIR; None when there is none (a pool started without one)."""
    if flag:
        return flag
    if environ.get(ENV):
        return environ[ENV]
    log_dir = environ.get("LOG_DIR")
    if log_dir:
        path = Path(log_dir) / FILE_NAME
        if path.is_file():
            return path.read_text().strip() or None
    return None
