"""The MLflow sink: every judge verdict of a result becomes an MLflow `Feedback` on its trace.

`tracejudge sink mlflow` reads the results topic and, for each result, writes its judge assessments
to the user's MLflow tracking server through the REST API (`POST /api/3.0/mlflow/traces/{trace_id}/
assessments`, the call `mlflow.log_feedback` makes), with httpx: one pooled client, at most
`max_concurrency` requests in flight. MLflow's Python client is not needed at run time.

What one assessment becomes:

| tracejudge assessment | MLflow feedback |
|---|---|
| `name` | `assessment_name`, and metadata `mlflow.assessment.scorerName` |
| `passed` true/false (LLM or heuristic; any `value` but a label) | `feedback.value` "yes"/"no": Pass/Fail |
| `value` "yes"/"no" (or a bool), no `passed` | `feedback.value` "yes"/"no" |
| `value` a number, no `passed` (a judge with no pass/fail) | `feedback.value` that number |
| `value` a label ("unresolved") or a structure | `feedback.value` as it is (as MLflow's own judge) |
| with `passed`: `score`, `threshold`, a `value` number | metadata `score`, `threshold`, `tracejudge.value` |
| `score`, `passed` | metadata `tracejudge.score`, `tracejudge.passed` |
| `error` "reason: detail" | `feedback.error` `{error_code: "REASON", error_message}`, no value |
| `skipped` set | nothing is written (not counted: the judge side counts its skips) |
| `rationale` | `rationale` |
| `span_id` (schema 2) | `span_id`: the feedback is on that span |
| `judge` {endpoint, model}, `source` "llm:<model>" | `LLM_JUDGE`, `source_id` `<endpoint>:/<model>` |
| `source` "heuristic" | `source` `CODE`, `source_id` `tracejudge.heuristic` |
| `input_tokens`, `output_tokens` | `mlflow.assessment.judgeInputTokens` / `judgeOutputTokens` |
| `cost_usd` (schema 4) | `mlflow.assessment.judgeCost` (USD, as MLflow's own judges write it) |
| `judge.version`, `sample_rate` | `tracejudge.judgeVersion`, `tracejudge.sampleRate` |
| the result's `source` | `tracejudge.source.topic` / `.partition` / `.offset` |

plus `tracejudge.version` (the package) and `tracejudge.key`, the idempotency key. With
`write_metrics: true` the result's computed metrics are written too, as `CODE` feedback from
`tracejudge.metrics` (a metric whose value is null is not written).

The trace: the result's `mlflow_trace_id` (schema 2; null there means the record had no trace MLflow
could know), else, for a schema-1 result, `tr-<trace_id>` (MLflow 3 and OTLP traces, and the traces
agent-eval and inference-log rows carry) or, for an MLflow 2 trace, its request id as it is.

**Idempotent.** `tracejudge.key` is a hash of the trace id, the judge's name, its version (its prompt
and model fingerprint; the assessment's `source` for a schema-1 result) and the evaluated span. Before
writing, the sink reads the batch's traces (`POST /api/3.0/mlflow/traces/batchGetInfos`, one request per
100 traces; `GET /api/3.0/mlflow/traces/{id}` on a server without it) and skips every feedback whose key
is already on its trace (`already_written`). A redelivered result adds nothing; a new judge version
adds a new feedback beside the old one; other assessments (a human's) are never touched. The key does
not depend on the value's form: a verdict written before pass/fail verdicts became "yes"/"no" (its
number as the value) is found by its key and left as it is, never written a second time.

**Session results** (`"kind": "session"`, from the session results topic): each session judge's
assessment becomes a feedback on the session's first trace, the chronologically first turn with an
MLflow trace id, where MLflow's own session scoring logs it (`session_processor.py` ->
`get_first_trace_in_session`; `mlflow.genai.evaluate` puts a session scorer's there too), with `span_id`
= that turn's root span when known, as MLflow does. Its `mlflow.trace.session` mark is what makes MLflow's
trace search scope the verdict to the whole session (a search on it lists every turn), as for MLflow's
own session scorers (`sqlalchemy_store._get_session_scoped_trace_ids`). The
mapping above applies, plus metadata `mlflow.assessment.onlineScoringSessionId` and
`mlflow.trace.session` = the session id (MLflow's marks), `tracejudge.evaluation` (the session's
evaluation number), `tracejudge.sessionStatus`, `tracejudge.closeReason`, `tracejudge.turns` and
`tracejudge.source.topic` / `.partition` / `.firstOffset` / `.lastOffset` (where its turns were read).
Its `tracejudge.key` hashes trace, session id, judge name, judge version and evaluation number, so a
redelivered session result adds nothing. A later evaluation (a turn arrived after the session closed)
is a new feedback; once it is on the trace, the sink deletes this session's feedback of the same name
from earlier evaluations (`DELETE .../assessments/{id}`, as MLflow's `_clean_up_old_assessments` does;
counted in `tracejudge_sink_deletes_total`). Only feedback this sink wrote (its `tracejudge.key` and
the session id in its metadata) is ever deleted: human assessments and MLflow's own scorers' are not
touched. An earlier evaluation offered after a later one is on the trace (a redelivery) is skipped
(`superseded`), as is an earlier evaluation of the same session in the same batch. Limit: when a late
turn is earlier than the session's first trace, the new evaluation goes on that earlier trace and the
former first trace keeps the earlier evaluation's feedback (MLflow behaves the same).

**Outcomes** (`tracejudge_sink_writes_total{sink="mlflow", outcome}`, `tracejudge_sink_skipped_total
{sink, reason}`, `tracejudge_sink_retries_total{sink, reason}`), counted per feedback:
- `written` / `already_written`.
- skipped `unknown_trace`: the trace is not on the server. It may get there after its result, so the
  sink writes the batch's other verdicts at once and *defers* the records of that trace
  (`WriteReport.defer`): the sink stage parks them, uncommitted, and offers them again after a growing
  back-off, `unknown_trace_backoff_s` doubling per look up to `unknown_trace_max_backoff_s` (0.5 s,
  1 s, 2 s, 4 s, 5 s, 5 s ... by default), while the partition's other verdicts go on being written
  (counted: `tracejudge_sink_retries_total{reason="unknown_trace"}` per write that deferred any).
  Once a trace has been looked for `unknown_trace_attempts` times and `unknown_trace_retry_s` have
  passed since the first time, its feedback is skipped and its records given up on
  (`WriteReport.give_up`): never retried for ever. The table of traces being waited for is bounded
  (oldest forgotten first).
- skipped `other_experiment`: `experiment_id` is set and the trace belongs to another experiment.
- skipped `no_trace_id`: the result names no trace (a session result: no turn names an MLflow trace).
- skipped `shadow`: a shadow (candidate) judge's assessment (`shadow_of` set;
tracejudge.metrics.judges.trust.shadows).
- skipped `superseded`: a session result's feedback when a later evaluation of the session replaces it.
- skipped `invalid_assessment`: an assessment that is not an object with a name, or with neither a
  value, a score, a verdict nor an error.
- skipped `rejected`: the server refused the feedback (a 4xx other than 401, 403, 404 and 429); logged
  once per status and error code.
- retried: connection errors and timeouts (`network`), 429 (`rate_limited`, after its `Retry-After`),
  5xx (`server_error`), 401/403 (`unauthorized`: credentials rotated under a running sink). The first
  wait is 0.25-0.5 s (or the stated `Retry-After`); the sink runtime backs off exponentially from it
  per partition. Feedback written before the failure stays written; the retry finds it by its key.

Auth: a bearer token from `token_file` or `token_env`, or basic auth from `username_env` /
`password_env` (MLflow's own variables by default). Neither is logged, put in a metric or in an error.

Neighbours: the `sink.mlflow` section is `mlflow_settings.MlflowSinkSettings`, the REST calls
`mlflow_client.MlflowClient`, the outcome series `tracejudge.metrics.telemetry.sinks.SinkWriteMetrics`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, WriteReport
from tracejudge.consumer.sinks.mlflow_client import (
    EVALUATION_KEY,
    SESSION_ID_KEY,
    Feedback,
    MlflowClient,
    TraceInfo,
    Transient,
    Unavailable,
    error_code,
    raise_unavailable,
)
from tracejudge.consumer.sinks.mlflow_findings import FindingWriter
from tracejudge.consumer.sinks.mlflow_settings import MlflowSinkSettings
from tracejudge.consumer.sinks.waiting import UnknownTargets
from tracejudge.metrics.telemetry.sinks import SinkWriteMetrics
from tracejudge.schemas.errors import ConfigError
from tracejudge.schemas.session import SessionResult, TurnRef
from tracejudge.schemas.version import __version__

__all__ = ["SESSION_ID_KEY", "MlflowSink", "MlflowSinkSettings", "feedback_key", "mlflow_trace_id",
           "session_feedback_key", "session_trace"]

log = logging.getLogger(__name__)

KIND = "mlflow"
# The first wait after a network error or a 5xx; the sink runtime doubles it per failed offer of a
# partition's batch (up to `sink.max_retry_backoff_s`), so the sink does not grow it a second time.
BACKOFF_BASE_S = 0.5
RETRY_AFTER_MAX_S = 300.0
HEURISTIC_SOURCE_ID = "tracejudge.heuristic"
METRICS_SOURCE_ID = "tracejudge.metrics"
# The trace metadata key of a session (its feedback's marks, SESSION_ID_KEY and EVALUATION_KEY, are
# the client's: tracejudge.consumer.sinks.mlflow_client).
TRACE_SESSION_KEY = "mlflow.trace.session"
_HEX16 = frozenset("0123456789abcdef")


# --- mapping results to feedback -------------------------------------------------------------------


def mlflow_trace_id(result: Mapping[str, Any]) -> str | None:
    """The id MLflow's server stores the result's trace under."""
    stated = result.get("mlflow_trace_id")
    if isinstance(stated, str) and stated:
        return stated
    if "mlflow_trace_id" in result and isinstance(result.get("schema_version"), int) \
            and result["schema_version"] >= 2:
        return None  # the evaluator said: no trace MLflow would know
    trace_id = result.get("trace_id")
    if not isinstance(trace_id, str) or not trace_id:
        return None
    if result.get("source_format") == "mlflow_v2":
        return trace_id  # an MLflow 2 request id is the id itself
    return trace_id if trace_id.startswith("tr-") else f"tr-{trace_id}"


def feedback_key(trace_id: str, name: str, version: str, span_id: str | None = None) -> str:
    """The idempotency key of one feedback: the same trace, judge, judge version and span -> the same key."""
    text = "\x1f".join((trace_id, name, version, span_id or ""))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def session_feedback_key(trace_id: str, session_id: str, name: str, version: str, evaluation: int) -> str:
    """The idempotency key of one session feedback: the trace it is on, the session, the judge, its
    version and the session's evaluation number (a re-evaluated session's feedback is a new one)."""
    text = "\x1f".join(("session", trace_id, session_id, name, version, str(evaluation)))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def session_trace(session: SessionResult) -> TurnRef | None:
    """The turn whose trace holds the session's feedback: the chronologically first turn with an MLflow
    trace id (turns are in timestamp order), as MLflow's session scoring logs on the session's first
    trace (`session_utils.get_first_trace_in_session`). None when no turn names an MLflow trace."""
    return next((t for t in session.turns if t.mlflow_trace_id), None)


@dataclass(slots=True)
class _Plan:
    by_trace: dict[str, list[Feedback]] = field(default_factory=dict)
    # A feedback's key -> the record it came from (the record to defer when its trace is not there yet).
    origin: dict[str, SinkRecord] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    # (trace, session, name) -> the newest evaluation's feedback in this batch.
    sessions: dict[tuple[str, str, str], Feedback] = field(default_factory=dict)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else repr(value)
    return str(value)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_label(value: Any) -> bool:
    """A judge's own category (user_frustration's "none"/"resolved"/"unresolved", as MLflow's own
    judge writes it) or a custom judge's structure: shown as it is, never turned into yes/no."""
    if isinstance(value, str):
        return value.strip().lower() not in ("yes", "no")
    return value is not None and not isinstance(value, bool | int | float)


