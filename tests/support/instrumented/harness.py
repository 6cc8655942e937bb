"""Run one instrumented test app and write what it traced and what it did.

A test app (`apps/<name>.py`) is a small real program built on an agent framework and traced by that
framework's real instrumentation library from PyPI. It talks to `OpenAIStub`, a real OpenAI-compatible
HTTP server on loopback with scripted answers, so nothing leaves the machine. The app states, per
case, what it actually did (the question it asked, the answer the framework returned, the documents
its retriever returned, the tools that ran, whether it raised); the harness adds what the stub
answered (each model call's token usage) and which trace the case produced.

An app module defines:

    SERVICE = "langchain-rag"                 # the resource's service.name
    PACKAGES = ("langchain-core", ...)        # distributions whose versions go in the output
    def instrument(tracer_provider, logger_provider) -> None: ...   # the real instrumentor(s)
    def run(h: Harness) -> None:
        with h.case("answer") as c:
            answer = chain.invoke(question)
            c.expect(request=question, response=answer, context=[(text, uri)], tools=[])

Run it as a script, in any environment where the app's framework is installed:

    python tests/support/instrumented/harness.py APP OUT.json

Each app runs in its own process: instrumentors patch libraries globally, and the frameworks pin
conflicting versions of the same packages (see `generate.py` for the ones kept as fixtures). The
output is JSON: the spans as one OTLP `ExportTraceServiceRequest` (OTLP/JSON as the Collector's
`otlp_json` encoding writes it, and the protobuf bytes in base64, both from the SDK's own OTLP
encoder), any log records the app emitted (OTLP/JSON), the installed versions, and the cases.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

_TESTS = pathlib.Path(__file__).resolve().parents[2]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from google.protobuf.json_format import MessageToDict  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from support.openai_stub import OpenAIStub, StubRequest  # noqa: E402

FORMAT_VERSION = 1


@dataclass
class Expected:
    """What one case of an app actually did; `trace_id` and the token fields are the harness's."""

    case: str
    request: str | None = None
    response: str | None = None
    # (content, doc_uri) of every document the app's retriever returned, in order; None: no retriever.
    context: list[tuple[str, str | None]] | None = None
    # Names of the tools that ran, in order (a tool that raised still ran).
    tools: list[str] = field(default_factory=list)
    failed: bool = False
    note: str = ""
    trace_id: str | None = None
    # Usage the stub answered chat calls with, summed (each model call once).
    chat_calls: int = 0
    chat_input_tokens: int = 0
    chat_output_tokens: int = 0
    embedding_calls: int = 0
    embedding_tokens: int = 0


class Case:
    def __init__(self, name: str) -> None:
        self.expected = Expected(case=name)
        self._stated = False

    def expect(self, *, request: str | None, response: str | None,
               context: Sequence[tuple[str, str | None]] | None = None, tools: Sequence[str] = (),
               failed: bool = False, note: str = "") -> None:
        e = self.expected
        e.request, e.response, e.failed, e.note = request, response, failed, note
        e.context = None if context is None else [(c, u) for c, u in context]
        e.tools = list(tools)
        self._stated = True


