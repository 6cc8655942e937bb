"""The OpenTelemetry sink (`tracejudge sink otlp`): every judge verdict of a result becomes a
`gen_ai.evaluation.result` event on its trace, sent over OTLP/HTTP (protobuf) to a collector.

The event is what the GenAI semantic conventions define: an OTLP log record with
`event_name = "gen_ai.evaluation.result"`, parented to what was evaluated through the record's trace
id and span id. One event per assessment that holds a verdict or a judge error; skipped judgements
(`not_sampled`, `missing_inputs`, …) write nothing.

| attribute | from the assessment |
|---|---|
| `gen_ai.evaluation.name` | `name` |
| `gen_ai.evaluation.score.value` (double) | `score`: the verdict mapped to [0, 1], 1 = good |
| `gen_ai.evaluation.score.label` | `"pass"` / `"fail"` from `passed`, when the judge gave one |
| `gen_ai.evaluation.explanation` | `rationale` |
| `error.type` / `error.message` | on a judge error: its reason (`connection`, `unparseable`, …) / the text |
| `tracejudge.evaluation.value` | `value`, the verdict in the judge's own scale (`"yes"`, `4`, …) |
| `tracejudge.evaluation.target` | `span` when the judge evaluated one span (`span_id`), else `trace` |
| `tracejudge.evaluation.id` | 32 hex digits naming the verdict, the same when it is sent again |
| `tracejudge.judge.source` / `.endpoint` / `.model` / `.version` | `source`, `judge.*` |
| `tracejudge.judge.input_tokens` / `.output_tokens` / `.duration_seconds` | the judgement's usage and time |
| `tracejudge.judge.sample_rate` | the judge's sample rate, when the result states it |
| `tracejudge.app`, `tracejudge.request_id`, `tracejudge.schema_version` | from the result |
| `tracejudge.source.format` / `.topic` / `.partition` / `.offset` | where the evaluated trace was read |
| `tracejudge.result.topic` / `.partition` / `.offset` | the result's own record on the results topic |

Parenting: the log record carries the result's `trace_id` and, as span id, the assessment's `span_id`
when the judge evaluated one span, else the result's `root_span_id` (the trace's root span) when the
result states it; without either it carries the trace id alone. A result without a 32-hex trace id
(an inference-log row, an MLflow 2 trace) cannot be placed on a trace: its verdicts are skipped and
counted (`tracejudge_sink_skipped_total{reason="no_trace_id"}`). A shadow judge's assessment
(`shadow_of` set) is a candidate's verdict, not the app's quality: skipped, reason `shadow`.

Session results (`"kind": "session"`, `SinkRecord.session`): each session judge's verdict is one event
parented to the session's last turn: that turn's trace id and, as span id, its root span id (without
one, the trace id alone); the last turn with a 32-hex trace id when the very last has none. Besides
the attributes above (`tracejudge.evaluation.target` = `session`), it carries `session.id` and
`gen_ai.conversation.id` = the session id, `tracejudge.session.evaluation` (the session's evaluation
number: a re-evaluated session sends new events, the earlier ones stay in the backend),
`tracejudge.session.status`, `.close_reason`, `.turns`, and `tracejudge.source.*` (where its turns
were read: topic, partition, `first_offset`, `last_offset`). Its `tracejudge.evaluation.id` hashes the
session, its evaluation number, the judge and the trace.

`emit_spans: true` also sends one short span per verdict (name `gen_ai.evaluation <judge>`, same
attributes, status ERROR on a judge error) in the evaluated trace: a child of the evaluated span
(parent = that span id, a remote parent), for trace-only backends such as Jaeger. Its span id is
derived from `tracejudge.evaluation.id`, so a re-sent verdict repeats the same span id.

`evaluator_attributes: true` adds the evaluator provenance attributes a proposal to the GenAI
conventions defines (open-telemetry/semantic-conventions-genai#359, not yet accepted: off by default,
names may change): `gen_ai.evaluation.evaluator.id` (the judge's name), `.version` (`judge.version`)
and `.type` (the kind of `source`: `llm`, `heuristic`, …), to the event and the span.

Findings (`"kind": "finding"` lines from `sink.findings_topic`): one `tracejudge.finding` event per
example trace, on that trace with no span id (`consumer/sinks/otlp_findings.py` has the attributes).

Export: the OpenTelemetry SDK's log record and span data types, encoded and sent by its OTLP/HTTP
exporters (`OTLPLogExporter`, `OTLPSpanExporter`), whose HTTP client retries 429, 502, 503, 504 and
connection errors with exponential backoff and `Retry-After` for up to `timeout_s`. `write` hands each
batch (in chunks of 512) to the exporter itself and returns only when the exporter reported success;
any failure raises `RetryLater`, so the runtime commits nothing past it and offers the batch again.
That includes answers no retry will change (401, 403, 400: the exporter does not say which it got):
the sink's lag grows until the configuration or the collector is fixed, and nothing is lost.
The SDK's `BatchLogRecordProcessor` is not used on purpose: its `force_flush()` returns True after an
export that failed (the records are dropped, the failure only logged) and it drops records when its
queue is full, which would commit offsets of verdicts that never arrived.

Delivery: at least once. OTLP has no idempotency key. Within one process the sink remembers which
verdicts (results-topic partition, offset, assessment) it has exported, per signal, for the last
100,000 verdicts: a batch offered again after a `RetryLater` (say the logs went out and the spans did
not) or after a rebalance that hands a partition back sends only what is missing and counts the rest
as `already_written`. After a crash or restart, results written but not yet committed are sent again:
a backend may then hold an event twice; both copies carry the same `tracejudge.evaluation.id` (and
the same span id for spans), which a query can deduplicate on.

Headers: `headers` from the configuration, then those of the environment variable `headers_env`
(default `OTEL_EXPORTER_OTLP_HEADERS`, the OpenTelemetry format `name=value,name2=value2` with
percent-encoded values), which win for the same name. Header values (tokens) are never logged. As with
any OpenTelemetry exporter, the SDK also adds `OTEL_EXPORTER_OTLP_HEADERS` /
`OTEL_EXPORTER_OTLP_LOGS_HEADERS` / `OTEL_EXPORTER_OTLP_TRACES_HEADERS` when set; the configured ones
win. The resource is `service.name = tracejudge` (plus `OTEL_RESOURCE_ATTRIBUTES`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Self
from urllib.parse import unquote, urlsplit

import orjson
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from prometheus_client import CollectorRegistry
from pydantic import Field, field_validator

from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, SinkSection, WriteReport
from tracejudge.consumer.sinks.otlp_findings import FINDING_EVENT, finding_events
from tracejudge.metrics.judges.secrets import SECRET, redact_url, url_problem
from tracejudge.metrics.telemetry.sinks import SinkWriteMetrics
from tracejudge.schemas.errors import ConfigError
from tracejudge.schemas.session import SessionResult
from tracejudge.schemas.version import __version__

__all__ = ["EVENT_NAME", "OtlpSink", "OtlpSinkSettings"]

log = logging.getLogger(__name__)

EVENT_NAME = "gen_ai.evaluation.result"
DEFAULT_ENDPOINT = "http://127.0.0.1:4318"
DEFAULT_HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"
# Records per OTLP request: the SDK batch processors' default export batch size.
MAX_EXPORT_BATCH = 512
# Verdicts whose export this process remembers (per signal), so a batch offered again is not re-sent.
REMEMBER_VERDICTS = 100_000
# Retry-after offered to the runtime after consecutive failed writes: 1, 2, 4, … up to this.

_COMPRESSIONS = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
# A judge error is "<reason>: <detail>" (tracejudge.metrics.judges.runner); the reason is low-cardinality.
_ERROR_REASON = re.compile(r"^([a-z][a-z0-9_.]{0,63}):")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("tracejudge.sink.otlp", __version__)

# Which signals of a verdict went out (bits of the remembered state).
_LOGS, _SPANS, _REPORTED = 1, 2, 4


# --- settings -----------------------------------------------------------------------------------


_COMPRESSION_NAMES = tuple(_COMPRESSIONS)


class OtlpSinkSettings(SinkSection):
    """The `sink.otlp` section. `headers` holds the effective headers (configured ones, overridden
    by the environment variable `headers_env` at start-up, `resolve`); their values are secrets
    (never shown, never quoted in an error)."""

    section_key: ClassVar[str] = "sink.otlp"

    # The OTLP/HTTP receiver's base URL (a Collector, or a backend's OTLP endpoint); `/v1/logs` and
    # `/v1/traces` are added to it.
    endpoint: str = DEFAULT_ENDPOINT
    # Headers sent with every export (an API key, a tenant); their values are secrets. Overridden by the
    # variable headers_env names.
    headers: Annotated[Mapping[str, str], SECRET] = Field(default_factory=dict, repr=False)
    # The environment variable holding more headers, `name=value,...` (over `headers`); empty: none.
    headers_env: str | None = DEFAULT_HEADERS_ENV
    # Also send one short span per verdict (`gen_ai.evaluation <judge>`), for trace backends that do not show
    # log events.
    emit_spans: bool = False
    # The evaluator provenance attributes (`gen_ai.evaluation.evaluator.id` / `.version` / `.type`) of a
    # GenAI conventions proposal not yet accepted (open-telemetry/semantic-conventions-genai#359).
    evaluator_attributes: bool = False
    # How long one export may take.
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # How exports are compressed: `gzip`, `deflate` or `none`.
    compression: str = "gzip"

    @property
    def logs_url(self) -> str:
        return self.endpoint + "/v1/logs"

    @property
    def traces_url(self) -> str:
        return self.endpoint + "/v1/traces"

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoint(cls, v: Any) -> str:
        return _endpoint(v)

    @field_validator("headers", mode="before")
    @classmethod
    def _headers(cls, v: Any) -> dict[str, str]:
        if isinstance(v, str):  # an environment override: the name=value,… form
            return parse_headers(v)
        if not isinstance(v, Mapping):
            raise ValueError(f"must be a mapping of header names to values, got {type(v).__name__}")
        headers: dict[str, str] = {}
        problems: list[tuple[str, str]] = []
        for name, value in v.items():
            try:
                headers[_header_name(name)] = _header_value(value)
            except ValueError as exc:
                problems.append((str(name), str(exc)))
        if problems:
            raise ConfigError(problems)  # each header's own key: `headers.<name>`
        return headers

    @field_validator("headers_env", mode="before")
    @classmethod
    def _headers_env(cls, v: Any) -> str | None:
        if v is None or v == "":
            return None
        if not (isinstance(v, str) and _ENV_NAME.match(v)):
            # Not quoted: a value here may be the headers themselves (`authorization=Bearer ...`).
            raise ValueError("must be the name of an environment variable (letters, digits and '_') that "
                             "holds the headers, not the headers")
        return v

    @field_validator("compression", mode="before")
    @classmethod
    def _compression(cls, v: Any) -> str:
        name = str(v).strip().lower()
        if name not in _COMPRESSIONS:
            raise ValueError(f"must be one of {', '.join(_COMPRESSION_NAMES)}, got {v!r}")
        return name

    def resolve(self, env: Mapping[str, str]) -> Self:
        """The headers of `headers_env` over the configured ones (a malformed variable names the
        variable and the entry, never a value)."""
        if not (self.headers_env and env.get(self.headers_env)):
            return self
        try:
            from_env = parse_headers(env[self.headers_env])
        except ValueError as exc:
            raise ConfigError("headers_env", f"{self.headers_env}: {exc}") from None
        return self.model_copy(update={"headers": {**self.headers, **from_env}})


def parse_headers(text: str) -> dict[str, str]:
    """Headers in the OpenTelemetry environment format: `name=value,name2=value2`, values
    percent-encoded. ValueError naming the bad entry by position (never quoting a value)."""
    out: dict[str, str] = {}
    for i, item in enumerate(text.split(","), start=1):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"entry {i} is not name=value")
        out[_header_name(unquote(name.strip()))] = _header_value(unquote(value.strip()))
    return out


def _header_name(name: Any) -> str:
    if not isinstance(name, str) or not _TOKEN.match(name):
        raise ValueError(f"not a valid HTTP header name: {name!r}")
    return name.lower()


def _header_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    text = str(value)
    if _BAD_VALUE.search(text):
        raise ValueError("must not contain line breaks")
    return text


def _endpoint(value: Any) -> str:
    """The collector's base URL; a bad one is quoted only through `redact_url` (never its credentials
    or query values)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a URL like {DEFAULT_ENDPOINT}, got {type(value).__name__}")
    text = value.strip()
    shown = redact_url(text)
    if problem := url_problem(text, credentials_go_in="sink.otlp.headers or headers_env"):
        raise ValueError(problem)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL like {DEFAULT_ENDPOINT}, got {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must be the collector's base URL, without a query, got {shown!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise ValueError(f"has an invalid port, got {shown!r}") from None
    base = text.rstrip("/")
    if base.endswith(("/v1/logs", "/v1/traces")):
        raise ValueError(f"must be the base URL (/v1/logs and /v1/traces are appended), got {shown!r}")
    return base


# --- the sink -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Verdict:
    key: tuple[str, int, int, int]  # results topic, partition, offset, assessment index
    record: SinkRecord
    assessment: dict[str, Any]
    trace_id: int
    span_id: int | None  # the evaluated span (or the root); None: the trace alone
    evaluation_id: str
    attributes: dict[str, Any]
    event_name: str = EVENT_NAME  # FINDING_EVENT for a finding (`otlp_findings`): no span is sent


class OtlpSink(Sink):
    """Writes each verdict as a `gen_ai.evaluation.result` event (and optionally a span) over
    OTLP/HTTP. Thread-safe: concurrent `write` calls are serialised."""

    kind: ClassVar[str] = "otlp"
    accepts_sessions: ClassVar[bool] = True
    accepts_findings: ClassVar[bool] = True

    def __init__(self, settings: OtlpSinkSettings, registry: CollectorRegistry | None = None, *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple[str, int, int, int], int] = OrderedDict()
        # Ours last: service.name is always tracejudge; OTEL_RESOURCE_ATTRIBUTES adds the rest.
        self._resource = Resource.create({"service.name": "tracejudge", "service.version": __version__})
        compression = _COMPRESSIONS[settings.compression]
        headers = dict(settings.headers)
        self._logs = OTLPLogExporter(endpoint=settings.logs_url, headers=headers,
                                     timeout=settings.timeout_s, compression=compression)
        self._spans = (OTLPSpanExporter(endpoint=settings.traces_url, headers=headers,
                                        timeout=settings.timeout_s, compression=compression)
                       if settings.emit_spans else None)

        metrics = SinkWriteMetrics(self.kind, registry if registry is not None else CollectorRegistry(),
                                   skip_reasons=("no_trace_id",),
                                   retry_reasons=("logs_export_failed", "spans_export_failed"))
        self._writes, self._skipped, self._retries = metrics.writes, metrics.skipped, metrics.retries

    # -- Sink ------------------------------------------------------------------------------------

    def setup(self) -> None:
        # Nothing to check without sending: a collector that is down at start-up only grows the lag.
        log.info("otlp sink: writing %s events to %s%s", EVENT_NAME, self.settings.logs_url,
                 f" and spans to {self.settings.traces_url}" if self.settings.emit_spans else "")

    def write(self, batch: SinkBatch) -> WriteReport:
        with self._lock:
            return self._write(batch)

    def close(self) -> None:
        with self._lock:
            self._logs.shutdown()
            if self._spans is not None:
                self._spans.shutdown()

    # -- internals -------------------------------------------------------------------------------

    def _write(self, batch: SinkBatch) -> WriteReport:
        report = WriteReport()
        verdicts = list(self._verdicts(batch, report))
        if self.settings.evaluator_attributes:
            for v in verdicts:
                if v.event_name == EVENT_NAME:
                    v.attributes.update(evaluator_attributes(v.assessment))
        now = self._clock()

        pending = [v for v in verdicts if not self._done.get(v.key, 0) & _LOGS]
        for chunk in _chunks(pending):
            result = self._logs.export([self._log_record(v, now) for v in chunk])
            if result is not LogRecordExportResult.SUCCESS:
                self._retry_later("logs_export_failed", self.settings.logs_url, len(chunk))
            self._mark(chunk, _LOGS)
        if self._spans is not None:
            pending = [v for v in verdicts if not self._done.get(v.key, 0) & _SPANS
                       and v.event_name == EVENT_NAME]
            for chunk in _chunks(pending):
                spans = [self._span(v, now) for v in chunk]
                if self._spans.export(spans) is not SpanExportResult.SUCCESS:
                    self._retry_later("spans_export_failed", self.settings.traces_url, len(chunk))
                self._mark(chunk, _SPANS)

        for v in verdicts:
            state = self._done.get(v.key, 0)
            if state & _REPORTED:
                report.already_written += 1
            else:
                report.written += 1
                self._done[v.key] = state | _REPORTED
        if report.written:
            self._writes.labels(self.kind, "written").inc(report.written)
        if report.already_written:
            self._writes.labels(self.kind, "already_written").inc(report.already_written)
        for reason, n in report.skipped.items():
            self._skipped.labels(self.kind, reason).inc(n)
        return report

    def _verdicts(self, batch: SinkBatch, report: WriteReport) -> Iterator[_Verdict]:
        for record in batch.records:
            if record.session is not None:
                yield from self._session_verdicts(record, record.session, report)
                continue
            if record.kind == "finding":
                events, skipped = finding_events(record)
                if skipped:
                    report.skip("no_trace_id", skipped)
                for index, trace_id, attrs in events:
                    yield _Verdict(key=(record.topic, record.partition, record.offset, index), record=record,
                                   assessment={}, trace_id=trace_id or 0, span_id=None,
                                   evaluation_id=attrs["tracejudge.finding.id"], attributes=attrs,
                                   event_name=FINDING_EVENT)
                continue
            result = record.result
            trace_hex = _hex_id(result.get("trace_id"), _HEX32)
            root_hex = _hex_id(result.get("root_span_id"), _HEX16)
            for index, a in enumerate(record.assessments()):
                if not isinstance(a, Mapping) or a.get("skipped") is not None:
                    continue  # a judgement that did not run has nothing to say
                if not isinstance(a.get("name"), str) or not a["name"]:
                    report.skip("invalid_assessment")
                    continue
                if a.get("shadow_of") is not None:
                    # a candidate judge's verdict (tracejudge.metrics.judges.trust.shadows)
                    report.skip("shadow")
                    continue
                if trace_hex is None:
                    report.skip("no_trace_id")
                    continue
                span_hex = _hex_id(a.get("span_id"), _HEX16)
                target = "span" if span_hex else "trace"
                parent_hex = span_hex or root_hex
                evaluation_id = _evaluation_id(record, index, a, trace_hex, span_hex)
                yield _Verdict(
                    key=(record.topic, record.partition, record.offset, index), record=record,
                    assessment=dict(a), trace_id=int(trace_hex, 16),
                    span_id=int(parent_hex, 16) if parent_hex else None, evaluation_id=evaluation_id,
                    attributes=_attributes(record, a, target, evaluation_id))

    def _session_verdicts(self, record: SinkRecord, session: SessionResult,
                          report: WriteReport) -> Iterator[_Verdict]:
        """A session result's verdicts, parented to the root span of its last turn (the last turn with
        a 32-hex trace id) in that turn's trace."""
        trace_hex = root_hex = None
        for turn in reversed(session.turns):
            trace_hex = _hex_id(turn.trace_id, _HEX32) or _hex_id(_strip_tr(turn.mlflow_trace_id), _HEX32)
            if trace_hex is not None:
                root_hex = _hex_id(turn.root_span_id, _HEX16)
                break
        for index, a in enumerate(record.assessments()):
            if not isinstance(a, Mapping) or a.get("skipped") is not None:
                continue
            if not isinstance(a.get("name"), str) or not a["name"]:
                report.skip("invalid_assessment")
                continue
            if trace_hex is None:
                report.skip("no_trace_id")
                continue
            evaluation_id = _session_evaluation_id(session, a, trace_hex)
            attributes = _attributes(record, a, "session", evaluation_id)
            attributes.update(_session_attributes(session))
            yield _Verdict(key=(record.topic, record.partition, record.offset, index), record=record,
                           assessment=dict(a), trace_id=int(trace_hex, 16),
                           span_id=int(root_hex, 16) if root_hex else None, evaluation_id=evaluation_id,
                           attributes=attributes)

    def _log_record(self, v: _Verdict, now: int) -> ReadableLogRecord:
        error = v.assessment.get("error") is not None
        parent = NonRecordingSpan(SpanContext(v.trace_id, v.span_id or 0, is_remote=True,
                                              trace_flags=_SAMPLED))
        context = set_span_in_context(parent, Context()) if v.trace_id else Context()
        record = LogRecord(
            timestamp=now, observed_timestamp=now, context=context,
            severity_number=SeverityNumber.WARN if error else SeverityNumber.INFO,
            severity_text="WARN" if error else "INFO", attributes=v.attributes, event_name=v.event_name)
        return ReadableLogRecord(log_record=record, resource=self._resource, instrumentation_scope=_SCOPE)

    def _span(self, v: _Verdict, now: int) -> ReadableSpan:
        a = v.assessment
        span_id = int(v.evaluation_id[:16], 16) or 1
        duration = a.get("duration_seconds")
        start = now - int(duration * 1e9) if _number(duration) and duration > 0 else now
        parent = (SpanContext(v.trace_id, v.span_id, is_remote=True, trace_flags=_SAMPLED)
                  if v.span_id else None)
        error_type = v.attributes.get("error.type")
        status = Status(StatusCode.ERROR, error_type) if error_type else Status(StatusCode.UNSET)
        return ReadableSpan(
            name=f"gen_ai.evaluation {a['name']}",
            context=SpanContext(v.trace_id, span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent, resource=self._resource, attributes=v.attributes, kind=SpanKind.INTERNAL,
            status=status, start_time=start, end_time=now, instrumentation_scope=_SCOPE)

    def _mark(self, verdicts: Sequence[_Verdict], signal: int) -> None:
        for v in verdicts:
            self._done[v.key] = self._done.get(v.key, 0) | signal
            self._done.move_to_end(v.key)
        while len(self._done) > REMEMBER_VERDICTS:
            self._done.popitem(last=False)

    def _retry_later(self, reason: str, url: str, n: int) -> None:
        self._retries.labels(self.kind, reason).inc()
        # A short base wait: the runtime doubles it for each failed offer of the same batch, up to
        # sink.max_retry_backoff_s (growing it here too would square the backoff).
        after = 1.0
        log.warning("otlp sink: exporting %d verdicts to %s failed; the batch is retried in %g s", n, url,
                    after)
        raise RetryLater(f"{reason}: {url}", after_s=after)


# --- event contents -----------------------------------------------------------------------------


def _attributes(record: SinkRecord, a: Mapping[str, Any], target: str, evaluation_id: str) -> dict[str, Any]:
    result = record.result
    attrs: dict[str, Any] = {"gen_ai.evaluation.name": a["name"]}
    if _number(a.get("score")):
        attrs["gen_ai.evaluation.score.value"] = float(a["score"])
    if isinstance(a.get("passed"), bool):
        attrs["gen_ai.evaluation.score.label"] = "pass" if a["passed"] else "fail"
    if isinstance(a.get("rationale"), str) and a["rationale"]:
        attrs["gen_ai.evaluation.explanation"] = a["rationale"]
    error = a.get("error")
    if error is not None:
        text = str(error)
        match = _ERROR_REASON.match(text)
        attrs["error.type"] = match.group(1) if match else "_OTHER"
        attrs["error.message"] = text
    value = _attribute_value(a.get("value"))
    if value is not None:
        attrs["tracejudge.evaluation.value"] = value
    attrs["tracejudge.evaluation.target"] = target
    attrs["tracejudge.evaluation.id"] = evaluation_id
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    _put_str(attrs, "tracejudge.judge.source", a.get("source"))
    for name in ("endpoint", "model", "version"):
        _put_str(attrs, f"tracejudge.judge.{name}", judge.get(name))
    for name in ("input_tokens", "output_tokens"):
        if type(a.get(name)) is int:
            attrs[f"tracejudge.judge.{name}"] = a[name]
    if _number(a.get("duration_seconds")):
        attrs["tracejudge.judge.duration_seconds"] = float(a["duration_seconds"])
    if _number(a.get("sample_rate")):
        attrs["tracejudge.judge.sample_rate"] = float(a["sample_rate"])
    _put_str(attrs, "tracejudge.app", result.get("app"))
    _put_str(attrs, "tracejudge.request_id", result.get("request_id"))
    version = result.get("schema_version", 1)
    attrs["tracejudge.schema_version"] = version if type(version) is int else 1
    source = result.get("source") if isinstance(result.get("source"), Mapping) else {}
    for name in ("format", "topic"):
        _put_str(attrs, f"tracejudge.source.{name}", source.get(name))
    for name in ("partition", "offset"):
        if type(source.get(name)) is int:
            attrs[f"tracejudge.source.{name}"] = source[name]
    attrs["tracejudge.result.topic"] = record.topic
    attrs["tracejudge.result.partition"] = record.partition
    attrs["tracejudge.result.offset"] = record.offset
    return attrs


def evaluator_attributes(a: Mapping[str, Any]) -> dict[str, Any]:
    """The proposed provenance attributes of one verdict: the judge's name as the evaluator's id, its
    version (`judge.version`, the fingerprint of its configuration) and its type, the kind of the
    assessment's `source` (`llm`, `heuristic`, `embedding`, `human`, …: what precedes a `:`)."""
    attrs: dict[str, Any] = {"gen_ai.evaluation.evaluator.id": a["name"]}
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    _put_str(attrs, "gen_ai.evaluation.evaluator.version", judge.get("version"))
    source = a.get("source")
    if isinstance(source, str) and source:
        _put_str(attrs, "gen_ai.evaluation.evaluator.type", source.partition(":")[0])
    return attrs


def _session_attributes(session: SessionResult) -> dict[str, Any]:
    """What a session verdict says about its session (the result's own `source` names the turns' topic;
    `_attributes` read the trace-result keys, absent here)."""
    attrs: dict[str, Any] = {"session.id": session.session_id, "gen_ai.conversation.id": session.session_id,
                             "tracejudge.session.evaluation": session.evaluation,
                             "tracejudge.session.status": session.status,
                             "tracejudge.session.close_reason": session.close_reason,
                             "tracejudge.session.turns": len(session.turns)}
    _put_str(attrs, "tracejudge.app", session.app)
    src = session.source
    _put_str(attrs, "tracejudge.source.format", src.format)
    _put_str(attrs, "tracejudge.source.topic", src.topic)
    for name, value in (("partition", src.partition), ("first_offset", src.first_offset),
                        ("last_offset", src.last_offset)):
        if type(value) is int:
            attrs[f"tracejudge.source.{name}"] = value
    return attrs


def _session_evaluation_id(session: SessionResult, a: Mapping[str, Any], trace_hex: str) -> str:
    """Names one session verdict: the session, its evaluation number, the judge's name and version, and
    the trace it hangs on (a redelivered session result repeats it; a re-evaluation is a new one)."""
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    parts = ["session", trace_hex, session.session_id, str(session.evaluation), str(a["name"]),
             str(judge.get("version") or a.get("source") or "")]
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _strip_tr(value: str | None) -> str | None:
    return value[3:] if isinstance(value, str) and value.startswith("tr-") else None


def _evaluation_id(record: SinkRecord, index: int, a: Mapping[str, Any], trace_hex: str,
                   span_hex: str | None) -> str:
    """Names one verdict: trace, evaluated span, judge name and judge version (a replayed trace judged
    by the same judge version is the same verdict, as the MLflow sink sees it); without a judge
    version, the result's place on the results topic."""
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    version = judge.get("version")
    parts = [trace_hex, span_hex or "", str(a["name"])]
    if version:
        parts.append(str(version))
    else:
        parts += [record.topic, str(record.partition), str(record.offset), str(index)]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def _hex_id(value: Any, pattern: re.Pattern[str]) -> str | None:
    if not isinstance(value, str):
        return None
    text = value.lower()
    return text if pattern.match(text) and text.strip("0") else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _attribute_value(value: Any) -> str | bool | int | float | None:
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return orjson.dumps(value, default=str).decode()


def _put_str(attrs: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, str) and value:
        attrs[key] = value


def _chunks(items: Sequence[_Verdict]) -> Iterator[Sequence[_Verdict]]:
    for i in range(0, len(items), MAX_EXPORT_BATCH):
        yield items[i:i + MAX_EXPORT_BATCH]