def _feedback_value(a: Mapping[str, Any]) -> tuple[bool, Any]:
    """(has a value, the value MLflow gets). A verdict with a pass/fail decision (`passed` set) is
    "yes"/"no", as MLflow's judges write theirs (the UI shows Pass/Fail and `feedback.<name> = 'no'`
    finds the failures), whatever its number: a heuristic's 0.33 that fails and a 0.5 that passes must
    not look alike. Its number goes in metadata (`_verdict_metadata`). Only a judge without a pass/fail
    decision (and a metric) keeps a number; a label or structure is shown as it is."""
    value, passed, score = a.get("value"), a.get("passed"), a.get("score")
    if isinstance(passed, bool) and not _is_label(value):
        return True, "yes" if passed else "no"
    if isinstance(value, bool):
        return True, "yes" if value else "no"
    if isinstance(value, str) and value.strip().lower() in ("yes", "no"):
        return True, value.strip().lower()
    if isinstance(value, int | float):
        return True, value if math.isfinite(value) else str(value)
    if value is not None:
        return True, value  # text or a structure from a custom judge: as it is
    if _number(score):
        return True, score
    return False, None


def _verdict_metadata(a: Mapping[str, Any]) -> dict[str, str]:
    """The numbers behind a pass/fail verdict, under the keys MLflow's own pass/fail scorers use
    (`score`, `threshold`: its deepeval, ragas and trulens scorers write value yes/no with these):
    `score` the judge's [0, 1] score, `threshold` the one the verdict applied when the result states
    it, and `tracejudge.value` the judge's own number when it is on another scale (4 on a 1-5 scale)."""
    if not isinstance(a.get("passed"), bool):
        return {}
    out: dict[str, str] = {}
    value, score = a.get("value"), a.get("score")
    if _number(score):
        out["score"] = _text(score)
    if _number(a.get("threshold")):
        out["threshold"] = _text(a["threshold"])
    if _number(value) and (not _number(score) or value != score):
        out["tracejudge.value"] = _text(value)
    return out


