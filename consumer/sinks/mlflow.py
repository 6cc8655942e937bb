"""The MLflow sink: every judge verdict of a result becomes an MLflow `Feedback` on its trace.

`tracejudge sink mlflow` reads the results topic and, for each result, writes its judge assessments
to the user's MLflow tracking server through the REST API (`POST /api/3.0/mlflow/traces/{trace_id}/
assessments`, the call `mlflow.log_feedback` makes), with httpx: one pooled client, at most
`max_concurrency` requests in flight. MLflow's Python client is not needed at run time.

What one assessment becomes:

| tracejudge assessment | MLflow feedback |
|---|---|
| `name` | `assessment_name`, and metadata `mlflow.assessment.scorerName` |
| `value` "yes"/"no" (or a bool) | `feedback.value` "yes"/"no": the MLflow UI renders Pass/Fail |
| `value` a number (precision, 1–5 scale, heuristic share) | `feedback.value` that number |
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
adds a new feedback beside the old one; other assessments (a human's) are never touched.

**Session results** (`"kind": "session"`, from the session results topic): each session judge's
assessment becomes a feedback on the session's first trace, the chronologically first turn with an
MLflow trace id, where MLflow's own session scoring logs it (`session_processor.py` ->
`get_first_trace_in_session`), with `span_id` = that turn's root span when known, as MLflow does. The
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
  batch is retried (`RetryLater`, reason `unknown_trace`) every `unknown_trace_retry_s /
  (unknown_trace_attempts - 1)` seconds; once a trace has been looked for `unknown_trace_attempts`
  times and `unknown_trace_retry_s` have passed since the first time, its feedback is skipped. The
  table of traces being waited for is bounded (oldest forgotten first).
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
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import orjson
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from tracejudge.consumer.config import ConfigError
from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, WriteReport
from tracejudge.metrics.judges.secrets import redact_url, url_problem
from tracejudge.schemas.session import SessionResult, TurnRef

__all__ = ["SESSION_ID_KEY", "MlflowSink", "MlflowSinkSettings", "feedback_key", "mlflow_trace_id",
           "session_feedback_key", "session_trace"]

log = logging.getLogger(__name__)

KIND = "mlflow"
TRACES_PATH = "/api/3.0/mlflow/traces"
# Trace ids per batchGetInfos request (the server itself queries SQLite in chunks of this order).
INFO_CHUNK = 100
# Traces waited for at once (about 150 bytes each); the oldest is forgotten beyond it.
MAX_TRACKED_TRACES = 100_000
# The first wait after a network error or a 5xx; the sink runtime doubles it per failed offer of a
# partition's batch (up to `sink.max_retry_backoff_s`), so the sink does not grow it a second time.
BACKOFF_BASE_S = 0.5
RETRY_AFTER_MAX_S = 300.0
HEURISTIC_SOURCE_ID = "tracejudge.heuristic"
METRICS_SOURCE_ID = "tracejudge.metrics"
# What MLflow's own session scoring marks a session's feedback with (`AssessmentMetadataKey.
# ONLINE_SCORING_SESSION_ID`; it deletes the earlier ones by it), and the trace metadata key of a session.
SESSION_ID_KEY = "mlflow.assessment.onlineScoringSessionId"
TRACE_SESSION_KEY = "mlflow.trace.session"
EVALUATION_KEY = "tracejudge.evaluation"
_HEX16 = frozenset("0123456789abcdef")
# Keys whose stated null means "none" rather than "the default".
_OPTIONAL_NAMES = ("experiment_id", "token_env", "token_file", "username_env", "password_env")


def _package_version() -> str:
    try:
        from tracejudge import __version__
    except ImportError:  # pragma: no cover - the package is always importable where this runs
        return "unknown"
    return __version__


# --- settings --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MlflowSinkSettings:
    """The `sink.mlflow` section. Holds the names of the secrets' variables and file, never their values."""

    tracking_uri: str
    experiment_id: str | None = None
    token_env: str | None = "MLFLOW_TRACKING_TOKEN"
    token_file: str | None = None
    username_env: str | None = "MLFLOW_TRACKING_USERNAME"
    password_env: str | None = "MLFLOW_TRACKING_PASSWORD"
    max_concurrency: int = 16
    unknown_trace_retry_s: float = 300.0
    unknown_trace_attempts: int = 5
    write_metrics: bool = False
    timeout_s: float = 10.0

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None, where: str = "sink.mlflow", *,
                     env: Mapping[str, str] | None = None) -> MlflowSinkSettings:
        """Validate the section; `ConfigError` names every bad key (`sink.mlflow.max_concurrency: …`).
        `tracking_uri` defaults to `MLFLOW_TRACKING_URI`. The credentials are read once here too, so an
        unreadable `token_file` is reported before anything runs."""
        env = os.environ if env is None else env
        d = dict(d or {})
        problems: list[tuple[str, str]] = []
        known = {f.name for f in fields(cls)}
        for key in sorted(set(d) - known):
            problems.append((f"{where}.{key}", f"unknown key (known: {', '.join(sorted(known))})"))

        def get(key: str, kind: type, check: Callable[[Any], str | None] | None = None) -> Any:
            if d.get(key) is None:
                return None
            try:
                value = _coerce(d[key], kind)
            except ValueError:
                problems.append((f"{where}.{key}", f"expected {_kind_name(kind)}, got {d[key]!r}"))
                return None
            if check is not None and (msg := check(value)):
                problems.append((f"{where}.{key}", msg))
                return None
            return value

        def positive(v: float) -> str | None:
            return None if v > 0 and math.isfinite(v) else f"must be > 0, got {v!r}"

        def non_negative(v: float) -> str | None:
            return None if v >= 0 and math.isfinite(v) else f"must be >= 0, got {v!r}"

        def at_least_one(v: int) -> str | None:
            return None if v >= 1 else f"must be >= 1, got {v!r}"

        def name(v: str) -> str | None:
            return None if v.strip() else "must not be empty"

        values: dict[str, Any] = {}
        if d.get("tracking_uri") is None:
            uri = env.get("MLFLOW_TRACKING_URI") or None
            if uri is None:
                problems.append((f"{where}.tracking_uri", "required (or set MLFLOW_TRACKING_URI)"))
        else:
            uri = get("tracking_uri", str)
        if uri is not None:
            if msg := _check_uri(uri):
                problems.append((f"{where}.tracking_uri", msg))
            else:
                values["tracking_uri"] = uri.rstrip("/")
        for key, kind, check in (
            ("experiment_id", str, name),
            ("token_env", str, name),
            ("token_file", str, name),
            ("username_env", str, name),
            ("password_env", str, name),
            ("max_concurrency", int, at_least_one),
            ("unknown_trace_retry_s", float, non_negative),
            ("unknown_trace_attempts", int, at_least_one),
            ("write_metrics", bool, None),
            ("timeout_s", float, positive),
        ):
            if key in _OPTIONAL_NAMES and key in d and (d[key] is None or d[key] == ""):
                values[key] = None  # stated null (or empty from the environment): off
                continue
            v = get(key, kind, check)
            if v is not None:
                values[key] = v
        settings = cls(**{"tracking_uri": "http://unset", **values})
        try:  # an unreadable token file or half a basic-auth pair, reported now with the rest
            settings.auth(env, where)
        except ConfigError as exc:
            problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems)
        return settings

    def auth(self, env: Mapping[str, str] | None = None, where: str = "sink.mlflow") -> httpx.Auth | None:
        """The credentials: `token_file`, else basic auth when both of its variables are set, else
        the token variable, else none (MLflow's order, with an explicit file first)."""
        env = os.environ if env is None else env
        if self.token_file:
            path = Path(self.token_file).expanduser()
            try:
                token = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError([(f"{where}.token_file", f"cannot read {path}: {exc.strerror}")]) from None
            if not token:
                raise ConfigError([(f"{where}.token_file", f"{path} is empty")])
            return _Bearer(token)
        user = env.get(self.username_env) if self.username_env else None
        password = env.get(self.password_env) if self.password_env else None
        if user and password:
            return httpx.BasicAuth(user, password)
        if user or password:
            missing = self.password_env if user else self.username_env
            key = "password_env" if user else "username_env"
            raise ConfigError([(f"{where}.{key}", f"basic auth needs {missing} set too")])
        token = env.get(self.token_env) if self.token_env else None
        if token and token.strip():
            return _Bearer(token.strip())
        return None

    def redacted(self) -> dict[str, Any]:
        """The settings as `--check-config` prints them. Nothing here is a secret (the credentials'
        variable and file names, never their values); the URI is shown through `redact_url`."""
        return {"tracking_uri": redact_url(self.tracking_uri),
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "tracking_uri"}}

    def auth_key(self, env: Mapping[str, str] | None = None) -> str:
        """The key to blame when the server refuses the credentials."""
        env = os.environ if env is None else env
        if self.token_file:
            return "token_file"
        if self.username_env and env.get(self.username_env):
            return "username_env"
        return "token_env"


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(kind, "a value")


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _coerce(value: Any, kind: type) -> Any:
    """A YAML value, or the string an environment override gives, as `kind`; ValueError if it is not one."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(value)
    if isinstance(value, bool):
        raise ValueError(value)
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int):  # an experiment id written as a number
            return str(value)
        raise ValueError(value)
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value.strip())
        raise ValueError(value)
    if kind is float:
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())  # ValueError when it is not a number
        raise ValueError(value)
    raise ValueError(value)


def _check_uri(uri: str) -> str | None:
    """Why `uri` cannot be the tracking URI; the URI is quoted only through `redact_url`."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return f"expected an http(s):// URL of an MLflow tracking server, got {redact_url(uri)!r}"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = " (a Databricks workspace is not supported)" if uri.startswith("databricks") else ""
        return f"expected an http(s):// URL of an MLflow tracking server, got {redact_url(uri)!r}{hint}"
    return url_problem(uri, query=False,
                       credentials_go_in="token_env / token_file, or username_env and password_env")


