"""The account of every request: one structured log line and the request metrics, however it ended.

Owns: counting and logging refusals before the first byte (and turning a bug before it into a 500) (logged at a bounded rate: a flood of 503s
must not become a flood of log lines), an admitted request's finish (its metrics, the finish reason,
the worker's time-to-first-token signal, its log line), a cache hit's, and an answered embedding
request's.
Must not: release capacity or decide an ending (the gateway and the relay's supervisor do).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics, tenant_label
from coordinator.pool.registry import Registry
from coordinator.relay.dispatch import OpenStream
from coordinator.relay.stream import Outcome
from coordinator.relay.supervisor import Ending
from protocol import reasons


class RateLimit:
    """A token bucket: at most `per_second` on average, bursts of up to that many; counts what it refuses."""

    def __init__(self, per_second: float) -> None:
        self._rate = per_second
        self._tokens = per_second
        self._at: float | None = None
        self.left_out = 0

    def allow(self, now: float) -> bool:
        if self._at is not None:
            self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.left_out += 1
        return False


def finish_reason(ending: Ending, outcome: Outcome) -> str:
    """The request's finish as metrics and logs name it: the client's side first, then the stream's."""
    if ending is Ending.SLOW_CLIENT:
        return reasons.SLOW_CONSUMER
    if ending is Ending.CLIENT_GONE:
        return "client_gone"
    if ending is Ending.INTERNAL:
        return reasons.INTERNAL  # logged and counted by the supervisor, once
    if outcome.done is not None:
        return outcome.done.finish_reason
    return outcome.error_reason or reasons.WORKER_FAILED


class RequestLog:
    def __init__(self, metrics: CoordinatorMetrics, registry: Registry, log: logging.Logger, *,
                 now: Callable[[], float], refusal_log_rate: float) -> None:
        self._metrics = metrics
        self._registry = registry
        self._log = log
        self._now = now
        self._refusal_log = RateLimit(refusal_log_rate)

    def refused(self, request_id: str, exc: CoordinatorError, started: float, *, surface: str,
                tenant: str | None = None) -> None:
        """Every request refused before its first byte (a surface's parse errors too), a generation's
        also for its tenant; the next line logged says how many were left out since the last one."""
        self._metrics.rejected(exc.reason)
        if tenant is not None:
            self._metrics.tenant_refusals.labels(tenant=tenant_label(tenant), reason=exc.reason).inc()
        now = self._now()
        if not self._refusal_log.allow(now):
            return
        left_out, self._refusal_log.left_out = self._refusal_log.left_out, 0
        self.line(request_id=request_id, surface=surface, status=exc.status, reason=exc.reason,
                  duration_ms=_ms(now - started), **({"refusals_not_logged": left_out} if left_out else {}))

    @contextlib.contextmanager
    def accounted(self, task: str, request_id: str, started: float, *, surface: str,
                  tenant: str | None = None) -> Iterator[None]:
        """A refusal inside counted and logged (`refused`); a bug inside logged with its traceback,
        counted, and raised as a 500 `internal` naming no detail."""
        try:
            yield
        except CoordinatorError as exc:
            self.refused(request_id, exc, started, surface=surface, tenant=tenant)
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: logged with its traceback, answered as a 500
            self._log.error(json.dumps({"event": "internal_error", "task": task, "request_id": request_id,
                                        "error": repr(exc)}), exc_info=exc)
            self._metrics.internal_errors.labels(task=task).inc()
            internal = CoordinatorError(reasons.INTERNAL, "internal error")
            self.refused(request_id, internal, started, surface=surface, tenant=tenant)
            raise internal from None

    def finished(self, request_id: str, surface: str, stream: OpenStream, outcome: Outcome, ending: Ending,
                 started: float, trace_id: str = "", *, continuations: int = 0) -> None:
        """An admitted request's end, whatever it was; `trace_id`: its trace's, when it is traced. `stream`:
        the worker's that ran its end; `continuations`: how many times it went on on another worker."""
        now, metrics, done = self._now(), self._metrics, outcome.done
        metrics.requests_running.dec()
        metrics.generation_tokens.inc(outcome.tokens)
        metrics.e2e.observe(now - started)
        ttft = outcome.first_token_at - started if outcome.first_token_at is not None else None
        if ttft is not None:
            metrics.ttft.observe(ttft)
            record = self._registry.get(stream.worker.worker_id)
            if record is not None:  # least-latency's signal: what this worker's clients waited
                record.observe_ttft(ttft, now)
        if ending is Ending.SLOW_CLIENT:
            metrics.slow_clients.inc()
        elif ending is Ending.CLIENT_GONE:
            metrics.client_disconnects.inc()
        finish = finish_reason(ending, outcome)
        metrics.finished.labels(finish_reason=finish).inc()
        self.line(request_id=request_id, surface=surface, status=200, worker_id=stream.worker.worker_id,
                  model=done.model if done else stream.worker.model, finish_reason=finish,
                  prompt_tokens=done.usage.prompt_tokens if done else None,
                  cached_tokens=done.usage.cached_tokens if done else None,
                  generated_tokens=done.usage.completion_tokens if done else outcome.tokens,
                  ttft_ms=_ms(ttft) if ttft is not None else None, duration_ms=_ms(now - started),
                  attempts=stream.attempts, **({"continuations": continuations} if continuations else {}),
                  **({"trace_id": trace_id} if trace_id else {}))

    def replayed(self, request_id: str, surface: str, outcome: Outcome, ending: Ending, started: float) -> None:
        """A request answered from the response cache."""
        finished = outcome.done.finish_reason if outcome.done is not None else ending.value
        self._metrics.finished.labels(finish_reason=finished).inc()
        self.line(request_id=request_id, surface=surface, status=200, worker_id="cache", cached=True,
                  finish_reason=finished, duration_ms=_ms(self._now() - started))

    def embedded(self, request_id: str, surface: str, *, worker_id: str, model: str, inputs: int, tokens: int,
                 attempts: int, started: float, trace_id: str = "") -> None:
        """An embedding request answered: its counts and its log line (`trace_id`: its trace's, when traced)."""
        now, metrics = self._now(), self._metrics
        metrics.admitted()
        metrics.embedding_requests.inc()
        metrics.embedding_inputs.inc(inputs)
        metrics.embedding_tokens.inc(tokens)
        metrics.embedding_latency.observe(now - started)
        self.line(request_id=request_id, surface=surface, status=200, worker_id=worker_id, model=model,
                  inputs=inputs, prompt_tokens=tokens, duration_ms=_ms(now - started), attempts=attempts,
                  **({"trace_id": trace_id} if trace_id else {}))

    def line(self, **fields: Any) -> None:
        self._log.info(json.dumps({"event": "request", **fields}, separators=(",", ":")))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
