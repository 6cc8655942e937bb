"""A real OTLP/HTTP receiver on loopback for the tests: what a Collector's `otlphttp` receiver does,
minus the pipeline.

    with OtlpReceiver() as rx:                      # http://127.0.0.1:<free port>
        exporter = OTLPLogExporter(endpoint=rx.endpoint + "/v1/logs")
        ...
        rx.wait_for_events(3)                       # decoded log records, flattened
        rx.events()[0].attributes["gen_ai.evaluation.name"]
        rx.spans()                                  # decoded spans of POST /v1/traces
        rx.requests                                 # every request: path, headers, encoding, status
        rx.fail_next("/v1/logs", 503, times=1, retry_after=0)   # scripted failures
        rx.stop(); rx.start()                       # down, then up again on the same port

A threaded `http.server` speaking HTTP/1.1 with keep-alive (as the SDK's `requests` session expects);
`stop()` also closes the open keep-alive connections, so a stopped receiver really refuses. Bodies
are decoded with opentelemetry-proto (`ExportLogsServiceRequest`, `ExportTraceServiceRequest`) after
undoing `Content-Encoding: gzip` / `deflate`. Only `application/x-protobuf` is accepted (415
otherwise), like the SDK's exporters send it.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedEvent", "ReceivedRequest", "ReceivedSpan", "any_value", "attributes"]

_SIGNALS = {
    "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse),
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
}


def any_value(v: AnyValue) -> Any:
    """An OTLP AnyValue as a Python value (arrays as lists, key-value lists as dicts)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def _typed(kvs: Any) -> dict[str, str]:
    """Attribute name -> the AnyValue field that holds it (`double_value`, `string_value`, …)."""
    return {kv.key: kv.value.WhichOneof("value") for kv in kvs}


@dataclass(frozen=True)
class ReceivedRequest:
    path: str
    headers: dict[str, str]  # names lowercased
    content_encoding: str | None
    status: int
    body_bytes: int  # as received (compressed)


@dataclass(frozen=True)
class ReceivedEvent:
    """One log record of a POST /v1/logs, with its resource and scope."""

    event_name: str
    trace_id: str  # 32 hex, "" when absent
    span_id: str  # 16 hex, "" when absent
    flags: int
    severity_number: int
    severity_text: str
    time_unix_nano: int
    observed_time_unix_nano: int
    body: Any
    attributes: dict[str, Any]
    attribute_types: dict[str, str]
    resource: dict[str, Any]
    scope_name: str
    scope_version: str


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    flags: int
    kind: int
    status_code: int
    status_message: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]
    attribute_types: dict[str, str]
    resource: dict[str, Any]
    scope_name: str


@dataclass
class _Failure:
    status: int
    times: int
    retry_after: float | None = None


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[ReceivedRequest] = field(default_factory=list)
    logs: list[ExportLogsServiceRequest] = field(default_factory=list)
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    failures: dict[str, list[_Failure]] = field(default_factory=dict)
    connections: set[socket.socket] = field(default_factory=set)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.state.lock:
            self.server.state.connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.state.lock:
                self.server.state.connections.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the test asserts on `requests`

    def do_POST(self) -> None:
        state = self.server.state
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        encoding = headers.get("content-encoding")
        status, body, content_type, extra, message = self._handle(raw, headers, encoding)
        # Recorded before the answer leaves: a client that saw 200 finds its request here.
        with state.lock:
            state.requests.append(ReceivedRequest(self.path, headers, encoding, status, len(raw)))
            if message is not None:
                kept = state.logs if isinstance(message, ExportLogsServiceRequest) else state.traces
                kept.append(message)
            state.changed.notify_all()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self, raw: bytes, headers: dict[str, str], encoding: str | None
                ) -> tuple[int, bytes, str, dict[str, str], Any]:
        signal = _SIGNALS.get(self.path)
        if signal is None:
            return 404, b"unknown path", "text/plain", {}, None
        with self.server.state.lock:
            queue = self.server.state.failures.get(self.path) or []
            failure = queue[0] if queue else None
            if failure is not None:
                failure.times -= 1
                if failure.times <= 0:
                    queue.pop(0)
        if failure is not None:
            extra = {"Retry-After": f"{failure.retry_after:g}"} if failure.retry_after is not None else {}
            return failure.status, b"scripted failure", "text/plain", extra, None
        if headers.get("content-type", "").split(";")[0].strip() != "application/x-protobuf":
            return 415, b"only application/x-protobuf", "text/plain", {}, None
        try:
            if encoding == "gzip":
                raw = gzip.decompress(raw)
            elif encoding == "deflate":
                raw = zlib.decompress(raw)
            elif encoding not in (None, "", "identity"):
                raise ValueError(encoding)
            request_type, response_type = signal
            message = request_type.FromString(raw)
        except Exception:  # a body we cannot read is the client's error, as a Collector answers
            return 400, b"undecodable body", "text/plain", {}, None
        return 200, response_type().SerializeToString(), "application/x-protobuf", {}, message


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, state: _State) -> None:
        self.state = state
        super().__init__(("127.0.0.1", port), _Handler)


