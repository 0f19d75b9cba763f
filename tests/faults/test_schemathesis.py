"""Schemathesis against both services' OpenAPI specs, on real processes.

A real coordinator (`--queue-size 0`, so a full pool refuses at once) and a real worker on the
simulated engine (the API and its refusals are the same as with llama.cpp, and a stream takes
milliseconds) are started on loopback. Each service's live `/openapi.json` is loaded with
schemathesis, and every operation gets schema-conforming (positive) and schema-breaking (negative)
requests, a bounded and derandomized number of each, sent to the live servers. Every answer must:

- not be a server error: no 5xx at all (with one idle worker and room to spare, even a documented
  502 or 503 would be a fault here);
- if 4xx, be JSON in the surface's error shape: `{error, reason, request_id}` outside `/v1/`,
  OpenAI's `{"error": {message, type, param, code}}` under `/v1/`;
- have a status, content type, headers and body the spec documents for it (schemathesis's own
  conformance checks); a 200 from a generation route is `text/event-stream`, and its stream ends
  with its terminal event (`done` or `error`; OpenAI's `[DONE]`);
- never echo a malformed `X-Request-ID` (the negative cases send many).

Failures are collected rather than raised inside Hypothesis, so nothing is shrunk and the run stays
bounded; each distinct failure is reported once with a curl reproducer.
The worker token is left unset, so heartbeats are in the run too (KNOWN_GAPS says what their spec
lacks). docs/schemathesis.md has the figures.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis.configuration import set_hypothesis_home_dir
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from protocol.sse import SseParser
from protocol.worker import REQUEST_ID_HEADER
from tests.integration.conftest import start_coordinator, start_worker
from tests.polling import wait_until

# Per operation and generation mode: 30 by default (the ladder's 6 minutes), 50 with FAULTS_LONG=1 (the
# figures of docs/schemathesis.md).
EXAMPLES = 50 if os.environ.get("FAULTS_LONG") == "1" else 30
DEADLINE = timedelta(seconds=10)  # for one example (one request); a stream here lasts milliseconds
REQUEST_TIMEOUT = 15.0
WORKER_FLAGS = ["--engine", "simulated", "--sim-token-rate", "5000", "--max-sessions", "256",
                "--session-max-tokens", "256", "--session-ttl", "5", "--heartbeat-interval", "0.5"]

# In the order they run. Heartbeats go last: fuzzed heartbeats could register made-up workers (no worker
# token here, as with a default ./start.sh; now only those whose loopback URL answers the coordinator's
# probe as that worker), and the generation routes should be fuzzed against the one real worker.
COORDINATOR_OPERATIONS = [
    "GET /coordinator/health", "GET /health", "GET /coordinator/ready", "GET /coordinator/health/workers",
    "POST /coordinator/infer",
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/embeddings",
    "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items", "POST /v1/responses/compact",
    "POST /v1/messages", "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /coordinator/status", "GET /metrics", "POST /coordinator/health/heartbeat",
    "DELETE /coordinator/sessions/{session_id}", "POST /tokenize", "POST /detokenize", "GET /tokenizer_info",
    "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content",
    "DELETE /v1/files/{file_id}", "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
    "POST /v1/batches/{batch_id}/cancel"]
WORKER_OPERATIONS = ["POST /worker/generate", "POST /worker/embed", "GET /worker/health", "GET /worker/sessions",
                     "DELETE /worker/sessions/{session_id}", "GET /worker/sessions/{session_id}/kv",
                     "PUT /worker/sessions/{session_id}/kv", "POST /worker/prefix", "GET /metrics",
                     "POST /worker/tokenize", "POST /worker/detokenize", "POST /worker/tokenizer_info",
                     "POST /worker/models/load", "PUT /worker/responses/{response_id}",
                     "GET /worker/responses/{response_id}", "DELETE /worker/responses/{response_id}",
                     "POST /worker/responses/handover"]
# What this test found in routes whose OpenAPI metadata is not described yet, each with its fix:
# these operations xfail on exactly these findings, fail on any other, and fail once one is gone
# (then delete its line). None is a server error.
KNOWN_GAPS: dict[str, dict[str, str]] = {}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
# Read every event of a stream (schemathesis stops at 20 by default; sessions end at 256 tokens here, and a
# worker request of n choices streams each one's: 8 x 128 tokens was cut at an earlier bound of 1,000 events),
# and show reproducers as sent (it masks keys that look secret, such as max_tokens and session_id).
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {"max-stream-events": 40_000, "output": {"sanitization": {"enabled": False}}})
# A request id either service takes from the client; any other is replaced, never echoed.
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The terminal event of each generation route's stream.
STREAM_ENDS = {"/coordinator/infer": {"done", "error"}, "/worker/generate": {"done", "error"},
               "/v1/chat/completions": {"[DONE]"}, "/v1/completions": {"[DONE]"},
               "/v1/responses": {"response.completed", "response.incomplete", "response.failed"}}


@dataclass
class Services:
    coordinator: str
    worker: str
    schemas: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    logs = tmp_path_factory.mktemp("schemathesis")
    set_hypothesis_home_dir(logs / "hypothesis")  # its caches go there, not into the work tree
    # Fuzzed heartbeats from new ids are probed at their URLs before registration: only loopback ones.
    coordinator, url = start_coordinator(logs, "coordinator", "--queue-size", "0", "--heartbeat-interval", "1",
                                         "--worker-url-pattern", r"http://127\.0\.0\.1:[0-9]{1,5}")
    worker, worker_url = start_worker(logs, "sim", url, logs / "none.gguf", *WORKER_FLAGS)
    try:
        wait_until(lambda: httpx.get(url + "/coordinator/health", timeout=1).json()["workers"]["alive"] == 1,
                   30, "the simulated worker to register")
        found = Services(url, worker_url)
        for name, base in (("coordinator", found.coordinator), ("worker", found.worker)):
            found.schemas[name] = schemathesis.openapi.from_url(base + "/openapi.json", config=CONFIG)
        yield found
    finally:
        worker.stop()
        coordinator.stop()
        set_hypothesis_home_dir(None)


@dataclass
class Findings:
    """Distinct failures ("<status> <what>"), each with the first request that showed it."""

    sent: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # "pos 404 unknown_model": how many
    failures: dict[str, str] = field(default_factory=dict)

    def add(self, status: int, what: str, reproducer: str) -> None:
        self.failures.setdefault(f"{status} {what}", reproducer)

    def report(self, keys: set[str]) -> str:
        return "\n".join(f"{key}\n    {self.failures[key]}" for key in sorted(keys))


def reason_of(response: Any) -> str:
    """The `reason` of an error body (OpenAI's `code`), for the figures; "" for anything else."""
    try:
        body = json.loads(response.content)
        error = body.get("error")
        found = error.get("code") if isinstance(error, dict) else body.get("reason")
    except (ValueError, AttributeError):
        return ""
    return found if isinstance(found, str) else ""


def content_type(response: Any) -> str:
    return (response.headers.get("content-type") or [""])[0]


def error_shape_problem(path: str, response: Any) -> str | None:
    """What is wrong with a 4xx answer's body, or None: JSON in the surface's error shape."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return "a 4xx whose body is not JSON"
    if not isinstance(body, dict):
        return "a 4xx whose JSON is not an object"
    if path.startswith("/v1/messages"):
        error = body.get("error")
        if body.get("type") != "error" or not isinstance(error, dict) or not {"type", "message"} <= set(error):
            return "a 4xx under /v1/messages not in Anthropic's error shape"
    elif path.startswith("/v1/"):
        error = body.get("error")
        if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
            return "a 4xx under /v1/ not in OpenAI's error shape"
    elif set(body) != {"error", "reason", "request_id"}:
        return "a 4xx not in the {error, reason, request_id} shape"
    return None


def stream_problem(path: str, response: Any) -> str | None:
    """What is wrong with a 200 event stream, or None: it ends with the route's terminal event."""
    ends = STREAM_ENDS.get(path)
    if ends is None or not content_type(response).startswith("text/event-stream"):
        return None
    events = SseParser().feed(response.content)
    last = events[-1] if events else None
    if last is None or (last.event not in ends and last.data not in ends):
        return f"a stream that does not end with {sorted(ends)}"
    return None


def fuzz(operation: Any, base_url: str, mode: GenerationMode, findings: Findings) -> None:
    """Sends up to EXAMPLES generated cases; records what fails instead of raising, so Hypothesis
    neither stops at the first failure nor spends time shrinking it."""

    @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=DEADLINE,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT)
        status = response.status_code
        findings.sent += 1
        outcome = f"{mode.value[:3]} {status} {reason_of(response)}".strip()
        findings.outcomes[outcome] = findings.outcomes.get(outcome, 0) + 1
        reproducer = f"{case.as_curl_command()}  # {mode.value} case -> {status} {response.content[:300]!r}"
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            for failure in group.exceptions:
                findings.add(status, failure.title, reproducer)
        own: list[Callable[[str, Any], str | None]] = [stream_problem]
        if 400 <= status < 500:
            own.append(error_shape_problem)
        for check in own:
            problem = check(operation.path, response)
            if problem is not None:
                findings.add(status, problem, reproducer)
        sent_id = (case.headers or {}).get(REQUEST_ID_HEADER)
        echoed = response.headers.get(REQUEST_ID_HEADER, [])
        if sent_id and not VALID_REQUEST_ID.fullmatch(sent_id) and sent_id in echoed:
            findings.add(status, "a malformed X-Request-ID echoed back", reproducer)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        # A route with no body and no parameters has nothing a request could get wrong.
        assert mode is GenerationMode.NEGATIVE, "no positive case could be generated"