class Harness:
    def __init__(self, service: str) -> None:
        self.stub = OpenAIStub().start()
        self.base_url = self.stub.base_url
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        trace.set_tracer_provider(self.tracer_provider)
        self.logger_provider, self._log_exporter = _logger_provider(service)
        self.cases: list[Expected] = []
        self._spans: list[ReadableSpan] = []

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[Case]:
        """One request of the app: exactly one trace must start and end inside the block."""
        case = Case(name)
        answered_before = len(self.stub.answered)
        seen = len(self.exporter.get_finished_spans())
        yield case
        self.tracer_provider.force_flush()
        if self.logger_provider is not None:
            self.logger_provider.force_flush()
        if not case._stated:
            raise RuntimeError(f"case {name!r} did not call expect()")
        spans = list(self.exporter.get_finished_spans())[seen:]
        traces = {format(s.context.trace_id, "032x") for s in spans}
        if len(traces) != 1:
            raise RuntimeError(f"case {name!r} produced {len(traces)} traces, expected one")
        case.expected.trace_id = traces.pop()
        for req, reply in list(self.stub.answered)[answered_before:]:
            _count(case.expected, req, reply.body)
        self.cases.append(case.expected)
        self._spans.extend(spans)

    def output(self, app: str, packages: Sequence[str]) -> dict[str, Any]:
        request = encode_spans(self._spans)
        versions = {}
        for dist in packages:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[dist] = importlib.metadata.version(dist)
        return {
            "format_version": FORMAT_VERSION,
            "app": app,
            "python": sys.version.split()[0],
            "versions": versions,
            "otlp_json": otlp_json(request),
            "otlp_proto_b64": base64.b64encode(request.SerializeToString()).decode(),
            "otlp_logs_json": self._logs_json(),
            "cases": [asdict(c) for c in self.cases],
        }

    def _logs_json(self) -> dict[str, Any] | None:
        if self._log_exporter is None:
            return None
        records = self._log_exporter.get_finished_logs()
        if not records:
            return None
        from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

        doc = MessageToDict(encode_logs(records), use_integers_for_enums=True)
        for rl in doc.get("resourceLogs", []):
            for sl in rl.get("scopeLogs", []):
                for rec in sl.get("logRecords", []):
                    _hex_ids(rec, ("traceId", "spanId"))
        return doc

    def close(self) -> None:
        self.stub.stop()


def _logger_provider(service: str) -> tuple[Any, Any]:
    """An SDK LoggerProvider with an in-memory exporter, for instrumentors that write GenAI content
    as log records (events). None where this SDK has no logs support."""
    try:
        from opentelemetry._logs import set_logger_provider
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    except ImportError:
        return None, None
    try:  # newer SDKs renamed it; older ones (some fixture apps pin them) have the old name only
        from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter as InMemory
    except ImportError:
        from opentelemetry.sdk._logs.export import InMemoryLogExporter as InMemory
    exporter = InMemory()
    provider = LoggerProvider(resource=Resource.create({"service.name": service}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    set_logger_provider(provider)
    return provider, exporter


def _count(e: Expected, req: StubRequest, body: bytes) -> None:
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        usage = {}
    if req.path.endswith("/embeddings"):
        e.embedding_calls += 1
        e.embedding_tokens += int(usage.get("prompt_tokens") or 0)
    elif req.path.endswith(("/chat/completions", "/responses")):
        e.chat_calls += 1
        e.chat_input_tokens += int(usage.get("prompt_tokens", usage.get("input_tokens")) or 0)
        e.chat_output_tokens += int(usage.get("completion_tokens", usage.get("output_tokens")) or 0)


def _hex_ids(obj: dict[str, Any], keys: Sequence[str]) -> None:
    for key in keys:
        if obj.get(key):
            obj[key] = base64.b64decode(obj[key]).hex()


def otlp_json(request: Any) -> dict[str, Any]:
    """OTLP/JSON as the Collector writes it: integer enums, hex trace and span ids."""
    doc = MessageToDict(request, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                _hex_ids(span, ("traceId", "spanId", "parentSpanId"))
                for link in span.get("links", []):
                    _hex_ids(link, ("traceId", "spanId"))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: harness.py APP OUT.json", file=sys.stderr)
        return 2
    app_name, out = args
    # No instrumentor may phone home or read a real key.
    os.environ.setdefault("OPENAI_API_KEY", "sk-test-not-a-real-key")
    sys.path.insert(0, str(pathlib.Path(__file__).with_name("apps")))
    app = importlib.import_module(app_name)
    harness = Harness(app.SERVICE)
    try:
        app.instrument(harness.tracer_provider, harness.logger_provider)
        app.run(harness)
        doc = harness.output(app_name, getattr(app, "PACKAGES", ()))
    finally:
        harness.close()
    pathlib.Path(out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
