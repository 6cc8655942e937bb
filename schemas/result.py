"""The result line: one per evaluated record, the same shape from `tracejudge eval` (JSON Lines) and
from `tracejudge run` (the results topic). Documented in docs/pages/concepts/record.md.

The line is versioned (`schema_version`, `SCHEMA_VERSION`; a line without it is version 1), and every
change to its shape raises the version. Readers ignore fields they do not know, read every version up
to their own, and refuse a greater one (`schema_version_of`, `EvaluationResult.from_dict`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tracejudge.schemas.record import EvalRecord

# The longest session id used as it is as a Kafka key; a longer one is hashed (`session_key`).
SESSION_KEY_MAX_BYTES = 256


def session_key(session_id: str) -> tuple[str, bool]:
    """The results-topic key of a session's records and results, and whether it was hashed: the
    session id itself, or "sha256:" + the hex SHA-256 of its UTF-8 bytes when they exceed
    `SESSION_KEY_MAX_BYTES` (keys stay small, and every turn of the session still gets the same key)."""
    raw = session_id.encode("utf-8", "surrogatepass")
    if len(raw) <= SESSION_KEY_MAX_BYTES:
        return session_id, False
    return "sha256:" + hashlib.sha256(raw).hexdigest(), True

# What an assessment says about its record (`Assessment.status`). A verdict passed or failed; a judge
# that errored, or was skipped for a reason other than not applying, did not judge (no evidence either
# way: never a pass); a judge that does not apply to the record (its inputs are missing, a filter
# excludes the record, nothing in it to judge) is set aside.
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
NOT_JUDGED = "not_judged"
NOT_APPLICABLE = "not_applicable"
# A verdict without `passed` (a judge that states no threshold): said something, but not pass or fail.
NO_VERDICT = "no_verdict"
# The skip reasons that mean the judge does not apply to the record. Every other reason (`not_sampled`,
# `budget`, `circuit_open`, `overloaded`, `too_large`, `closed`, `failed_trace`, and any added later)
# means it should have judged and did not.
INAPPLICABLE_SKIPS = frozenset({"missing_inputs", "filtered", "not_applicable"})


def assessment_status(a: Assessment) -> str:
    """`PASSED`, `FAILED`, `ERROR`, `NOT_JUDGED` (skipped, so no verdict, though the judge applies),
    `NOT_APPLICABLE` (skipped because the judge does not apply) or `NO_VERDICT`."""
    if a.error is not None:
        return ERROR
    if a.skipped is not None:
        return NOT_APPLICABLE if a.skipped in INAPPLICABLE_SKIPS else NOT_JUDGED
    if a.passed is None:
        return NO_VERDICT
    return PASSED if a.passed else FAILED


def all_judged(assessments: Sequence[Assessment]) -> bool:
    """True when the live judges gave a verdict wherever they apply: at least one verdict, and no
    judge that applies errored or was skipped. Shadow (candidate) judges do not count."""
    statuses = [assessment_status(a) for a in assessments if a.shadow_of is None]
    return any(s in (PASSED, FAILED) for s in statuses) and all(
        s in (PASSED, FAILED, NOT_APPLICABLE) for s in statuses)


def all_passed(assessments: Sequence[Assessment]) -> bool:
    """True only when the live judges judged (`all_judged`) and every verdict passed."""
    return all_judged(assessments) and all(
        assessment_status(a) != FAILED for a in assessments if a.shadow_of is None)


def why_not_passed(assessments: Sequence[Assessment]) -> list[str]:
    """One line per live judge that keeps the subject from passing: a failed verdict (with its
    rationale), an error, a skip that left no verdict; or why there is no evidence at all."""
    out = []
    live = [a for a in assessments if a.shadow_of is None]
    for a in live:
        status = assessment_status(a)
        if status == FAILED:
            score = "" if a.score is None else f" (score {a.score:.3g})"
            out.append(f"{a.name}: failed{score}" + (f": {a.rationale}" if a.rationale else ""))
        elif status == ERROR:
            out.append(f"{a.name}: error, no verdict: {a.error}")
        elif status == NOT_JUDGED:
            out.append(f"{a.name}: not judged ({a.skipped})" + (f": {a.rationale}" if a.rationale else ""))
        elif status == NO_VERDICT:
            out.append(f"{a.name}: a verdict without pass or fail (value {a.value!r})")
    if not out and not any(assessment_status(a) == PASSED for a in live):
        out.append("no judge gave a verdict: " + (", ".join(f"{a.name} ({a.skipped})" for a in live)
                                                  or "no judge ran"))
    return out


# Anything a payload decoded from JSON can hold is written natively; `str()` is the last resort (as
# `derive_text.json_text` does) so one odd value in a custom metric's output cannot lose the result line.
_ENCODER = msgspec.json.Encoder(enc_hook=str)

# 1: the fields of the first release. 2: `schema_version`, `mlflow_trace_id`; each assessment's
# `judge`, `span_id`, `input_tokens`, `output_tokens`, `sample_rate`. 3: `session_id`, `user_id`; a
# result of a turn of a session is keyed by its session id on the results topic; session result lines
# (`"kind": "session"`, `tracejudge.schemas.session`) on the session results topic.
# 4: the record's `human_labels`, `model_usage`, `cost`; each assessment's `shadow_of`, `cost_usd`,
# `redacted`; the result's `backfill`. 5: the record's `warnings` (values set aside as impossible).
# 6: the record's `version` (the app's release); each assessment's `threshold`; each trajectory call's
# `error` (why the tool call failed).
SCHEMA_VERSION = 6
_VERSION_PREFIX = b'{"schema_version":%d,' % SCHEMA_VERSION

# The source formats whose trace MLflow stores under "tr-" + the 32-hex OpenTelemetry trace id: MLflow 3
# traces, OTLP spans (MLflow's OTLP ingest derives the id so), and the MLflow traces that agent-eval and
# inference-log rows carry (their `trace_id` is set only when they carry one).
_TR_FORMATS = frozenset({"mlflow_v3", "otlp_proto", "otlp_json", "agent_eval", "inference_log"})


def mlflow_trace_id(record: EvalRecord) -> str | None:
    """The id MLflow's tracking server stores the record's trace under, or None without a trace.

    "tr-<32 hex>" for MLflow 3 and OTLP traces; an MLflow 2 trace's request id as it is (MLflow 3
    servers keep it as the trace id). Computed from `trace_id` and `source_format` when the line is
    written, so decoding pays nothing for it.
    """
    trace_id = record.trace_id
    if not trace_id:
        return None
    if record.source_format == "mlflow_v2":
        return trace_id
    return "tr-" + trace_id if record.source_format in _TR_FORMATS else None


def schema_version_of(line: Mapping[str, Any]) -> int:
    """The `schema_version` of a decoded result line: 1 when absent. ValueError when it is not a
    positive integer. A reader compares it with the version it knows (`SCHEMA_VERSION` here) and
    refuses a greater one."""
    version = line.get("schema_version", 1)
    if type(version) is not int or version < 1:
        raise ValueError(f"schema_version must be a positive integer, got {version!r}")
    return version


@dataclass(frozen=True, slots=True)
class JudgeIdentity:
    """Which judge gave a verdict: its endpoint (the `endpoints:` name; None for heuristic judges and
    code), its model (None likewise) and `version`, a fingerprint (12 hex digits of a SHA-256) of
    everything that shapes its verdicts: prompts, answer schema, verdict settings, endpoint name,
    model and the judge protocol version. The same configuration gives the same version in every
    process and run; changing any of those gives a new one."""

    endpoint: str | None
    model: str | None
    version: str


@dataclass(slots=True)
class Assessment:
    """One judge's verdict on one record.

    `value` is what the judge said in its own scale ("yes"/"no", 1–5, a precision); `score` is that
    mapped to [0, 1] (1 = good); `passed` applies the judge's threshold. A judge that could not give
    a verdict has `error` set and value/score/passed None; one that was not run has `skipped` set to
    the reason ("missing_inputs", "not_sampled", "budget", "circuit_open", "failed_trace", …).

    `judge` says which judge this is (endpoint, model, version); `span_id` the hex id of the span the
    judge evaluated when it evaluated one span (None: the trace as a whole, as every built-in judge
    does); `input_tokens`/`output_tokens` the judgement's usage as the endpoint reported it (None when
    unknown, and for heuristic judges and skips); `sample_rate` the share of eligible records the judge
    was configured to judge.
    """

    name: str
    value: Any = None
    score: float | None = None
    passed: bool | None = None
    rationale: str | None = None
    error: str | None = None
    skipped: str | None = None
    # "llm:<model>", "heuristic", "embedding:<model>", …
    source: str | None = None
    duration_seconds: float | None = None
    judge: JudgeIdentity | None = None
    span_id: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    sample_rate: float | None = None
    # Schema 4. The judge a shadow (candidate) judge may replace: its verdicts are published, never
    # exported as quality. The judgement's cost in USD (usage x the judge model's price). True when the
    # judge saw redacted text (personal data replaced by typed placeholders before it left the process).
    shadow_of: str | None = None
    cost_usd: float | None = None
    redacted: bool | None = None
    # Schema 6. The threshold `passed` applied to `score` (None: the judge states none, or no verdict).
    threshold: float | None = None

    @property
    def status(self) -> str:
        """What this assessment says (`assessment_status`): "passed", "failed", "error",
        "not_judged", "not_applicable" or "no_verdict". Not part of the line: derived from it."""
        return assessment_status(self)


@dataclass(slots=True)
class SourceRef:
    """Where the record came from: a file line, or a Kafka topic/partition/offset."""

    format: str
    file: str | None = None
    line: int | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


@dataclass(slots=True)
class Backfill:
    """Marks a result of `tracejudge backfill`: the run's id and the time range it re-judged (seconds
    since the epoch; `end` None: up to when the run started). Schema 4."""

    run: str
    start: float
    end: float | None = None


@dataclass(slots=True)
class EvaluationResult:
    record: EvalRecord
    source: SourceRef
    # Computed metric values by name; a metric that raised has None here and its error below.
    metrics: dict[str, float | None] = field(default_factory=dict)
    metric_errors: dict[str, str] = field(default_factory=dict)
    assessments: list[Assessment] = field(default_factory=list)
    backfill: Backfill | None = None

    @classmethod
    def from_dict(cls, line: Mapping[str, Any]) -> EvaluationResult:
        """The result of a decoded result line (`to_dict`'s output, or `json.loads` of a line of any
        schema version up to `SCHEMA_VERSION`; fields it does not know are ignored). ValueError for
        a newer version, msgspec.ValidationError for a line of the wrong shape."""
        version = schema_version_of(line)
        if version > SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
        record = msgspec.convert(line, EvalRecord)
        source = line.get("source") or {"format": record.source_format}
        return cls(
            record=record,
            source=msgspec.convert(source, SourceRef),
            metrics=dict(line.get("metrics") or {}),
            metric_errors=msgspec.convert(line.get("metric_errors") or {}, dict[str, str]),
            assessments=msgspec.convert(line.get("assessments") or [], list[Assessment]),
            backfill=msgspec.convert(line["backfill"], Backfill) if line.get("backfill") else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The result line as plain Python objects (what `to_json` writes)."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        out.update(msgspec.to_builtins(self.record))
        out.update(msgspec.to_builtins(self._tail()))
        return out

    def to_json(self) -> bytes:
        # msgspec writes the structs and dataclasses natively, ~10x faster than building dicts first;
        # the objects are spliced so the record's fields stay at the top level (the documented shape),
        # after the schema version.
        head = _ENCODER.encode(self.record)
        tail = _ENCODER.encode(self._tail())
        return b"".join((_VERSION_PREFIX, memoryview(head)[1:-1], b",", memoryview(tail)[1:]))

    def _tail(self) -> dict[str, Any]:
        tail = {"mlflow_trace_id": mlflow_trace_id(self.record), "source": self.source,
                "metrics": self.metrics, "metric_errors": self.metric_errors, "assessments": self.assessments}
        if self.backfill is not None:
            tail["backfill"] = self.backfill
        return tail

    @property
    def mlflow_trace_id(self) -> str | None:
        """The id MLflow stores the trace under (see `mlflow_trace_id`)."""
        return mlflow_trace_id(self.record)

    def assessment(self, name: str) -> Assessment:
        """The assessment of judge `name`; KeyError naming the judges present when there is none."""
        for a in self.assessments:
            if a.name == name:
                return a
        raise KeyError(f"no assessment {name!r}; have {[a.name for a in self.assessments]}")

    @property
    def passed(self) -> bool:
        """True only when the trace did not fail, the judges judged it (`judged`) and every verdict
        passed. A judge that was skipped (`not_sampled`, `budget`, `circuit_open`, …) or errored is
        never a pass; one that does not apply (`missing_inputs`, `filtered`, `not_applicable`) is set
        aside; a result with no verdict at all (no judge ran, or none applied) did not pass. Shadow
        judges' verdicts do not count. `why_not_passed` says which judge kept it from passing."""
        return not self.record.failed and all_passed(self.assessments)

    @property
    def judged(self) -> bool:
        """True when every live judge that applies to the record gave a verdict (pass or fail) and at
        least one did: False when one errored or was skipped (`not_sampled`, `budget`, …), or no
        judge gave a verdict. `passed` is `judged` and every verdict passing, on a trace that did not
        fail."""
        return all_judged(self.assessments)

    @property
    def statuses(self) -> dict[str, str]:
        """Each judge's outcome by name: "passed", "failed", "error", "not_judged" (skipped though
        it applies: the reason is the assessment's `skipped`), "not_applicable" or "no_verdict"."""
        return {a.name: a.status for a in self.assessments}

    @property
    def why_not_passed(self) -> list[str]:
        """Why `passed` is False, one line per cause (empty when it passed): the trace failed, a
        verdict failed, a judge errored or was skipped, or no judge gave a verdict. Made for
        `assert result.passed, result.why_not_passed`."""
        out = [f"the trace failed: {self.record.error or 'error status'}"] if self.record.failed else []
        return out + why_not_passed(self.assessments) if (out or not self.passed) else []

    @property
    def key(self) -> str | None:
        """The Kafka key of the result: the session id when the record has one (so every turn of a
        session lands on one partition of the results topic; an id over 256 UTF-8 bytes is replaced
        by its hash, `session_key`), else the trace id, else the request id."""
        if self.record.session_id:
            return session_key(self.record.session_id)[0]
        return self.record.trace_id or self.record.request_id
