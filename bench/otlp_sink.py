"""An OTLP/HTTP trace receiver on 127.0.0.1, for tests and benchmarks: what a collector would be sent.

Owns: `OtlpSink`, a threaded HTTP server that takes `POST /v1/traces` (protobuf
`ExportTraceServiceRequest`, as the services' exporter sends it), answers as a collector does, counts
every span and keeps the latest `keep` of them decoded (`SpanSeen`). Must not: reach past loopback.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ERROR = 2  # OTLP's STATUS_CODE_ERROR


@dataclass(frozen=True)
class SpanSeen:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent: str  # "" for a trace's root
    attributes: dict[str, Any]
    error: bool


class OtlpSink:
    def __init__(self, keep: int = 10_000) -> None:
        self.count = 0
        self.spans: collections.deque[SpanSeen] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
                sink._take(export)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"  # OTEL_EXPORTER_OTLP_ENDPOINT
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    def _take(self, export: ExportTraceServiceRequest) -> None:
        for resource in export.resource_spans:
            service = next((a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                seen = [SpanSeen(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                 {a.key: _value(a.value) for a in s.attributes}, s.status.code == ERROR)
                        for s in scope.spans]
                with self._lock:
                    self.count += len(seen)
                    self.spans.extend(seen)

    def of_trace(self, trace_id: str) -> list[SpanSeen]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
