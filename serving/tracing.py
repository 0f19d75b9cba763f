"""OpenTelemetry traces for both services, set up from the standard `OTEL_*` environment variables.

Owns: deciding from the environment whether this process traces at all (`Tracing.from_env`: only when
an `OTEL_*` variable that names an exporter, an endpoint, a service or a sampler is set), the tracer
provider and its OTLP/HTTP exporter (protobuf; the SDK reads the endpoint, headers, sampler and batch
settings from the same variables), and `Trace`, one request's spans: its own span (a child of the W3C
`traceparent` it came with), children opened and ended around a step or written afterwards with the
times a step took, and the `traceparent` of a span for the next hop.
Must not: import OpenTelemetry unless tracing is on (a process without `OTEL_*` pays nothing but a no-op
`Trace`), or know either service's steps: they name their own spans and attributes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

# The variables that turn tracing on: any of them set (and OTEL_SDK_DISABLED not "true").
SWITCHES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
            "OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER")
PROTOCOLS = ("http/protobuf",)  # what the installed exporter speaks
TRACEPARENT = "traceparent"
SHUTDOWN_TIMEOUT = 2.0  # seconds a process's stop waits for its last spans to be exported
Attributes = Mapping[str, str | int | float | bool]
log = logging.getLogger("serving.tracing")


class TracingError(ValueError):
    """The `OTEL_*` settings ask for what this service cannot do (another protocol or exporter)."""


class Trace:
    """One request's spans. This base class is the no-op one: every method does nothing."""

    trace_id = ""  # the trace's id in hex, for log lines ("" when not traced)

    def child(self, name: str, attributes: Attributes | None = None) -> Trace:
        return self

    def step(self, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Trace]:
        """A child span around a block, ended with it (in error, with the exception's `reason`, if it raises)."""
        return nullcontext(self)

    def record(self, name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
        """A child span written afterwards, for a step timed elsewhere (the engine's prefill, say)."""

    def set(self, attributes: Attributes) -> None: ...

    def fail(self, reason: str) -> None:
        """Marks the span as ended in error, with the refusal's or failure's reason."""

    def raised(self, exc: BaseException) -> None:
        """`fail` with what an exception says: its `reason` (the services' errors have one), else its type."""
        self.fail(getattr(exc, "reason", type(exc).__name__))

    def end(self, end_ns: int | None = None) -> None: ...

    def traceparent(self) -> str | None:
        """This span's W3C `traceparent`, for a request it makes; None when not traced."""
        return None


NO_TRACE = Trace()


class _Span(Trace):
    def __init__(self, tracing: Tracing, span: Any) -> None:
        self._tracing, self._span = tracing, span
        self._ended = False
        self.trace_id = format(span.get_span_context().trace_id, "032x")

    def child(self, name: str, attributes: Attributes | None = None) -> Trace:
        return self._tracing._start(name, self._span, attributes)

    def step(self, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Trace]:
        return _until_done(self.child(name, attributes))

    def record(self, name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
        span = self._tracing._start(name, self._span, attributes, start_ns=start_ns)
        span.end(end_ns)

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(dict(attributes))

    def fail(self, reason: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("llm_pool.reason", reason)
        self._span.set_status(Status(StatusCode.ERROR, reason))

    def end(self, end_ns: int | None = None) -> None:
        if not self._ended:  # a step may end a span its caller ends too: the first end counts
            self._ended = True
            self._span.end(end_ns)

    def traceparent(self) -> str | None:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(self._span))
        return carrier.get(TRACEPARENT)


class Tracing:
    """A process's tracer (one provider, its exporter, its batch thread), made by `from_env`."""

    def __init__(self, service: str, env: Mapping[str, str], exporter: Any = None) -> None:
        """`exporter`: where spans go (an OTel `SpanExporter`); None: OTLP over HTTP, as OTEL_* says."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
        # The SDK reads the sampler (OTEL_TRACES_SAMPLER, _ARG), the exporter's endpoint and headers and
        # the batch processor's settings from the environment itself.
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer("llm-pool")

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> Tracing | None:
        """This process's tracing when the environment asks for it, else None; `TracingError` when it
        asks for what the installed exporter cannot do."""
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or not any(env.get(name) for name in SWITCHES):
            return None
        exporter = env.get("OTEL_TRACES_EXPORTER", "otlp")
        if exporter == "none":
            return None
        if exporter != "otlp":
            raise TracingError(f"OTEL_TRACES_EXPORTER={exporter}: only otlp (or none) is supported")
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL",
                                                                             "http/protobuf")
        if protocol not in PROTOCOLS:
            raise TracingError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: only http/protobuf is supported")
        return cls(service, env)

    def begin(self, name: str, headers: Mapping[str, str], attributes: Attributes | None = None) -> Trace:
        """A request's own span: a child of the `traceparent` it came with, else a trace's root."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        given = headers.get(TRACEPARENT)
        context = TraceContextTextMapPropagator().extract({TRACEPARENT: given}) if given else None
        span = self._tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=attributes)
        return _Span(self, span)

    def _start(self, name: str, parent: Any, attributes: Attributes | None, start_ns: int | None = None) -> _Span:
        from opentelemetry.trace import set_span_in_context

        span = self._tracer.start_span(name, context=set_span_in_context(parent), attributes=attributes,
                                       start_time=start_ns)
        return _Span(self, span)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> bool:
        """Exports what is left (the batch thread's queue) and stops the thread, waiting `timeout`
        seconds at most: a collector that takes connections and never answers held every process's
        stop ~17 s (the exporter's 10 s timeout, its retries), past a supervisor's grace after a drain
        (issue 50). Past it the spans left are dropped, the export thread (a daemon) is left to the
        process's exit, and False says so."""
        closing = threading.Thread(target=self._provider.shutdown, name="tracing-shutdown", daemon=True)
        closing.start()
        closing.join(timeout)
        if closing.is_alive():
            log.warning('{"event": "tracing_shutdown_timeout", "timeout_s": %g, "detail": "the collector did not '
                        'take the last spans in time; they are dropped"}', timeout)
            return False
        return True


def begin(tracing: Tracing | None, name: str, headers: Mapping[str, str], attributes: Attributes | None = None
          ) -> Trace:
    """`tracing.begin(...)`, or the no-op trace when this process does not trace."""
    return NO_TRACE if tracing is None else tracing.begin(name, headers, attributes)


def span(tracing: Tracing | None, name: str, headers: Mapping[str, str], attributes: Attributes | None = None
         ) -> AbstractContextManager[Trace]:
    """`begin` around a block: the span ends with it, in error (the exception's `reason`) if it raises."""
    return _until_done(begin(tracing, name, headers, attributes))


@contextmanager
def _until_done(trace: Trace) -> Iterator[Trace]:
    try:
        yield trace
    except BaseException as exc:
        trace.raised(exc)
        raise
    finally:
        trace.end()