class _Bearer(httpx.Auth):
    """`Authorization: Bearer …`, with a repr that does not show the token."""

    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        request.headers["Authorization"] = self._header
        yield request

    def __repr__(self) -> str:
        return "_Bearer(<redacted>)"


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
class _Feedback:
    trace_id: str
    key: str
    name: str
    body: bytes
    # Session feedback: the session and its evaluation number (None / 0 for a trace verdict).
    session_id: str | None = None
    evaluation: int = 0


@dataclass(slots=True)
class _Plan:
    by_trace: dict[str, list[_Feedback]] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    # (trace, session, name) -> the newest evaluation's feedback in this batch.
    sessions: dict[tuple[str, str, str], _Feedback] = field(default_factory=dict)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else repr(value)
    return str(value)


def _feedback_value(a: Mapping[str, Any]) -> tuple[bool, Any]:
    """(has a value, the value MLflow gets)."""
    value, passed, score = a.get("value"), a.get("passed"), a.get("score")
    if isinstance(value, bool):
        return True, "yes" if value else "no"
    if isinstance(value, str) and value.strip().lower() in ("yes", "no"):
        return True, value.strip().lower()
    if isinstance(value, int | float):
        return True, value if math.isfinite(value) else str(value)
    if value is not None:
        return True, value  # text or a structure from a custom judge: as it is
    if isinstance(passed, bool):
        return True, "yes" if passed else "no"
    if isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score):
        return True, score
    return False, None


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
        self.version = _package_version()

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

    def _feedback(self, result: Mapping[str, Any], trace_id: str, plan: _Plan) -> Iterable[_Feedback]:
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
                yield _Feedback(trace_id, key, str(name), payload)

    def _assessment(self, a: Mapping[str, Any], trace_id: str, common: dict[str, str], *,
                    session: SessionResult | None = None, span_id: str | None = None) -> _Feedback | None:
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
        metadata["tracejudge.key"] = key
        body["metadata"] = metadata
        try:
            payload = orjson.dumps({"assessment": body})
        except orjson.JSONEncodeError:  # e.g. a lone surrogate from a custom format handler's text
            return None
        if session is not None:
            return _Feedback(trace_id, key, name, payload, session.session_id, session.evaluation)
        return _Feedback(trace_id, key, name, payload)


