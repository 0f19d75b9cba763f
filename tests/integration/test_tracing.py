"""OpenTelemetry traces across a real coordinator and a real worker, received by an OTLP/HTTP receiver in
this test (bench/otlp_sink.py: the protobuf `ExportTraceServiceRequest` that any collector takes): a client's `traceparent`
is continued, one request is one trace across both services, the coordinator's span is a child of the
client's and the worker's of the coordinator's attempt, with the engine's steps; refusals carry their
reason; log lines carry the trace id; a session moved off a draining worker is a trace of its own, with
both workers' spans in it.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.otlp_sink import OtlpSink, SpanSeen
from tests.faults.pool import FaultPool
from tests.polling import wait_until

pytestmark = pytest.mark.model


@contextlib.contextmanager
def traced(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: tuple[str, ...]
           ) -> Iterator[tuple[FaultPool, OtlpSink]]:
    receiver = OtlpSink()
    # The processes read these at start (Proc passes this process's environment on).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # milliseconds between exports
    pool = FaultPool(tmp_path, model_path, worker_ids=workers)
    try:
        pool.ensure()
        yield pool, receiver
    finally:
        pool.stop()
        receiver.close()


@pytest.fixture
def traced_pool(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FaultPool, OtlpSink]]:
    with traced(model_path, tmp_path, monkeypatch, ("t1",)) as running:
        yield running


def test_one_request_is_one_trace_across_both_services_under_the_clients_span(
        traced_pool: tuple[FaultPool, OtlpSink]) -> None:
    pool, receiver = traced_pool
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answer = httpx.post(pool.url + "/v1/chat/completions", timeout=60,
                        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                        json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
    assert answer.status_code == 200
    want = {("llm-pool-coordinator", "openai-chat request"), ("llm-pool-coordinator", "dispatch"),
            ("llm-pool-worker", "worker generate"), ("llm-pool-worker", "prefill"), ("llm-pool-worker", "decode")}
    wait_until(lambda: want <= {(s.service, s.name) for s in receiver.of_trace(trace_id)}, 10,
               "both services' spans to arrive")
    spans = {s.name: s for s in receiver.of_trace(trace_id)}
    request, dispatch, generate = spans["openai-chat request"], spans["dispatch"], spans["worker generate"]
    assert request.parent == client_span  # the client's trace, continued
    assert spans["placement"].parent == request.span_id and dispatch.parent == request.span_id
    assert generate.parent == dispatch.span_id  # the coordinator passed the attempt's context on
    for step in ("admission", "queue", "prefill", "decode"):
        assert spans[step].parent == generate.span_id and spans[step].service == "llm-pool-worker"
    assert request.attributes["llm_pool.worker"] == dispatch.attributes["llm_pool.worker"] == "t1"
    assert request.attributes["llm_pool.completion_tokens"] == spans["decode"].attributes["llm_pool.completion_tokens"]
    assert spans["prefill"].attributes["llm_pool.prompt_tokens"] > 0 and "llm_pool.cached_tokens" in spans["prefill"].attributes
    assert not any(s.error for s in spans.values())
    # Log lines carry the trace id, in both services.
    wait_until(lambda: all(trace_id in (pool.log_dir / f"{name}.log").read_text() for name in ("coordinator", "t1")),
               5, "the request's log lines")


def test_an_embedding_request_is_one_trace_across_both_services_too(traced_pool: tuple[FaultPool, OtlpSink]) -> None:
    pool, receiver = traced_pool
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answer = httpx.post(pool.url + "/v1/embeddings", timeout=60,
                        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                        json={"input": ["one sentence", "and another"]})
    assert answer.status_code == 200, answer.text
    want = {"openai-embeddings request", "placement", "dispatch", "worker embed"}
    wait_until(lambda: want <= {s.name for s in receiver.of_trace(trace_id)}, 10, "both services' spans to arrive")
    spans = {s.name: s for s in receiver.of_trace(trace_id)}
    request, dispatch, embed = spans["openai-embeddings request"], spans["dispatch"], spans["worker embed"]
    assert request.parent == client_span and request.service == "llm-pool-coordinator"
    assert spans["placement"].parent == dispatch.parent == request.span_id
    assert embed.parent == dispatch.span_id and embed.service == "llm-pool-worker"
    assert request.attributes["llm_pool.inputs"] == embed.attributes["llm_pool.inputs"] == 2
    assert embed.attributes["llm_pool.tokens"] > 0 and not any(s.error for s in spans.values())
    wait_until(lambda: all(trace_id in (pool.log_dir / f"{name}.log").read_text() for name in ("coordinator", "t1")),
               5, "the request's log lines")


def test_a_refusal_is_a_span_in_error_with_its_reason_and_a_request_without_traceparent_starts_a_trace(
        traced_pool: tuple[FaultPool, OtlpSink]) -> None:
    pool, receiver = traced_pool
    trace_id = secrets.token_hex(16)
    refused = httpx.post(pool.url + "/coordinator/infer", timeout=30,
                         headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
                         json={"prompt": "hi", "model": "no-such-model"})
    assert refused.status_code == 404
    wait_until(lambda: receiver.of_trace(trace_id), 10, "the refusal's span")
    (span,) = receiver.of_trace(trace_id)
    assert span.name == "infer request" and span.error and span.attributes["llm_pool.reason"] == "unknown_model"
    before = {s.trace_id for s in list(receiver.spans)}
    assert httpx.post(pool.url + "/coordinator/infer", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    wait_until(lambda: any(s.name == "infer request" and s.trace_id not in before and s.parent == ""
                           for s in list(receiver.spans)), 10, "a new trace's root span")


def test_a_session_moved_off_a_draining_worker_is_one_trace_with_both_workers_spans(
        model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with traced(model_path, tmp_path, monkeypatch, ("t1", "t2")) as (pool, receiver):
        turn = httpx.post(pool.url + "/coordinator/infer", timeout=60,
                          json={"prompt": "Remember the number seven.", "max_tokens": 4, "session_id": "kept-1"})
        assert turn.status_code == 200
        source = turn.headers["x-worker-id"]
        pool.workers[source].signal(signal.SIGTERM)  # it drains: the coordinator moves its kept session

        def moved() -> list[SpanSeen]:
            return [s for s in list(receiver.spans) if s.name == "session move"
                    and s.attributes.get("llm_pool.outcome") == "moved"]

        wait_until(lambda: moved(), 20, "the session's move")
        (move,) = moved()
        target = move.attributes["llm_pool.to_worker"]
        assert move.service == "llm-pool-coordinator" and move.parent == "" and move.attributes["llm_pool.worker"] == source
        assert target != source and move.attributes["llm_pool.bytes"] > 0
        wait_until(lambda: {"kv export", "kv import"} <= {s.name for s in receiver.of_trace(move.trace_id)}, 10,
                   "both workers' spans")
        spans = {s.name: s for s in receiver.of_trace(move.trace_id)}
        assert spans["kv export"].parent == spans["kv import"].parent == move.span_id
        assert spans["kv export"].attributes["llm_pool.bytes"] == move.attributes["llm_pool.bytes"]


def test_a_collector_that_never_answers_holds_no_process_s_stop_past_the_bound(
        model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: with a collector that takes connections and never answers, each process's stop waited
    ~17 s for its spans to fail to export, after its drain (past a supervisor's 30 s grace). The
    exporter's shutdown is bounded (serving/tracing.py SHUTDOWN_TIMEOUT): the stop is the drain and
    that bound."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel takes the connections; nobody reads them
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    pool = FaultPool(tmp_path, model_path, worker_ids=("t9",))
    try:
        pool.ensure()
        answer = httpx.post(pool.url + "/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        assert answer.status_code == 200
        procs = [pool.workers["t9"], pool.coordinator]
        started = time.monotonic()
        for proc in procs:
            assert proc is not None
            proc.terminate()
        took = {}
        for proc in procs:
            assert proc is not None and proc.popen is not None
            assert proc.popen.wait(timeout=60) == 0, proc.log_tail()
            took[proc.name] = time.monotonic() - started
        # Their drains (no stream: at once; the worker's handover wait 2 s) and the 2 s bound, with room.
        assert max(took.values()) < 8, took
        assert all("tracing_shutdown_timeout" in proc.log_path.read_text() for proc in procs if proc)
    finally:
        pool.stop()
        silent.close()
