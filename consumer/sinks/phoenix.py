"""The Phoenix sink: every judge verdict of a result becomes an Arize Phoenix span annotation.

`tracejudge sink phoenix` reads the results topic and writes each result's judge assessments to the
user's Phoenix server through its REST API (`POST /v1/span_annotations?sync=true`, the call Phoenix's
own client makes), with httpx; Phoenix's Python packages are not needed at run time. A verdict goes on
the span it judged: the assessment's `span_id` when set, else the result's `root_span_id` (a
trace-level verdict on the trace's root span, where Phoenix shows trace annotations). A session
result's verdicts become session annotations (`POST /v1/session_annotations?sync=true`) on the
session Phoenix groups by the spans' `session.id`.

What one assessment becomes:

| tracejudge assessment | Phoenix annotation |
|---|---|
| `name` | `name` |
| `source` "heuristic" / an LLM judge | `annotator_kind` `CODE` / `LLM` |
| `passed` true/false | `result.label` "pass"/"fail" |
| `value` a label ("yes", "unresolved"), no `passed` | `result.label` that label |
| `score` (else a number `value`) | `result.score` |
| `rationale` | `result.explanation` |
| `error` "reason: detail" | `result.label` "error", `result.explanation` the error |
| `skipped` set | nothing is written (not counted: the judge side counts its skips) |
| `judge.version`, `judge.model`, tokens, `cost_usd`, `threshold`, `sample_rate` | `metadata` `tracejudge.*` |
| the result's `trace_id` and `source` | `metadata` `tracejudge.traceId`, `tracejudge.source.*` |

**Idempotent.** The annotation's `identifier` is `tracejudge:` + the MLflow sink's key (a hash of the
trace id, the judge's name, its version and the evaluated span: `mlflow.feedback_key`). Phoenix upserts
on (name, span, identifier), so a redelivered verdict (a restart after a SIGKILL, a rebalance) lands
on the row it wrote before: nothing is doubled, and a new judge version is a new annotation beside the
old one. Other annotations (a human's, Phoenix's own evals) are never touched. A session annotation's
identifier hashes the session id, the judge's name and version: a later evaluation of the session (a
turn arrived after it closed) replaces the earlier one in place; results are read in topic order, so a
redelivery ends on the latest evaluation too (within a batch only the latest is sent).

**Outcomes** (`tracejudge_sink_writes_total{sink="phoenix", outcome="written"}` per annotation upserted,
`tracejudge_sink_skipped_total{sink, reason}`, `tracejudge_sink_retries_total{sink, reason}`):
- skipped `unknown_span` / `unknown_session`: Phoenix answered 404 for the span (session): not there
  yet. The sink writes the batch's other annotations at once and *defers* the records of that span
  (`WriteReport.defer`; the sink stage parks them, uncommitted, while the partition flows), looking
  again after a back-off doubling from `unknown_span_backoff_s` to `unknown_span_max_backoff_s`
  (the shared table `tracejudge.consumer.sinks.waiting.UnknownTargets`). After
  `unknown_span_attempts` looks, once `unknown_span_retry_s` have passed, the annotations are skipped
  and their records given up on (`tracejudge_sink_given_up_total`).
- skipped `no_span`: neither the assessment nor the result names a 16-hex-digit span id (a session
  result: no session id).
- skipped `shadow`: a shadow (candidate) judge's assessment (`shadow_of` set).
- skipped `invalid_assessment`: not an object with a name, or with no verdict, score, rationale or error.
- skipped `rejected`: Phoenix refused the annotation (a 4xx other than 401, 403, 404 and 429).
- retried: connection errors and timeouts (`network`), 429 (`rate_limited`, after its `Retry-After`),
  5xx (`server_error`), 401/403 (`unauthorized`). The sink runtime backs off exponentially per
  partition; annotations written before the failure are upserted again, in place, on the retry.

Auth: `Authorization: Bearer <key>` from `api_key_file` or the `api_key_env` variable (PHOENIX_API_KEY);
never logged, put in a metric or in an error. The `sink.phoenix` section is
`phoenix_settings.PhoenixSinkSettings`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, WriteReport
from tracejudge.consumer.sinks.mlflow import feedback_key
from tracejudge.consumer.sinks.phoenix_settings import PhoenixSinkSettings
from tracejudge.consumer.sinks.waiting import UnknownTargets
from tracejudge.metrics.telemetry.sinks import SinkWriteMetrics
from tracejudge.schemas.errors import ConfigError
from tracejudge.schemas.version import __version__

__all__ = ["PhoenixSink", "PhoenixSinkSettings", "annotation_identifier", "session_identifier"]

log = logging.getLogger(__name__)

KIND = "phoenix"
BACKOFF_BASE_S = 0.5
RETRY_AFTER_MAX_S = 300.0
SKIP_REASONS = ("unknown_span", "unknown_session", "no_span", "shadow", "invalid_assessment", "rejected")
RETRY_REASONS = ("network", "rate_limited", "server_error", "unauthorized", "unknown_span",
                 "unknown_session")
_SPAN_ID = re.compile(r"^[0-9a-f]{16}$")
# Phoenix's 404 in sync mode: "Spans with IDs a, b do not exist." / "Sessions with IDs ... do not exist."
_MISSING = re.compile(r"with IDs (.*) do not exist", re.S)
_PATHS = {"span": "/v1/span_annotations", "session": "/v1/session_annotations"}


def annotation_identifier(trace_id: str, name: str, version: str, span_id: str | None = None) -> str:
    """The `identifier` Phoenix upserts on: the MLflow sink's key of the same verdict."""
    return f"tracejudge:{feedback_key(trace_id, name, version, span_id)}"


