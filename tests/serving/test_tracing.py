"""serving/tracing.py: when the OTEL_* environment turns tracing on, what it refuses, and the no-op trace
a process without it uses (the spans themselves: tests/integration/test_tracing.py, through an OTLP receiver)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.tracing import NO_TRACE, Tracing, TracingError, begin


@pytest.mark.parametrize("env", [{}, {"OTEL_RESOURCE_ATTRIBUTES": "a=b"}, {"OTEL_TRACES_EXPORTER": "none"},
                                 {"OTEL_SDK_DISABLED": "true", "OTEL_SERVICE_NAME": "x"}])
def test_without_a_variable_that_asks_for_traces_nothing_is_set_up(env: dict[str, str]) -> None:
    assert Tracing.from_env("svc", env) is None
    assert begin(None, "request", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is NO_TRACE


@pytest.mark.parametrize("env, named", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json", "OTEL_SERVICE_NAME": "x"}, "http/json"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin")])
def test_what_the_exporter_cannot_do_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(TracingError, match=named):
        Tracing.from_env("svc", env)


def test_the_no_op_trace_takes_every_call_and_names_no_trace() -> None:
    child = NO_TRACE.child("step", {"a": 1})
    with child.step("inner") as inner:
        inner.record("done", 1, 2)
        inner.set({"b": True})
        inner.fail("why")
    child.end()
    assert NO_TRACE.traceparent() is None and NO_TRACE.trace_id == ""


def test_a_traced_request_continues_the_callers_trace_and_hands_it_on() -> None:
    exported = InMemorySpanExporter()
    tracing = Tracing("svc", {}, exporter=exported)
    trace = tracing.begin("request", {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    hop = trace.child("dispatch")
    given = hop.traceparent()
    assert trace.trace_id == "ab" * 16 and given is not None
    hop.end()
    hop.end()  # a second end does nothing
    with pytest.raises(ValueError), trace.step("placement"):
        raise ValueError("refused")
    trace.record("prefill", 1_000, 2_000, {"tokens": 3})
    trace.end()
    tracing.shutdown()
    spans = {span.name: span for span in exported.get_finished_spans()}
    assert sorted(spans) == ["dispatch", "placement", "prefill", "request"]
    request = spans["request"]
    assert request.parent is not None and format(request.parent.span_id, "016x") == "cd" * 8
    assert all(format(s.context.trace_id, "032x") == "ab" * 16 for s in spans.values())
    assert all(s.parent is not None and s.parent.span_id == request.context.span_id
               for name, s in spans.items() if name != "request")
    # The next hop's traceparent names the dispatch span as its parent.
    assert given == f"00-{'ab' * 16}-{spans['dispatch'].context.span_id:016x}-01"
    assert spans["placement"].status.status_code.name == "ERROR"
    assert (spans["prefill"].start_time, spans["prefill"].end_time) == (1_000, 2_000)
    assert request.resource.attributes["service.name"] == "svc"


def test_a_shutdown_whose_exporter_never_returns_waits_its_bound_and_says_so() -> None:
    """Issue 50: a collector that never answers held every process's stop ~17 s."""
    import threading
    import time

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    release = threading.Event()

    class Hung(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            release.wait(5)
            return SpanExportResult.FAILURE

    tracing = Tracing("svc", {}, exporter=Hung())
    tracing.begin("request", {}).end()
    started = time.monotonic()
    try:
        assert tracing.shutdown(timeout=0.3) is False
        assert time.monotonic() - started < 1.5
    finally:
        release.set()