# --- waiting for traces that are not there yet -----------------------------------------------------


class _UnknownTraces:
    """Per trace not (yet) on the server: when it was first looked for and how many times.

    `seen(trace)` records one more look and says whether to give up: after `attempts` looks, once
    `window_s` have passed since the first. An entry older than twice the window starts over (a
    trace met again long after, in a new result). Bounded: the least recently seen goes first."""

    def __init__(self, attempts: int, window_s: float, clock: Callable[[], float],
                 max_tracked: int = MAX_TRACKED_TRACES) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self._clock = clock
        self._max = max_tracked
        self._table: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    @property
    def retry_after_s(self) -> float:
        return self.window_s / max(self.attempts - 1, 1)

    def seen(self, trace_id: str) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._table.get(trace_id)
            # (Without a window, never: an entry would start over at every look and never give up.)
            stale = self.window_s > 0 and entry is not None \
                and now - entry[0] > 2 * self.window_s + self.retry_after_s
            if entry is None or stale:
                entry = [now, 0.0]
            entry[1] += 1
            self._table[trace_id] = entry
            self._table.move_to_end(trace_id)
            while len(self._table) > self._max:
                self._table.popitem(last=False)
            return entry[1] >= self.attempts and now - entry[0] >= self.window_s

    def found(self, trace_id: str) -> None:
        with self._lock:
            self._table.pop(trace_id, None)