def session_identifier(session_id: str, name: str, version: str) -> str:
    """A session annotation's `identifier`: the same session, judge and version -> the same row (a
    re-evaluated session's verdict replaces the earlier one)."""
    text = "\x1f".join(("session", session_id, name, version))
    return "tracejudge:" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(slots=True)
class Annotation:
    """One annotation to upsert: on a span (`scope` "span") or a session ("session")."""

    scope: str
    target: str
    body: dict[str, Any]
    record: SinkRecord


@dataclass(slots=True)
class _Plan:
    items: list[Annotation] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)


class Transient(Exception):
    """Phoenix cannot answer now; the batch is offered again."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


# --- mapping results to annotations ---------------------------------------------------------------


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _result(a: Mapping[str, Any]) -> dict[str, Any] | None:
    """Phoenix's `result` {label, score, explanation} of a verdict; None when there is nothing to show."""
    out: dict[str, Any] = {}
    value, passed, score, error = a.get("value"), a.get("passed"), a.get("score"), a.get("error")
    if error:
        out["label"] = "error"
        out["explanation"] = str(error)
        return out
    if isinstance(passed, bool):
        out["label"] = "pass" if passed else "fail"
    elif isinstance(value, bool):
        out["label"] = "yes" if value else "no"
    elif isinstance(value, str) and value:
        out["label"] = value
    if _number(score):
        out["score"] = float(score)
    elif _number(value):
        out["score"] = float(value)
    if isinstance(a.get("rationale"), str) and a["rationale"]:
        out["explanation"] = a["rationale"]
    return out or None


def _metadata(a: Mapping[str, Any], result: Mapping[str, Any], identifier: str) -> dict[str, Any]:
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    meta: dict[str, Any] = {"tracejudge.key": identifier, "tracejudge.version": __version__}
    for name, key in (("version", "tracejudge.judgeVersion"), ("model", "tracejudge.judgeModel")):
        if isinstance(judge.get(name), str):
            meta[key] = judge[name]
    for name in ("input_tokens", "output_tokens", "cost_usd", "threshold", "sample_rate", "source"):
        v = a.get(name)
        if v is not None and not (isinstance(v, float) and not math.isfinite(v)):
            meta[f"tracejudge.{name}"] = v
    if a.get("value") is not None and not isinstance(a.get("value"), str | bool):
        meta["tracejudge.value"] = a["value"]  # a number or a custom judge's structure
    if isinstance(result.get("trace_id"), str):
        meta["tracejudge.traceId"] = result["trace_id"]
    source = result.get("source")
    if isinstance(source, Mapping):
        for k in ("topic", "partition", "offset"):
            if source.get(k) is not None:
                meta[f"tracejudge.source.{k}"] = source[k]
    return meta


def _version(a: Mapping[str, Any]) -> str:
    judge = a.get("judge") if isinstance(a.get("judge"), Mapping) else {}
    return judge.get("version") if isinstance(judge.get("version"), str) else f"v1:{a.get('source') or ''}"


def _annotator(a: Mapping[str, Any]) -> str:
    source = str(a.get("source") or "")
    return "LLM" if a.get("judge") or source.startswith("llm") else "CODE"


