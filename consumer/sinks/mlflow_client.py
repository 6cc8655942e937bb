"""The MLflow REST client of the MLflow sink (`tracejudge.consumer.sinks.mlflow`): trace lookups
(`batchGetInfos`, or one GET per trace on a server without it), feedback writes and deletes, and what the
server's answers mean (written, unknown trace, rejected, or `Transient`: retry later). Its settings are
`tracejudge.consumer.sinks.mlflow_settings.MlflowSinkSettings`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from tracejudge.consumer.sinks.mlflow_settings import MlflowSinkSettings
from tracejudge.schemas.version import __version__

__all__ = ["EVALUATION_KEY", "SESSION_ID_KEY", "Feedback", "MlflowClient", "SessionFeedback", "TraceInfo",
           "Transient", "Unavailable", "error_code", "raise_unavailable"]

log = logging.getLogger("tracejudge.consumer.sinks.mlflow")

TRACES_PATH = "/api/3.0/mlflow/traces"
# Trace ids per batchGetInfos request (the server itself queries SQLite in chunks of this order).
INFO_CHUNK = 100
# What MLflow's own session scoring marks a session's feedback with (`AssessmentMetadataKey.
# ONLINE_SCORING_SESSION_ID`; it deletes the earlier ones by it), and the metadata key of its evaluation.
SESSION_ID_KEY = "mlflow.assessment.onlineScoringSessionId"
EVALUATION_KEY = "tracejudge.evaluation"


@dataclass(slots=True)
class Feedback:
    """One feedback to write: the trace it goes on, its idempotency key, and the request body."""

    trace_id: str
    key: str
    name: str
    body: bytes
    # Session feedback: the session and its evaluation number (None / 0 for a trace verdict).
    session_id: str | None = None
    evaluation: int = 0


class Transient(Exception):
    """A request that may succeed later (network, 429, 5xx, 401/403)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class Unavailable(Exception):
    """Requests of a lookup that may succeed later; the sink asks for the batch again."""

    def __init__(self, failures: list[Transient]) -> None:
        super().__init__(", ".join(f.reason for f in failures))
        self.failures = failures


def raise_unavailable(outcomes: list[Any]) -> None:
    """Raise `Unavailable` when any of `map`'s outcomes is a `Transient`."""
    transient = [o for o in outcomes if isinstance(o, Transient)]
    if transient:
        raise Unavailable(transient)


@dataclass(frozen=True, slots=True)
class SessionFeedback:
    """A session feedback this sink wrote earlier, as the trace holds it."""

    assessment_id: str
    name: str
    session_id: str
    evaluation: int
    key: str


@dataclass(slots=True)
class TraceInfo:
    """What the server holds for a trace: this sink's feedback keys, its experiment, its session feedback."""

    keys: set[str]
    experiment_id: str | None
    sessions: list[SessionFeedback] = field(default_factory=list)
    # The trace's tags (the findings written on it are `tracejudge.finding.*` tags).
    tags: dict[str, str] = field(default_factory=dict)

    def newer(self, fb: Feedback) -> bool:
        """True when the trace holds this session's feedback of the same name from a later evaluation."""
        return any(s.session_id == fb.session_id and s.name == fb.name and s.evaluation > fb.evaluation
                   for s in self.sessions)

    def replaced_by(self, fb: Feedback) -> list[str]:
        """The ids of this session's feedback of the same name from earlier evaluations."""
        return [s.assessment_id for s in self.sessions
                if s.session_id == fb.session_id and s.name == fb.name and s.evaluation < fb.evaluation
                and s.key != fb.key]


