"""The edge limits (serving/edge.py) on real processes: a coordinator and a simulated-engine worker
(the limits sit in front of the app, so no model is needed), spoken to over raw sockets so that the
tests can send what no well-behaved client would."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coordinator.app import HEARTBEAT_MAX_BYTES
from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator
from tests.polling import wait_until

# A coordinator and a worker, each a process of its own.
pytestmark = pytest.mark.process
TIMEOUT = 1.5  # header and body deadlines given to both services here


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    logs = tmp_path_factory.mktemp("edge")
    coordinator, url = start_coordinator(logs, "coordinator", "--header-timeout", str(TIMEOUT), "--body-timeout",
                                         str(TIMEOUT), "--max-body-bytes", "65536")
    port = free_port()
    worker = Proc("worker", [sys.executable, "-m", "worker", "--port", str(port), "--engine", "simulated",
                             "--model-path", str(logs / "none.gguf"), "--header-timeout", str(TIMEOUT),
                             "--body-timeout", str(TIMEOUT), "--max-body-bytes", "65536"], logs / "worker.log")
    worker.start()
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/worker/health", timeout=1).status_code == 200, 30,
                   "the simulated worker")
        yield int(url.rsplit(":", 1)[1]), port
    finally:
        worker.stop()
        coordinator.stop()


def exchange(port: int, data: bytes, *, trickle: float = 0.0, wait: float = 10.0) -> tuple[bytes, float]:
    """Sends `data` (a byte at a time every `trickle` s, if set) and reads until the peer closes;
    returns what came back and how long that took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        try:
            if trickle:
                for byte in data:
                    sock.sendall(bytes([byte]))
                    time.sleep(trickle)
            else:
                sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we were done sending: what it said is still in our receive buffer
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received, time.monotonic() - started


def status_and_body(raw: bytes) -> tuple[int, dict]:  # type: ignore[type-arg]
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_twenty_megabytes_of_headers_get_431_without_being_read(services: tuple[int, int]) -> None:
    for port in services:
        raw, took = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 20) + b"\r\n\r\n")
        status, body = status_and_body(raw)
        assert status == 431 and body["reason"] == "headers_too_large" and took < 5


def test_a_header_line_that_never_ends_gets_431_at_the_limit_not_at_the_deadline(services: tuple[int, int]) -> None:
    """Before: a 200 MB header line with no line end was buffered whole until the header deadline (8 such
    connections took the coordinator to 510 MB), then answered 408. Now it is cut at the limit."""
    for port in services:
        raw, took = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20))
        status, body = status_and_body(raw)
        assert status == 431 and body["reason"] == "headers_too_large" and took < TIMEOUT - 0.5, (status, took)


def test_a_request_line_trickled_and_never_ended_gets_the_408_body(services: tuple[int, int]) -> None:
    """Before: a request whose first line never ended was closed at the deadline without a word."""
    for port in services:
        raw, took = exchange(port, b"POST /coordinator/inf", trickle=0.05)
        status, body = status_and_body(raw)
        assert status == 408 and body["reason"] == "request_timeout" and took < TIMEOUT + 2