def plan(records: Iterable[SinkRecord]) -> _Plan:
    """The annotations of a batch, each verdict once (the latest evaluation of a session)."""
    out = _Plan()
    latest: dict[tuple[str, str], tuple[int, Annotation]] = {}
    for record in records:
        session = record.session
        for a in record.assessments():
            if not isinstance(a, Mapping) or not isinstance(a.get("name"), str) or not a["name"]:
                out.skipped["invalid_assessment"] += 1
                continue
            if a.get("skipped"):
                continue
            if a.get("shadow_of"):
                out.skipped["shadow"] += 1
                continue
            ann = _annotation(record, a)
            if isinstance(ann, str):
                out.skipped[ann] += 1
            elif session is not None:
                seen = latest.get((ann.target, a["name"]))
                if seen is None or seen[0] <= session.evaluation:
                    latest[(ann.target, a["name"])] = (session.evaluation, ann)
            else:
                out.items.append(ann)
    out.items.extend(ann for _, ann in latest.values())
    return out


def _annotation(record: SinkRecord, a: Mapping[str, Any]) -> Annotation | str:
    """The annotation of one assessment, or why there is none."""
    name, result = a["name"], record.result
    shown = _result(a)
    if shown is None:
        return "invalid_assessment"
    session = record.session
    if session is not None:
        if not session.session_id:
            return "no_span"
        identifier = session_identifier(session.session_id, name, _version(a))
        body = {"session_id": session.session_id}
        meta = _metadata(a, result, identifier)
        meta["tracejudge.evaluation"] = session.evaluation
        meta["tracejudge.sessionStatus"] = session.status
    else:
        span_id = a.get("span_id") if isinstance(a.get("span_id"), str) and a.get("span_id") else None
        target = span_id or result.get("root_span_id")
        if not isinstance(target, str) or not _SPAN_ID.match(target.lower()):
            return "no_span"
        identifier = annotation_identifier(str(result.get("trace_id") or ""), name, _version(a), span_id)
        body = {"span_id": target.lower()}
        meta = _metadata(a, result, identifier)
    body.update({"name": name, "annotator_kind": _annotator(a), "result": shown, "metadata": meta,
                 "identifier": identifier})
    scope = "session" if session is not None else "span"
    return Annotation(scope, body["session_id" if session is not None else "span_id"], body, record)


# --- the REST calls ------------------------------------------------------------------------------


class PhoenixClient:
    """Phoenix's REST API with one pooled httpx client."""

    def __init__(self, settings: PhoenixSinkSettings, env: Mapping[str, str]) -> None:
        headers = {"content-type": "application/json"}
        key = settings.api_key(env)
        if key:
            headers["authorization"] = f"Bearer {key}"
        self._http = httpx.Client(base_url=settings.endpoint, headers=headers, timeout=settings.timeout_s)
        self._logged: set[Any] = set()

    def close(self) -> None:
        self._http.close()

    def check(self, project: str) -> httpx.Response | None:
        """The project, for the start-up check; None when the server does not answer."""
        try:
            return self._http.get(f"/v1/projects/{project}")
        except httpx.HTTPError:
            return None

    def annotate(self, scope: str, bodies: list[dict[str, Any]]) -> tuple[str, set[str]]:
        """Upsert the annotations: ("written", ∅), ("missing", the unknown targets) or ("rejected", ∅);
        raises `Transient` when Phoenix cannot answer now."""
        try:
            r = self._http.post(_PATHS[scope], params={"sync": "true"}, json={"data": bodies})
        except httpx.HTTPError as exc:
            raise Transient("network") from exc
        if r.status_code < 300:
            return "written", set()
        if r.status_code == 404:
            match = _MISSING.search(r.text)
            if match:
                return "missing", {s.strip() for s in match.group(1).split(",") if s.strip()}
            raise Transient("server_error")  # a 404 without the ids: not Phoenix's annotations API
        if r.status_code == 429:
            raise Transient("rate_limited", _retry_after(r))
        if r.status_code >= 500:
            raise Transient("server_error", _retry_after(r) if r.status_code == 503 else None)
        if r.status_code in (401, 403):
            raise Transient("unauthorized")
        self.log_once(("rejected", r.status_code), logging.WARNING,
                      "Phoenix refused an annotation (HTTP %d); skipped", r.status_code)
        return "rejected", set()

    def log_once(self, key: Any, level: int, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message, *args)


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return max(0.0, float(r.headers.get("retry-after", "")))
    except ValueError:
        return None


# --- the sink ----------------------------------------------------------------------------------------


