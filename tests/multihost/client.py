"""The test's client host: HTTP calls to the coordinator, made from threads that live in the client's
network namespace (`netns.enter`), so every byte crosses the bridge like a remote client's would.

Owns: streaming one `/coordinator/infer` request and keeping what happened to it (status, worker,
each event and when it arrived, or the transport failure); running many at once.
Must not: be called from a thread outside the namespace: only the pool's threads hold its sockets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from tests.multihost.netns import enter

T = TypeVar("T")
# Longer than any wait the coordinator makes (its read deadline on a worker), so the coordinator,
# not this client, decides how a stream ends.
READ_TIMEOUT = 60.0


@dataclass
class Streamed:
    body: dict[str, Any]
    sent_at: float = 0.0  # time.monotonic(), like every time here
    status: int | None = None
    worker_id: str | None = None  # the X-Worker-ID header
    events: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)
    error_body: dict[str, Any] | None = None  # a non-200 answer's JSON
    failure: str | None = None  # no answer, or the stream broke: lost without an explicit error
    future: Future[Streamed] | None = None

    @property
    def tokens(self) -> int:
        return sum(1 for name, _, _ in self.events if name == "token")

    @property
    def terminal(self) -> tuple[str, dict[str, Any], float] | None:
        """The stream's `done` or `error` event, if it ended with one."""
        last = self.events[-1] if self.events else None
        return last if last is not None and last[0] in ("done", "error") else None

    @property
    def ended(self) -> str:
        """done / error (an event) / refused (an explicit non-200) / lost (anything else)."""
        if self.status is not None and self.status != 200 and self.error_body is not None:
            return "refused"
        terminal = self.terminal
        return terminal[0] if terminal is not None and self.failure is None else "lost"

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token's arrival at the client."""
        first = next((at for name, _, at in self.events if name == "token"), None)
        return None if first is None else first - self.sent_at

    @property
    def worker_ttft(self) -> float | None:
        """The worker's own TTFT (admission to first token), from its `done` event."""
        terminal = self.terminal
        if terminal is None or terminal[0] != "done":
            return None
        return float(terminal[1]["timings"]["ttft_ms"]) / 1000


class Client:
    def __init__(self, namespace: str, base_url: str, *, threads: int = 16) -> None:
        self.base_url = base_url
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"client-{namespace}", initializer=enter,
                                        initargs=(namespace,))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` on a thread inside the namespace and returns its result."""
        return self._pool.submit(fn, *args).result(timeout=READ_TIMEOUT + 10)

    def get(self, path: str) -> Any:
        return self.call(_get_json, self.base_url + path)

    def metric(self, prefix: str, base_url: str | None = None, token: str | None = None) -> float:
        """The sum of the coordinator's (or the service at `base_url`'s, with its `token`) Prometheus
        samples whose line starts with `prefix`."""
        text = self.call(_get_text, (base_url or self.base_url) + "/metrics", token)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    def delete(self, path: str) -> int:
        """DELETE on the coordinator; its status."""
        return self.call(_delete, self.base_url + path)

    def start(self, body: dict[str, Any]) -> Streamed:
        """Starts one stream; its `Streamed` fills in as events arrive, `.future` resolves at the end."""
        streamed = Streamed(body)
        streamed.future = self._pool.submit(_stream, self.base_url, streamed)
        return streamed

    def run(self, bodies: Sequence[dict[str, Any]], timeout: float = READ_TIMEOUT + 10) -> list[Streamed]:
        """Sends every body at once and waits for every stream to end."""
        started = [self.start(body) for body in bodies]
        return [wait(s, timeout) for s in started]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def wait(streamed: Streamed, timeout: float) -> Streamed:
    assert streamed.future is not None
    return streamed.future.result(timeout=timeout)


def _get_json(url: str) -> Any:
    with httpx.Client(timeout=5, trust_env=False) as http:
        response = http.get(url)
        response.raise_for_status()
        return response.json()


def _get_text(url: str, token: str | None = None) -> str:
    with httpx.Client(timeout=5, trust_env=False) as http:
        response = http.get(url, headers={"authorization": f"Bearer {token}"} if token else {})
        response.raise_for_status()
        return response.text


def _delete(url: str) -> int:
    with httpx.Client(timeout=10.0, trust_env=False) as http:
        return http.delete(url).status_code


def _stream(base_url: str, into: Streamed) -> Streamed:
    timeout = httpx.Timeout(5.0, read=READ_TIMEOUT)
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as http:
            into.sent_at = time.monotonic()
            with http.stream("POST", base_url + "/coordinator/infer", json=into.body) as response:
                into.status = response.status_code
                into.worker_id = response.headers.get("x-worker-id")
                if response.status_code != 200:
                    into.error_body = json.loads(response.read())
                    return into
                name, data = "message", list[str]()
                for line in response.iter_lines():
                    if line == "":
                        if data:
                            into.events.append((name, json.loads("\n".join(data)), time.monotonic()))
                        name, data = "message", list[str]()
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
    except (httpx.HTTPError, ValueError) as exc:
        into.failure = f"{type(exc).__name__}: {exc}"
    return into