def _source(a: Mapping[str, Any]) -> dict[str, str]:
    """LLM_JUDGE `<endpoint>:/<model>` for a judge with a model, CODE for the heuristic and the rest."""
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    origin = a.get("source") if isinstance(a.get("source"), str) else ""
    kind, _, named_model = origin.partition(":")
    if kind == "heuristic":
        return {"source_type": "CODE", "source_id": HEURISTIC_SOURCE_ID}
    endpoint = judge.get("endpoint") if isinstance(judge.get("endpoint"), str) else None
    model = judge.get("model") if isinstance(judge.get("model"), str) else None
    model = model or named_model or None
    if model is None:
        return {"source_type": "CODE", "source_id": origin or "tracejudge"}
    return {"source_type": "LLM_JUDGE", "source_id": f"{endpoint or kind or 'llm'}:/{model}"}


def _error(text: str) -> dict[str, str]:
    reason, sep, _ = text.partition(":")
    code = reason.strip() if sep and reason.strip() and " " not in reason.strip() else "JUDGE_ERROR"
    return {"error_code": code.upper(), "error_message": text}


def _source_metadata(result: Mapping[str, Any]) -> dict[str, str]:
    src = result.get("source")
    out: dict[str, str] = {}
    if isinstance(src, Mapping):
        for key in ("topic", "partition", "offset"):
            if src.get(key) is not None:
                out[f"tracejudge.source.{key}"] = _text(src[key])
    return out