class PhoenixSink(Sink):
    """Writes judge verdicts as Phoenix span (and session) annotations. See the module docstring."""

    kind = KIND
    accepts_sessions = True

    def __init__(self, settings: PhoenixSinkSettings, registry: CollectorRegistry | None = None, *,
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._env = os.environ if env is None else env
        self._client = PhoenixClient(settings, self._env)
        self._unknown = UnknownTargets(settings.unknown_span_attempts, settings.unknown_span_retry_s, clock,
                                       backoff_s=settings.unknown_span_backoff_s,
                                       max_backoff_s=settings.unknown_span_max_backoff_s)
        metrics = SinkWriteMetrics(KIND, registry if registry is not None else CollectorRegistry(),
                                   skip_reasons=SKIP_REASONS, retry_reasons=RETRY_REASONS)
        self._writes, self._skipped, self._retries = metrics.writes, metrics.skipped, metrics.retries

    def setup(self) -> None:
        """Check the server before the first poll: refused credentials are a configuration error; a
        server that does not answer yet, or a project without traces yet, is only logged."""
        r = self._client.check(self.settings.project_name)
        if r is None:
            log.warning("Phoenix at %s does not answer yet; writes will retry", self.settings.endpoint)
        elif r.status_code in (401, 403):
            raise ConfigError(f"sink.phoenix.{self.settings.auth_key()}",
                              f"Phoenix refused the credentials (HTTP {r.status_code})")
        elif r.status_code == 404 and "not found" in r.text.lower():
            log.warning("Phoenix has no project %r yet (it appears with its first trace)",
                        self.settings.project_name)
        elif r.status_code >= 400:
            log.warning("Phoenix at %s answered HTTP %d to a start-up check; writes will retry",
                        self.settings.endpoint, r.status_code)

    def close(self) -> None:
        self._client.close()

    def write(self, batch: SinkBatch) -> WriteReport:
        report = WriteReport()
        todo = plan(batch.records)
        skipped = todo.skipped
        missing: dict[tuple[str, str], list[Annotation]] = {}
        try:
            for scope in ("span", "session"):
                items = [a for a in todo.items if a.scope == scope]
                size = self.settings.max_batch_annotations
                for i in range(0, len(items), size):
                    self._post(scope, items[i:i + size], report, missing, skipped)
        except Transient as exc:
            self._retry(exc)
        waiting: set[str] = set()
        deferred: dict[int, tuple[float, str]] = {}
        given_up: dict[int, str] = {}
        for (scope, target), items in missing.items():
            reason = f"unknown_{scope}"
            key = f"{scope}:{target}"
            if self._unknown.seen(key):
                skipped[reason] += len(items)
                for a in items:
                    given_up[a.record.offset] = reason
                continue
            waiting.add(reason)
            wait = self._unknown.wait_s(key)
            for a in items:
                earlier = deferred.get(a.record.offset)
                if earlier is None or wait < earlier[0]:
                    deferred[a.record.offset] = (wait, reason)
        for a in todo.items:
            if (a.scope, a.target) not in missing:
                self._unknown.found(f"{a.scope}:{a.target}")
        records = {r.offset: r for r in batch.records}
        for offset, (wait, reason) in deferred.items():
            report.defer(records[offset], reason, wait)
        for offset, reason in given_up.items():
            if offset not in deferred:
                report.give_up(reason)
        for reason in waiting:  # one per write that deferred any, as the MLflow sink counts
            self._retries.labels(KIND, reason).inc()
        self._writes.labels(KIND, "written").inc(report.written)
        for reason, n in skipped.items():
            report.skip(reason, n)
            self._skipped.labels(KIND, reason).inc(n)
        return report

    def _post(self, scope: str, items: list[Annotation], report: WriteReport,
              missing: dict[tuple[str, str], list[Annotation]], skipped: Counter[str]) -> None:
        """Upsert `items`; the ones whose target Phoenix does not know go to `missing`, the rest are
        posted again without them (Phoenix refuses a whole request for one unknown id)."""
        while items:
            outcome, unknown = self._client.annotate(scope, [a.body for a in items])
            if outcome == "written":
                report.written += len(items)
                return
            if outcome == "rejected":
                if len(items) == 1:
                    skipped["rejected"] += 1
                else:  # find the one refused: each on its own
                    for a in items:
                        self._post(scope, [a], report, missing, skipped)
                return
            lost = [a for a in items if a.target in unknown]
            if not lost:  # the ids named are none of ours: do not loop
                raise Transient("server_error")
            for a in lost:
                missing.setdefault((scope, a.target), []).append(a)
            items = [a for a in items if a.target not in unknown]

    def _retry(self, exc: Transient) -> None:
        after = min(exc.retry_after, RETRY_AFTER_MAX_S) if exc.retry_after is not None \
            else BACKOFF_BASE_S * random.uniform(0.5, 1.0)
        self._retries.labels(KIND, exc.reason).inc()
        if exc.reason == "unauthorized":
            self._client.log_once(("unauthorized",), logging.ERROR, "Phoenix refused the sink's credentials; "
                                  "retrying (check sink.phoenix.%s)", self.settings.auth_key())
        raise RetryLater(exc.reason, after_s=after) from None