class OtlpReceiver:
    """POST /v1/logs and /v1/traces on 127.0.0.1; every request recorded, bodies decoded."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self._state = _State()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """The base URL an exporter is given (`/v1/logs` and `/v1/traces` below it)."""
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        """Listen (again, on the same port after a `stop`)."""
        assert self._server is None, "already started"
        self._server = _Server(self.port, self._state)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"otlp-receiver-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop the open connections: clients get connection errors until `start`."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._state.lock:
            conns = list(self._state.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        assert self._thread is not None
        self._thread.join(10)
        self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting -------------------------------------------------------------------------------

    def fail_next(self, path: str, status: int, *, times: int = 1, retry_after: float | None = None) -> None:
        """Answer the next `times` requests to `path` with `status` (and `Retry-After` when given)."""
        with self._state.lock:
            self._state.failures.setdefault(path, []).append(_Failure(status, times, retry_after))

    def clear(self) -> None:
        with self._state.lock:
            self._state.requests.clear()
            self._state.logs.clear()
            self._state.traces.clear()

    # -- what arrived ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[ReceivedRequest]:
        with self._state.lock:
            return list(self._state.requests)

    def requests_to(self, path: str) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.path == path]

    def events(self, event_name: str | None = None) -> list[ReceivedEvent]:
        """Every log record received, in arrival order (only `event_name` ones when given)."""
        with self._state.lock:
            messages = list(self._state.logs)
        out = []
        for message in messages:
            for rl in message.resource_logs:
                resource = attributes(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for lr in sl.log_records:
                        if event_name is not None and lr.event_name != event_name:
                            continue
                        out.append(ReceivedEvent(
                            event_name=lr.event_name, trace_id=lr.trace_id.hex(), span_id=lr.span_id.hex(),
                            flags=lr.flags, severity_number=lr.severity_number,
                            severity_text=lr.severity_text, time_unix_nano=lr.time_unix_nano,
                            observed_time_unix_nano=lr.observed_time_unix_nano,
                            body=any_value(lr.body) if lr.HasField("body") else None,
                            attributes=attributes(lr.attributes), attribute_types=_typed(lr.attributes),
                            resource=resource, scope_name=sl.scope.name, scope_version=sl.scope.version))
        return out

    def spans(self) -> list[ReceivedSpan]:
        with self._state.lock:
            messages = list(self._state.traces)
        out = []
        for message in messages:
            for rs in message.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(ReceivedSpan(
                            name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(), flags=s.flags, kind=s.kind,
                            status_code=s.status.code, status_message=s.status.message,
                            start_time_unix_nano=s.start_time_unix_nano,
                            end_time_unix_nano=s.end_time_unix_nano, attributes=attributes(s.attributes),
                            attribute_types=_typed(s.attributes), resource=resource,
                            scope_name=ss.scope.name))
        return out

    def wait_for(self, predicate: Callable[[OtlpReceiver], bool], timeout: float = 10.0) -> None:
        """Block until `predicate(self)` holds, re-checked at every request (no polling); AssertionError
        after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._state.lock:
                seen = len(self._state.requests)
            if predicate(self):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the OTLP receiver did not see that within {timeout:g}s; requests: "
                                     f"{[(r.path, r.status) for r in self.requests]}")
            with self._state.changed:
                self._state.changed.wait_for(lambda n=seen: len(self._state.requests) != n, remaining)

    def wait_for_events(self, n: int, timeout: float = 10.0) -> list[ReceivedEvent]:
        self.wait_for(lambda rx: len(rx.events()) >= n, timeout)
        return self.events()