def _session_source(session: SessionResult) -> dict[str, str]:
    """Where the session's turns were read: the results topic, partition, first and last offsets."""
    src = session.source
    out: dict[str, str] = {}
    for key, value in (("topic", src.topic), ("partition", src.partition), ("firstOffset", src.first_offset),
                       ("lastOffset", src.last_offset), ("file", src.file)):
        if value is not None:
            out[f"tracejudge.source.{key}"] = _text(value)
    return out


class _Mapper:
    """Builds the request bodies of a record's feedback."""

    def __init__(self, write_metrics: bool) -> None:
        self.write_metrics = write_metrics
        self.version = __version__

    def plan(self, records: Iterable[SinkRecord]) -> _Plan:
        plan = _Plan()
        seen: set[str] = set()
        for record in records:
            if record.session is not None:
                self._plan_session(record, record.session, plan, seen)
                continue
            result = record.result
            trace_id = mlflow_trace_id(result)
            items = list(self._feedback(result, trace_id or "", plan))
            if not items:
                continue
            if trace_id is None:
                plan.skipped["no_trace_id"] += len(items)
                continue
            for fb in items:
                if fb.key in seen:  # the same result twice in one batch: written once
                    plan.duplicates += 1
                    continue
                seen.add(fb.key)
                plan.origin[fb.key] = record
                plan.by_trace.setdefault(trace_id, []).append(fb)
        for fb in plan.sessions.values():
            plan.by_trace.setdefault(fb.trace_id, []).append(fb)
        return plan

    def _plan_session(self, record: SinkRecord, session: SessionResult, plan: _Plan, seen: set[str]) -> None:
        """A session result's feedback, on its first MLflow trace. Of several evaluations of one session
        in the batch (records in offset order), only the newest is written (`superseded`)."""
        turn = session_trace(session)
        trace_id = turn.mlflow_trace_id if turn is not None else None
        span_id = turn.root_span_id if turn is not None else None
        if span_id is not None and not (len(span_id) == 16 and set(span_id) <= _HEX16):
            span_id = None  # MLflow span ids are 16 hex digits; the feedback goes on the trace
        common = {"tracejudge.version": self.version, SESSION_ID_KEY: session.session_id,
                  TRACE_SESSION_KEY: session.session_id, EVALUATION_KEY: str(session.evaluation),
                  "tracejudge.sessionStatus": session.status, "tracejudge.closeReason": session.close_reason,
                  "tracejudge.turns": str(len(session.turns)), **_session_source(session)}
        for a in record.assessments():
            if not isinstance(a, Mapping) or not isinstance(a.get("name"), str) or not a["name"]:
                plan.skipped["invalid_assessment"] += 1
                continue
            if a.get("skipped"):
                continue
            if trace_id is None:
                plan.skipped["no_trace_id"] += 1
                continue
            fb = self._assessment(a, trace_id, common, session=session, span_id=span_id)
            if fb is None:
                plan.skipped["invalid_assessment"] += 1
                continue
            if fb.key in seen:
                plan.duplicates += 1
                continue
            seen.add(fb.key)
            slot = (trace_id, session.session_id, fb.name)
            earlier = plan.sessions.get(slot)
            if earlier is not None and earlier.evaluation > fb.evaluation:
                plan.skipped["superseded"] += 1
                continue
            if earlier is not None:
                plan.skipped["superseded"] += 1
            plan.sessions[slot] = fb
            plan.origin[fb.key] = record

    def _feedback(self, result: Mapping[str, Any], trace_id: str, plan: _Plan) -> Iterable[Feedback]:
        common = {"tracejudge.version": self.version, **_source_metadata(result)}
        for a in result.get("assessments") or ():
            if not isinstance(a, Mapping) or not isinstance(a.get("name"), str) or not a["name"]:
                plan.skipped["invalid_assessment"] += 1
                continue
            if a.get("skipped"):
                continue  # the judge did not judge: nothing to show
            if a.get("shadow_of") is not None:
                plan.skipped["shadow"] += 1  # a candidate judge's verdict is not the app's quality
                continue
            fb = self._assessment(a, trace_id, common)
            if fb is None:
                plan.skipped["invalid_assessment"] += 1
            else:
                yield fb
        if self.write_metrics and isinstance(result.get("metrics"), Mapping):
            for name, value in result["metrics"].items():
                if isinstance(value, bool):
                    value = int(value)
                if not isinstance(value, int | float) or not math.isfinite(value):
                    continue
                key = feedback_key(trace_id, f"metric:{name}", "")
                body = {"assessment_name": str(name), "trace_id": trace_id,
                        "source": {"source_type": "CODE", "source_id": METRICS_SOURCE_ID},
                        "feedback": {"value": value},
                        "metadata": {**common, "tracejudge.key": key}}
                try:
                    payload = orjson.dumps({"assessment": body})
                except orjson.JSONEncodeError:  # a metric name that is not valid UTF-8
                    continue
                yield Feedback(trace_id, key, str(name), payload)

    def _assessment(self, a: Mapping[str, Any], trace_id: str, common: dict[str, str], *,
                    session: SessionResult | None = None, span_id: str | None = None) -> Feedback | None:
        name: str = a["name"]
        judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
        judge_version = judge.get("version") if isinstance(judge.get("version"), str) else None
        version = judge_version or f"v1:{a.get('source') or ''}"
        if session is not None:
            key = session_feedback_key(trace_id, session.session_id, name, version, session.evaluation)
        else:
            span_id = a.get("span_id") if isinstance(a.get("span_id"), str) and a.get("span_id") else None
            key = feedback_key(trace_id, name, version, span_id)
        body: dict[str, Any] = {"assessment_name": name, "trace_id": trace_id, "source": _source(a)}
        error = a.get("error")
        if error:
            body["feedback"] = {"error": _error(str(error))}
        else:
            has_value, value = _feedback_value(a)
            if not has_value:
                return None
            body["feedback"] = {"value": value}
        if isinstance(a.get("rationale"), str) and a["rationale"]:
            body["rationale"] = a["rationale"]
        if span_id:
            body["span_id"] = span_id
        metadata = {"mlflow.assessment.scorerName": name, **common}
        for field_name, meta in (("input_tokens", "mlflow.assessment.judgeInputTokens"),
                                 ("output_tokens", "mlflow.assessment.judgeOutputTokens"),
                                 ("cost_usd", "mlflow.assessment.judgeCost"),
                                 ("score", "tracejudge.score"), ("passed", "tracejudge.passed"),
                                 ("sample_rate", "tracejudge.sampleRate")):
            v = a.get(field_name)
            if v is not None and not (isinstance(v, float) and not math.isfinite(v)):
                metadata[meta] = _text(v)
        if judge_version:
            metadata["tracejudge.judgeVersion"] = judge_version
        if not error:
            metadata.update(_verdict_metadata(a))
        metadata["tracejudge.key"] = key
        body["metadata"] = metadata
        try:
            payload = orjson.dumps({"assessment": body})
        except orjson.JSONEncodeError:  # e.g. a lone surrogate from a custom format handler's text
            return None
        if session is not None:
            return Feedback(trace_id, key, name, payload, session.session_id, session.evaluation)
        return Feedback(trace_id, key, name, payload)