class MlflowClient:
    """The MLflow REST calls of the sink: one pooled httpx client, at most `max_concurrency` requests in
    flight (`map` runs a call over items on the pool). A call that may succeed later raises (or, through
    `map`, returns) `Transient`; `lookup` raises `Unavailable` with them."""

    def __init__(self, settings: MlflowSinkSettings, env: Mapping[str, str]) -> None:
        self.tracking_uri = settings.tracking_uri
        limits = httpx.Limits(max_connections=settings.max_concurrency,
                              max_keepalive_connections=settings.max_concurrency)
        self.http = httpx.Client(base_url=settings.tracking_uri, auth=settings.auth(env), limits=limits,
                                 timeout=settings.timeout_s,
                                 headers={"content-type": "application/json",
                                          "user-agent": f"tracejudge/{__version__}"})
        self._pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="mlflow-sink")
        self._batch_infos = True  # the server has batchGetInfos (MLflow >= 3.x); else one GET per trace
        self._logged: set[tuple[Any, ...]] = set()
        self._log_lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.http.close()

    def check(self, experiment_id: str | None) -> httpx.Response | None:
        """The start-up check's answer: the experiment (or any, to test the credentials); None, logged,
        when the server does not answer yet (writes wait for it)."""
        try:
            if experiment_id:
                return self.http.get("/api/2.0/mlflow/experiments/get",
                                     params={"experiment_id": experiment_id})
            return self.http.post("/api/2.0/mlflow/experiments/search", content=b'{"max_results": 1}')
        except httpx.HTTPError as exc:
            log.warning("MLflow tracking server %s not reachable yet (%s); writes will wait for it",
                        self.tracking_uri, type(exc).__name__)
            return None

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """`fn` over `items` on the pool; a `Transient` raised by `fn` is returned in its place."""
        if not items:
            return []
        if len(items) == 1:
            return [_call(fn, items[0])]
        futures: list[Future[Any]] = [self._pool.submit(_call, fn, item) for item in items]
        return [f.result() for f in futures]

    def lookup(self, trace_ids: list[str]) -> dict[str, TraceInfo]:
        """Trace id -> its feedback keys and experiment, for the traces the server has; `Unavailable`
        when the server cannot answer now."""
        found: dict[str, TraceInfo] = {}
        one_by_one = trace_ids
        if self._batch_infos and trace_ids:
            chunks = [trace_ids[i:i + INFO_CHUNK] for i in range(0, len(trace_ids), INFO_CHUNK)]
            outcomes = self.map(self._get_infos, chunks)
            self._raise_first(outcomes)
            one_by_one = []
            for chunk, infos in zip(chunks, outcomes, strict=True):
                if infos is None:  # this server cannot answer the batch: one GET per trace instead
                    one_by_one.extend(chunk)
                else:
                    found.update(infos)
        outcomes = self.map(self._get_info, one_by_one)
        self._raise_first(outcomes)
        for trace_id, info in zip(one_by_one, outcomes, strict=True):
            if info is not None:
                found[trace_id] = info
        return found

    @staticmethod
    def _raise_first(outcomes: list[Any]) -> None:
        raise_unavailable(outcomes)

    def _get_infos(self, chunk: list[str]) -> dict[str, TraceInfo] | None:
        """batchGetInfos for a chunk; None when it cannot be answered that way (then per trace)."""
        r = self._request("POST", f"{TRACES_PATH}/batchGetInfos", orjson.dumps({"trace_ids": chunk}))
        if r.status_code in (404, 405, 501) and error_code(r) in (None, "ENDPOINT_NOT_FOUND"):
            if self._batch_infos:
                self._batch_infos = False  # an MLflow 3 server from before batchGetInfos
                log.info("MLflow server has no batchGetInfos (HTTP %d); reading traces one request each",
                         r.status_code)
            return None
        self._raise_transient(r)
        if r.status_code != 200:
            self.log_once(("lookup", r.status_code, error_code(r)), logging.WARNING,
                           "MLflow batchGetInfos answered HTTP %d (%s); reading those traces one by one",
                           r.status_code, error_code(r) or "no error code")
            return None
        out: dict[str, TraceInfo] = {}
        for info in _json(r).get("trace_infos") or ():
            if isinstance(info, dict) and isinstance(info.get("trace_id"), str):
                out[info["trace_id"]] = _trace_info(info)
        return out

    def _get_info(self, trace_id: str) -> TraceInfo | None:
        r = self._request("GET", f"{TRACES_PATH}/{quote(trace_id, safe='')}")
        if r.status_code == 404:
            return None
        self._raise_transient(r)
        if r.status_code != 200:
            self.log_once(("lookup", r.status_code, error_code(r)), logging.WARNING,
                           "MLflow trace lookup answered HTTP %d (%s); the trace counts as unknown",
                           r.status_code, error_code(r) or "no error code")
            return None
        info = (_json(r).get("trace") or {}).get("trace_info")
        return _trace_info(info) if isinstance(info, dict) else None

    def post(self, fb: Feedback) -> str:
        r = self._request("POST", f"{TRACES_PATH}/{quote(fb.trace_id, safe='')}/assessments", fb.body)
        if outcome := self._written_or_unknown(r):
            return outcome
        code = error_code(r)
        self.log_once(("rejected", r.status_code, code), logging.WARNING,
                       "MLflow rejected feedback %r (HTTP %d, %s): %s; skipping such feedback",
                       fb.name, r.status_code, code or "no error code", _message(r))
        return "rejected"

    def set_tag(self, target: tuple[str, str, str]) -> str:
        """Set one trace tag (`PATCH /api/2.0/mlflow/traces/{id}/tags`, MLflow's `set_trace_tag`): an
        upsert, so setting it again changes nothing. "written", "unknown" (no such trace), "rejected"."""
        trace_id, key, value = target
        r = self._request("PATCH", f"/api/2.0/mlflow/traces/{quote(trace_id, safe='')}/tags",
                          orjson.dumps({"key": key, "value": value}))
        if outcome := self._written_or_unknown(r):
            return outcome
        code = error_code(r)
        self.log_once(("tag", r.status_code, code), logging.WARNING,
                      "MLflow rejected trace tag %r (HTTP %d, %s): %s; skipping such tags", key,
                      r.status_code, code or "no error code", _message(r))
        return "rejected"

    def _written_or_unknown(self, r: httpx.Response) -> str | None:
        """A write to a trace: "written", "unknown" (no such trace), `Transient` raised for a failure worth
        retrying, else None (rejected: the caller says what was)."""
        if r.status_code == 200:
            return "written"
        if r.status_code == 404 and error_code(r) in ("RESOURCE_DOES_NOT_EXIST", None):
            return "unknown"
        self._raise_transient(r)
        return None

    def delete(self, target: tuple[str, str]) -> str:
        trace_id, assessment_id = target
        r = self._request("DELETE", f"{TRACES_PATH}/{quote(trace_id, safe='')}/assessments/"
                                    f"{quote(assessment_id, safe='')}")
        if r.status_code == 200:
            return "deleted"
        if r.status_code == 404:
            return "gone"
        self._raise_transient(r)
        code = error_code(r)
        self.log_once(("delete", r.status_code, code), logging.WARNING,
                       "MLflow refused to delete an earlier session feedback (HTTP %d, %s): %s; it stays "
                       "beside the newer one", r.status_code, code or "no error code", _message(r))
        return "rejected"

    def _request(self, method: str, path: str, body: bytes | None = None) -> httpx.Response:
        try:
            return self.http.request(method, path, content=body)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout, protocol error
            raise Transient("network") from exc

    @staticmethod
    def _raise_transient(r: httpx.Response) -> None:
        if r.status_code == 429:
            raise Transient("rate_limited", _retry_after(r))
        if r.status_code >= 500:
            raise Transient("server_error", _retry_after(r))
        if r.status_code in (401, 403):
            raise Transient("unauthorized")

    def log_once(self, key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        with self._log_lock:
            if key in self._logged or len(self._logged) > 1000:
                return
            self._logged.add(key)
        log.log(level, msg, *args)


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except Transient as exc:
        return exc


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        value = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def error_code(r: httpx.Response) -> str | None:
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


def _trace_info(info: Mapping[str, Any]) -> TraceInfo:
    keys: set[str] = set()
    sessions: list[SessionFeedback] = []
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
                sessions.append(SessionFeedback(assessment_id, a["assessment_name"], session_id,
                                                 int(evaluation) if evaluation.isdigit() else 1,
                                                 meta["tracejudge.key"]))
    location = info.get("trace_location")
    experiment = None
    if isinstance(location, Mapping) and isinstance(location.get("mlflow_experiment"), Mapping):
        experiment = location["mlflow_experiment"].get("experiment_id")
    raw = info.get("tags")
    if isinstance(raw, list):  # [{key, value}] (MLflow 2's TraceInfo)
        raw = {t.get("key"): t.get("value") for t in raw if isinstance(t, Mapping)}
    tags = {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(raw, Mapping) else {}
    return TraceInfo(keys, str(experiment) if experiment is not None else None, sessions, tags)