def test_the_specs_list_every_route(services: Services) -> None:
    for name, expected in (("coordinator", COORDINATOR_OPERATIONS), ("worker", WORKER_OPERATIONS)):
        labels = sorted(result.ok().label for result in services.schemas[name].get_all_operations())
        assert labels == sorted(expected), name


def test_the_infer_route_documents_its_body_and_event_stream(services: Services) -> None:
    spec = httpx.get(services.coordinator + "/openapi.json", timeout=5).json()
    infer = spec["paths"]["/coordinator/infer"]["post"]
    assert infer["requestBody"]["content"]["application/json"]["schema"]["required"] == ["prompt"]
    assert list(infer["responses"]["200"]["content"]) == ["text/event-stream"]
    assert {"400", "404", "409", "413", "502", "503"} <= set(infer["responses"])


@pytest.mark.parametrize("service, label", [*(("coordinator", op) for op in COORDINATOR_OPERATIONS),
                                            *(("worker", op) for op in WORKER_OPERATIONS)])
def test_fuzzed_requests_get_documented_answers(services: Services, service: str, label: str) -> None:
    operation = services.schemas[service].find_operation_by_label(label)
    assert operation is not None, label
    base_url = services.coordinator if service == "coordinator" else services.worker
    findings = Findings()
    started = time.monotonic()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        fuzz(operation, base_url, mode, findings)
    took = time.monotonic() - started
    print(f"\nSCHEMATHESIS {service} {label}: {findings.sent} requests in {took:.1f} s: "
          f"{dict(sorted(findings.outcomes.items()))}")
    assert findings.sent > 0
    known = KNOWN_GAPS.get(f"{service} {label}", {})
    new = set(findings.failures) - set(known)
    assert not new, findings.report(new)
    gone = set(known) - set(findings.failures)
    assert not gone, f"fixed, delete from KNOWN_GAPS: {sorted(gone)}"
    if known:
        pytest.xfail("; ".join(known.values()) + "\n" + findings.report(set(known)))