# --- waiting for traces that are not there yet -----------------------------------------------------


_UnknownTraces = UnknownTargets  # the shared table (tracejudge.consumer.sinks.waiting)


def _records_of(items: list[Feedback], plan: _Plan) -> list[SinkRecord]:
    """The records the feedback came from, each once, in offset order."""
    records = {id(r): r for r in (plan.origin[fb.key] for fb in items if fb.key in plan.origin)}
    return sorted(records.values(), key=lambda r: r.offset)


# --- the sink ----------------------------------------------------------------------------------------


class MlflowSink(Sink):
    """Writes judge verdicts as MLflow feedback. See the module docstring for the mapping and outcomes."""

    kind = KIND
    accepts_sessions = True
    accepts_findings = True

    def __init__(self, settings: MlflowSinkSettings, registry: CollectorRegistry | None = None, *,
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._env = os.environ if env is None else env
        self._client = MlflowClient(settings, self._env)
        self._mapper = _Mapper(settings.write_metrics)
        self._unknown = _UnknownTraces(settings.unknown_trace_attempts, settings.unknown_trace_retry_s, clock,
                                       backoff_s=settings.unknown_trace_backoff_s,
                                       max_backoff_s=settings.unknown_trace_max_backoff_s)
        metrics = SinkWriteMetrics(KIND, registry if registry is not None else CollectorRegistry(),
                                   deletes=True)
        self._writes, self._skipped, self._retries = metrics.writes, metrics.skipped, metrics.retries
        self._deletes = metrics.deletes
        # Findings become trace tags on their example traces (`mlflow_findings`), waited for the same way.
        self._findings = FindingWriter(self._client, _UnknownTraces(
            settings.unknown_trace_attempts, settings.unknown_trace_retry_s, clock,
            backoff_s=settings.unknown_trace_backoff_s, max_backoff_s=settings.unknown_trace_max_backoff_s),
            settings.experiment_id)

    # -- lifecycle --------------------------------------------------------------------------------

    def setup(self) -> None:
        """Check the server before the first poll: credentials refused or the experiment unknown are
        configuration errors; a server that does not answer yet is only logged (writes wait for it)."""
        where = "sink.mlflow"
        r = self._client.check(self.settings.experiment_id)
        if r is None:
            return
        if r.status_code in (401, 403):
            key = self.settings.auth_key(self._env)
            raise ConfigError(f"{where}.{key}",
                              f"the MLflow server refused the credentials (HTTP {r.status_code})")
        if self.settings.experiment_id and r.status_code in (400, 404) \
                and error_code(r) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            problem = f"no experiment {self.settings.experiment_id!r} on {self.settings.tracking_uri}"
            raise ConfigError(f"{where}.experiment_id", problem)
        if r.status_code == 404:
            problem = f"{self.settings.tracking_uri} does not serve the MLflow REST API (HTTP 404)"
            raise ConfigError(f"{where}.tracking_uri", problem)
        if r.status_code >= 400:
            log.warning("MLflow tracking server %s answered HTTP %d to a start-up check; writes will retry",
                        self.settings.tracking_uri, r.status_code)

    def close(self) -> None:
        self._client.close()

    # -- write --------------------------------------------------------------------------------------

    def write(self, batch: SinkBatch) -> WriteReport:
        report = WriteReport()
        findings = [r for r in batch.records if r.kind == "finding"]
        plan = self._mapper.plan([r for r in batch.records if r.kind != "finding"] if findings
                                 else batch.records)
        report.already_written += plan.duplicates
        try:
            infos = self._client.lookup(list(plan.by_trace))
            # Finding tags set before the verdicts; a retried batch finds them by their values.
            if findings and (transient := self._findings.write(findings, report, plan.skipped)):
                self._retry(transient)
        except Unavailable as exc:  # the server cannot answer now
            self._retry(exc.failures)
        if report.written:  # finding tags set
            self._writes.labels(KIND, "written").inc(report.written)
        waiting: list[str] = []
        todo: list[Feedback] = []
        # Session feedback on its trace (written now or before), whose earlier evaluations go after.
        replacing: list[tuple[Feedback, TraceInfo]] = []
        for trace_id, items in plan.by_trace.items():
            info = infos.get(trace_id)
            if info is None:
                if self._unknown.seen(trace_id):
                    plan.skipped["unknown_trace"] += len(items)
                    report.give_up("unknown_trace", len(_records_of(items, plan)))
                else:
                    waiting.append(trace_id)
                continue
            self._unknown.found(trace_id)
            if self.settings.experiment_id and info.experiment_id not in (None, self.settings.experiment_id):
                plan.skipped["other_experiment"] += len(items)
                continue
            for fb in items:
                if fb.key in info.keys:
                    report.already_written += 1
                    if fb.session_id is not None:
                        replacing.append((fb, info))
                elif fb.session_id is not None and info.newer(fb):
                    plan.skipped["superseded"] += 1  # a redelivered earlier evaluation of the session
                else:
                    todo.append(fb)

        transient: list[Transient] = []
        for fb, outcome in zip(todo, self._client.map(self._client.post, todo), strict=True):
            if isinstance(outcome, Transient):
                transient.append(outcome)
            elif outcome == "written":
                report.written += 1
                self._writes.labels(KIND, "written").inc()
                if fb.session_id is not None:
                    replacing.append((fb, infos[fb.trace_id]))
            elif outcome == "unknown":  # the trace went away between the lookup and the write
                if fb.trace_id not in waiting:
                    waiting.append(fb.trace_id)
            else:
                plan.skipped[outcome] += 1
        if transient:
            self._retry(transient)
        self._replace(replacing)
        if waiting:
            # Written meanwhile: every other trace's verdicts. These records are offered again on their
            # own once their back-off has passed; the partition goes on (tracejudge.consumer.stages.sink).
            self._retries.labels(KIND, "unknown_trace").inc()
            for trace_id in waiting:
                wait = self._unknown.wait_s(trace_id)
                for record in _records_of(plan.by_trace[trace_id], plan):
                    report.defer(record, "unknown_trace", wait)
        self._writes.labels(KIND, "already_written").inc(report.already_written)
        for reason, n in plan.skipped.items():
            report.skip(reason, n)
            self._skipped.labels(KIND, reason).inc(n)
        return report

    def _replace(self, replacing: list[tuple[Feedback, TraceInfo]]) -> None:
        """Delete the session feedback of earlier evaluations that the batch's feedback replaces, after
        the new feedback is on the trace (as MLflow's session scoring does). Only this sink's own
        session feedback is deleted (`tracejudge.key` and the session id in its metadata), never
        anyone else's. A failed delete is retried with the batch: the new feedback is found by its key
        and the delete made again."""
        doomed: dict[tuple[str, str], None] = {}
        for fb, info in replacing:
            for assessment_id in info.replaced_by(fb):
                doomed[(fb.trace_id, assessment_id)] = None
        if not doomed:
            return
        targets = list(doomed)
        outcomes = self._client.map(self._client.delete, targets)
        try:
            raise_unavailable(outcomes)
        except Unavailable as exc:
            self._retry(exc.failures)
        for outcome in outcomes:
            if outcome == "deleted":
                self._deletes.labels(KIND, "deleted").inc()
            elif outcome == "rejected":
                self._deletes.labels(KIND, "rejected").inc()
            # else "gone": deleted already (by an earlier offer of this batch)

    def _retry(self, failures: list[Transient]) -> None:
        reason = Counter(f.reason for f in failures).most_common(1)[0][0]
        stated = [f.retry_after for f in failures if f.retry_after is not None]
        # Jittered, so partitions held by the same outage do not all retry in step.
        after = min(max(stated), RETRY_AFTER_MAX_S) if stated else BACKOFF_BASE_S * random.uniform(0.5, 1.0)
        self._retries.labels(KIND, reason).inc()
        if reason == "unauthorized":
            self._client.log_once(("unauthorized",), logging.ERROR, "MLflow server refused the sink's "
                                  "credentials; retrying (check sink.mlflow.%s)",
                                  self.settings.auth_key(self._env))
        raise RetryLater(reason, after_s=after) from None  # not the client's `Unavailable`