# --- the sink ----------------------------------------------------------------------------------------


class _Transient(Exception):
    """A request that may succeed later (network, 429, 5xx, 401/403)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class _SessionFeedback:
    """A session feedback this sink wrote earlier, as the trace holds it."""

    assessment_id: str
    name: str
    session_id: str
    evaluation: int
    key: str


@dataclass(slots=True)
class _TraceInfo:
    keys: set[str]
    experiment_id: str | None
    sessions: list[_SessionFeedback] = field(default_factory=list)

    def newer(self, fb: _Feedback) -> bool:
        """True when the trace holds this session's feedback of the same name from a later evaluation."""
        return any(s.session_id == fb.session_id and s.name == fb.name and s.evaluation > fb.evaluation
                   for s in self.sessions)

    def replaced_by(self, fb: _Feedback) -> list[str]:
        """The ids of this session's feedback of the same name from earlier evaluations."""
        return [s.assessment_id for s in self.sessions
                if s.session_id == fb.session_id and s.name == fb.name and s.evaluation < fb.evaluation
                and s.key != fb.key]


class MlflowSink(Sink):
    """Writes judge verdicts as MLflow feedback. See the module docstring for the mapping and outcomes."""

    kind = KIND
    accepts_sessions = True

    def __init__(self, settings: MlflowSinkSettings, registry: CollectorRegistry | None = None, *,
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._env = os.environ if env is None else env
        auth = settings.auth(self._env)
        limits = httpx.Limits(max_connections=settings.max_concurrency,
                              max_keepalive_connections=settings.max_concurrency)
        self._http = httpx.Client(base_url=settings.tracking_uri, auth=auth, limits=limits,
                                  timeout=settings.timeout_s,
                                  headers={"content-type": "application/json",
                                           "user-agent": f"tracejudge/{_package_version()}"})
        self._pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="mlflow-sink")
        self._mapper = _Mapper(settings.write_metrics)
        self._unknown = _UnknownTraces(settings.unknown_trace_attempts, settings.unknown_trace_retry_s, clock)
        self._batch_infos = True  # the server has batchGetInfos (MLflow >= 3.x); else one GET per trace
        self._logged: set[tuple[Any, ...]] = set()
        self._log_lock = threading.Lock()
        registry = registry if registry is not None else CollectorRegistry()
        self._writes = PromCounter("tracejudge_sink_writes_total",
                                   "Feedback a sink wrote, or found already written.",
                                   ["sink", "outcome"], registry=registry)
        self._skipped = PromCounter("tracejudge_sink_skipped_total",
                                    "Feedback a sink will never write, by reason.",
                                    ["sink", "reason"], registry=registry)
        self._retries = PromCounter("tracejudge_sink_retries_total",
                                    "Batches a sink asked to have offered again, by reason.",
                                    ["sink", "reason"], registry=registry)
        self._deletes = PromCounter("tracejudge_sink_deletes_total",
                                    "Earlier session feedback a sink deleted because a later evaluation "
                                    "of the session replaced it (rejected: the server refused).",
                                    ["sink", "outcome"], registry=registry)
        for outcome in ("written", "already_written"):
            self._writes.labels(KIND, outcome)
        for outcome in ("deleted", "rejected"):
            self._deletes.labels(KIND, outcome)

    # -- lifecycle --------------------------------------------------------------------------------

    def setup(self) -> None:
        """Check the server before the first poll: credentials refused or the experiment unknown are
        configuration errors; a server that does not answer yet is only logged (writes wait for it)."""
        where = "sink.mlflow"
        try:
            if self.settings.experiment_id:
                r = self._http.get("/api/2.0/mlflow/experiments/get",
                                   params={"experiment_id": self.settings.experiment_id})
            else:
                r = self._http.post("/api/2.0/mlflow/experiments/search", content=b'{"max_results": 1}')
        except httpx.HTTPError as exc:
            log.warning("MLflow tracking server %s not reachable yet (%s); writes will wait for it",
                        self.settings.tracking_uri, type(exc).__name__)
            return
        if r.status_code in (401, 403):
            key = self.settings.auth_key(self._env)
            raise ConfigError([(f"{where}.{key}",
                                f"the MLflow server refused the credentials (HTTP {r.status_code})")])
        if self.settings.experiment_id and r.status_code in (400, 404) \
                and _error_code(r) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            problem = f"no experiment {self.settings.experiment_id!r} on {self.settings.tracking_uri}"
            raise ConfigError([(f"{where}.experiment_id", problem)])
        if r.status_code == 404:
            problem = f"{self.settings.tracking_uri} does not serve the MLflow REST API (HTTP 404)"
            raise ConfigError([(f"{where}.tracking_uri", problem)])
        if r.status_code >= 400:
            log.warning("MLflow tracking server %s answered HTTP %d to a start-up check; writes will retry",
                        self.settings.tracking_uri, r.status_code)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    # -- write --------------------------------------------------------------------------------------

    def write(self, batch: SinkBatch) -> WriteReport:
        report = WriteReport()
        plan = self._mapper.plan(batch.records)
        report.already_written += plan.duplicates
        infos = self._lookup(list(plan.by_trace))  # raises RetryLater when the server cannot answer
        waiting: list[str] = []
        todo: list[_Feedback] = []
        # Session feedback on its trace (written now or before), whose earlier evaluations go after.
        replacing: list[tuple[_Feedback, _TraceInfo]] = []
        for trace_id, items in plan.by_trace.items():
            info = infos.get(trace_id)
            if info is None:
                if self._unknown.seen(trace_id):
                    plan.skipped["unknown_trace"] += len(items)
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

        transient: list[_Transient] = []
        for fb, outcome in zip(todo, self._map(self._post, todo), strict=True):
            if isinstance(outcome, _Transient):
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
            self._retries.labels(KIND, "unknown_trace").inc()
            raise RetryLater("unknown_trace", after_s=self._unknown.retry_after_s)
        self._writes.labels(KIND, "already_written").inc(report.already_written)
        for reason, n in plan.skipped.items():
            report.skip(reason, n)
            self._skipped.labels(KIND, reason).inc(n)
        return report

    def _replace(self, replacing: list[tuple[_Feedback, _TraceInfo]]) -> None:
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
        outcomes = self._map(self._delete, targets)
        self._raise_first(outcomes)
        for outcome in outcomes:
            if outcome == "deleted":
                self._deletes.labels(KIND, "deleted").inc()
            elif outcome == "rejected":
                self._deletes.labels(KIND, "rejected").inc()
            # else "gone": deleted already (by an earlier offer of this batch)

    def _retry(self, failures: list[_Transient]) -> None:
        reason = Counter(f.reason for f in failures).most_common(1)[0][0]
        stated = [f.retry_after for f in failures if f.retry_after is not None]
        # Jittered, so partitions held by the same outage do not all retry in step.
        after = min(max(stated), RETRY_AFTER_MAX_S) if stated else BACKOFF_BASE_S * random.uniform(0.5, 1.0)
        self._retries.labels(KIND, reason).inc()
        if reason == "unauthorized":
            self._log_once(("unauthorized",), logging.ERROR,
                           "MLflow server refused the sink's credentials; retrying (check sink.mlflow.%s)",
                           self.settings.auth_key(self._env))
        raise RetryLater(reason, after_s=after)

    def _map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """`fn` over `items` on the pool; a `_Transient` raised by `fn` is returned in its place."""
        if not items:
            return []
        if len(items) == 1:
            return [_call(fn, items[0])]
        futures: list[Future[Any]] = [self._pool.submit(_call, fn, item) for item in items]
        return [f.result() for f in futures]

    # -- REST calls ---------------------------------------------------------------------------------

    def _lookup(self, trace_ids: list[str]) -> dict[str, _TraceInfo]:
        """Trace id -> its feedback keys and experiment, for the traces the server has; `RetryLater`
        when the server cannot answer now."""
        found: dict[str, _TraceInfo] = {}
        one_by_one = trace_ids
        if self._batch_infos and trace_ids:
            chunks = [trace_ids[i:i + INFO_CHUNK] for i in range(0, len(trace_ids), INFO_CHUNK)]
            outcomes = self._map(self._get_infos, chunks)
            self._raise_first(outcomes)
            one_by_one = []
            for chunk, infos in zip(chunks, outcomes, strict=True):
                if infos is None:  # this server cannot answer the batch: one GET per trace instead
                    one_by_one.extend(chunk)
                else:
                    found.update(infos)
        outcomes = self._map(self._get_info, one_by_one)
        self._raise_first(outcomes)
        for trace_id, info in zip(one_by_one, outcomes, strict=True):
            if info is not None:
                found[trace_id] = info
        return found

    def _raise_first(self, outcomes: list[Any]) -> None:
        transient = [o for o in outcomes if isinstance(o, _Transient)]
        if transient:
            self._retry(transient)

    def _get_infos(self, chunk: list[str]) -> dict[str, _TraceInfo] | None:
        """batchGetInfos for a chunk; None when it cannot be answered that way (then per trace)."""
        r = self._request("POST", f"{TRACES_PATH}/batchGetInfos", orjson.dumps({"trace_ids": chunk}))
        if r.status_code in (404, 405, 501) and _error_code(r) in (None, "ENDPOINT_NOT_FOUND"):
            if self._batch_infos:
                self._batch_infos = False  # an MLflow 3 server from before batchGetInfos
                log.info("MLflow server has no batchGetInfos (HTTP %d); reading traces one request each",
                         r.status_code)
            return None
        self._raise_transient(r)
        if r.status_code != 200:
            self._log_once(("lookup", r.status_code, _error_code(r)), logging.WARNING,
                           "MLflow batchGetInfos answered HTTP %d (%s); reading those traces one by one",
                           r.status_code, _error_code(r) or "no error code")
            return None
        out: dict[str, _TraceInfo] = {}
        for info in _json(r).get("trace_infos") or ():
            if isinstance(info, dict) and isinstance(info.get("trace_id"), str):
                out[info["trace_id"]] = _trace_info(info)
        return out

    def _get_info(self, trace_id: str) -> _TraceInfo | None:
        r = self._request("GET", f"{TRACES_PATH}/{quote(trace_id, safe='')}")
        if r.status_code == 404:
            return None
        self._raise_transient(r)
        if r.status_code != 200:
            self._log_once(("lookup", r.status_code, _error_code(r)), logging.WARNING,
                           "MLflow trace lookup answered HTTP %d (%s); the trace counts as unknown",
                           r.status_code, _error_code(r) or "no error code")
            return None
        info = (_json(r).get("trace") or {}).get("trace_info")
        return _trace_info(info) if isinstance(info, dict) else None

    def _post(self, fb: _Feedback) -> str:
        r = self._request("POST", f"{TRACES_PATH}/{quote(fb.trace_id, safe='')}/assessments", fb.body)
        if r.status_code == 200:
            return "written"
        if r.status_code == 404 and _error_code(r) in ("RESOURCE_DOES_NOT_EXIST", None):
            return "unknown"
        self._raise_transient(r)
        code = _error_code(r)
        self._log_once(("rejected", r.status_code, code), logging.WARNING,
                       "MLflow rejected feedback %r (HTTP %d, %s): %s; skipping such feedback",
                       fb.name, r.status_code, code or "no error code", _message(r))
        return "rejected"

    def _delete(self, target: tuple[str, str]) -> str:
        trace_id, assessment_id = target
        r = self._request("DELETE", f"{TRACES_PATH}/{quote(trace_id, safe='')}/assessments/"
                                    f"{quote(assessment_id, safe='')}")
        if r.status_code == 200:
            return "deleted"
        if r.status_code == 404:
            return "gone"
        self._raise_transient(r)
        code = _error_code(r)
        self._log_once(("delete", r.status_code, code), logging.WARNING,
                       "MLflow refused to delete an earlier session feedback (HTTP %d, %s): %s; it stays "
                       "beside the newer one", r.status_code, code or "no error code", _message(r))
        return "rejected"

    def _request(self, method: str, path: str, body: bytes | None = None) -> httpx.Response:
        try:
            return self._http.request(method, path, content=body)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout, protocol error
            raise _Transient("network") from exc

    @staticmethod
    def _raise_transient(r: httpx.Response) -> None:
        if r.status_code == 429:
            raise _Transient("rate_limited", _retry_after(r))
        if r.status_code >= 500:
            raise _Transient("server_error", _retry_after(r))
        if r.status_code in (401, 403):
            raise _Transient("unauthorized")

    def _log_once(self, key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        with self._log_lock:
            if key in self._logged or len(self._logged) > 1000:
                return
            self._logged.add(key)
        log.log(level, msg, *args)


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except _Transient as exc:
        return exc


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        value = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _error_code(r: httpx.Response) -> str | None:
    code = _json(r).get("error_code") if r.content[:1] == b"{" else None
    return code if isinstance(code, str) else None


def _message(r: httpx.Response) -> str:
    msg = _json(r).get("message") if r.content[:1] == b"{" else None
    return (msg if isinstance(msg, str) else "")[:300]


def _retry_after(r: httpx.Response) -> float | None:
    value = r.headers.get("retry-after")
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


def _trace_info(info: Mapping[str, Any]) -> _TraceInfo:
    keys: set[str] = set()
    sessions: list[_SessionFeedback] = []
    for a in info.get("assessments") or ():
        meta = a.get("metadata") if isinstance(a, Mapping) else None
        if isinstance(meta, Mapping) and isinstance(meta.get("tracejudge.key"), str):
            keys.add(meta["tracejudge.key"])
            # Ours, of a session: a later evaluation replaces it (others' assessments are never touched).
            session_id, assessment_id = meta.get(SESSION_ID_KEY), a.get("assessment_id")
            source = a.get("source") if isinstance(a.get("source"), Mapping) else {}
            if isinstance(session_id, str) and isinstance(assessment_id, str) \
                    and isinstance(a.get("assessment_name"), str) and source.get("source_type") != "HUMAN":
                evaluation = str(meta.get(EVALUATION_KEY) or "1")
                sessions.append(_SessionFeedback(assessment_id, a["assessment_name"], session_id,
                                                 int(evaluation) if evaluation.isdigit() else 1,
                                                 meta["tracejudge.key"]))
    location = info.get("trace_location")
    experiment = None
    if isinstance(location, Mapping) and isinstance(location.get("mlflow_experiment"), Mapping):
        experiment = location["mlflow_experiment"].get("experiment_id")
    return _TraceInfo(keys, str(experiment) if experiment is not None else None, sessions)