def test_five_thousand_headers_get_431(services: tuple[int, int]) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
    for port in services:
        status, body = status_and_body(exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")[0])
        assert status == 431 and "100 headers" in body["error"]


def test_a_200_megabyte_heartbeat_is_refused_from_its_content_length(services: tuple[int, int]) -> None:
    coordinator, _ = services
    request = (b"POST /coordinator/health/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 209715200\r\n\r\n{")
    raw, took = exchange(coordinator, request)
    status, body = status_and_body(raw)
    assert status == 413 and body["reason"] == "body_too_large" and took < 2
    assert f"at most {HEARTBEAT_MAX_BYTES} are accepted" in body["error"]  # the heartbeat's own limit


def test_a_chunked_heartbeat_is_cut_as_it_grows_past_its_own_bound(services: tuple[int, int]) -> None:
    """The heartbeat route's bound (64 KiB) applies however the body is sent."""
    coordinator, _ = services
    chunk = b"a" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    raw, _ = exchange(coordinator, b"POST /coordinator/health/heartbeat HTTP/1.1\r\nHost: x\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n" + body)
    assert status_and_body(raw)[0] == 413


def test_a_large_worker_body_gets_413_before_it_is_read(services: tuple[int, int]) -> None:
    _, worker = services
    raw, took = exchange(worker, b"POST /worker/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n{")
    status, body = status_and_body(raw)
    assert status == 413 and set(body) == {"error", "reason", "request_id"} and took < 2


def test_openai_paths_get_openai_shaped_refusals(services: tuple[int, int]) -> None:
    coordinator, _ = services
    raw, _ = exchange(coordinator, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n")
    status, body = status_and_body(raw)
    assert status == 413 and body["error"]["code"] == "body_too_large"


def test_headers_trickled_a_byte_at_a_time_time_out(services: tuple[int, int]) -> None:
    for port in services:
        raw, took = exchange(port, b"POST /coordinator/infer HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200,
                             trickle=0.05)
        status, body = status_and_body(raw)
        assert status == 408 and body["reason"] == "request_timeout" and TIMEOUT - 0.1 <= took < TIMEOUT + 2


def test_a_body_that_never_finishes_times_out(services: tuple[int, int]) -> None:
    for port, path in zip(services, (b"/coordinator/infer", b"/worker/generate"), strict=True):
        raw, took = exchange(port, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"prompt\":")
        assert status_and_body(raw)[0] == 408 and took < TIMEOUT + 2


def test_a_connection_that_never_sends_a_request_is_closed(services: tuple[int, int]) -> None:
    for port in services:
        raw, took = exchange(port, b"")
        assert raw == b"" and TIMEOUT - 0.1 <= took < TIMEOUT + 2


def test_the_worker_answers_unknown_routes_with_its_error_body_and_does_not_echo_odd_request_ids(
        services: tuple[int, int]) -> None:
    _, worker = services
    missing = httpx.get(f"http://127.0.0.1:{worker}/nope", headers={"X-Request-ID": "bad id\twith tab"}, timeout=5)
    assert missing.status_code == 404 and set(missing.json()) == {"error", "reason", "request_id"}
    assert missing.headers["x-request-id"] != "bad id\twith tab" and "\t" not in missing.headers["x-request-id"]
    kept = httpx.get(f"http://127.0.0.1:{worker}/nope", headers={"X-Request-ID": "req-1.2:3"}, timeout=5)
    assert kept.headers["x-request-id"] == "req-1.2:3"


def test_well_formed_requests_still_pass(services: tuple[int, int]) -> None:
    coordinator, worker = services
    assert httpx.get(f"http://127.0.0.1:{coordinator}/coordinator/health", timeout=5).status_code == 200
    assert httpx.get(f"http://127.0.0.1:{worker}/worker/health", timeout=5).status_code == 200
    # Keep-alive: a second request on the same connection, after the first response, is served.
    with httpx.Client(base_url=f"http://127.0.0.1:{coordinator}", timeout=5) as client:
        for _ in range(3):
            assert client.get("/coordinator/health").status_code == 200
            time.sleep(0.3)


def test_a_client_leaving_mid_body_is_logged_as_client_gone_not_a_traceback(tmp_path: Path) -> None:
    """Before: an unhandled ClientDisconnect traceback in the coordinator's log."""
    coordinator, url = start_coordinator(tmp_path, "coordinator-disconnect")
    try:
        port = int(url.rsplit(":", 1)[1])
        for path in (b"/coordinator/infer", b"/v1/chat/completions"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half")
                time.sleep(0.3)  # the app is reading the body now
        wait_until(lambda: "client_gone" in coordinator.log_path.read_text(), 5, "the request logged as client_gone")
        assert "Traceback" not in coordinator.log_path.read_text()
    finally:
        coordinator.stop()
