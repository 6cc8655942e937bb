"""Sessions: the turns of one conversation, and the session result line.

A session is the results that share a `session_id` (see `EvalRecord.session_id` for where the id comes
from). The session stage (`tracejudge sessions`, `consumer/stages/sessions.py`) and `tracejudge eval` gather a
session's turns, compute its metrics, run the session judges and write one session result line:

    {"schema_version": 3, "kind": "session", "session_id": "...", "user_id": ..., "app": ...,
     "status": "complete"|"incomplete", "close_reason": "inactivity"|"end_of_input"|"max_turns"|
     "max_duration"|"evicted", "evaluation": 1, "started_at": ..., "ended_at": ...,
     "turns": [{"trace_id", "request_id", "mlflow_trace_id", "root_span_id", "timestamp",
                "placed_by_arrival", "failed", "partition", "offset"}, ...],
     "metrics": {"turns": 3, ...}, "assessments": [...], "source": {...}}

`evaluation` counts the evaluations of the session: 1 the first time it closes, 2 when a turn arrived
after it closed and it was evaluated again with that turn, and so on. The result of a later evaluation
replaces the earlier ones (the MLflow sink deletes the session's earlier assessments, as MLflow's own
session scoring does).

The turns' texts are not in the session result (they are on the results topic, one line per turn);
`turns` refers to them. Live, session results go to `sessions.results_topic`, keyed by the session
key (`schemas.result.session_key`); offline, `tracejudge eval` writes them after the trace results.

`Turn` is what the session stage holds per turn: decoded straight from the result line's bytes
(`decode_turn`), only the fields a session needs, the texts once (never copied per judge).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tracejudge.schemas.result import (
    SCHEMA_VERSION,
    Assessment,
    EvaluationResult,
    all_judged,
    all_passed,
    schema_version_of,
    session_key,
    why_not_passed,
)

__all__ = ["CLOSE_REASONS", "COMPLETE", "INCOMPLETE", "SESSION_KIND", "SessionResult", "SessionSource",
           "Turn", "TurnLine", "TurnRef", "decode_turn", "is_session_line", "place_turn",
           "session_metrics"]

SESSION_KIND = "session"
COMPLETE = "complete"
INCOMPLETE = "incomplete"
# Why a session was closed -> its status. Inactivity and the end of an offline input close a session
# as complete; a cap closes it early, as incomplete.
CLOSE_REASONS: dict[str, str] = {
    "inactivity": COMPLETE,
    "end_of_input": COMPLETE,
    "max_turns": INCOMPLETE,
    "max_duration": INCOMPLETE,
    "evicted": INCOMPLETE,
}


# -- one turn -------------------------------------------------------------------------------------


class _Tokens(msgspec.Struct, gc=False):
    input: int | None = None
    output: int | None = None


class _Call(msgspec.Struct, gc=False):
    tool_name: str | None = None


class TurnLine(msgspec.Struct, gc=False):
    """The fields of a trace result line a session needs (msgspec skips the others while decoding)."""

    schema_version: int = 1
    kind: str | None = None
    session_id: str | None = None
    user_id: str | None = None
    app: str | None = None
    trace_id: str | None = None
    request_id: str | None = None
    mlflow_trace_id: str | None = None
    root_span_id: str | None = None
    timestamp: float | None = None
    latency_seconds: float | None = None
    request: str | None = None
    response: str | None = None
    failed: bool | None = None
    error: str | None = None
    tokens: _Tokens | None = None
    trajectory: list[_Call] | None = None


_TURN_DECODER = msgspec.json.Decoder(TurnLine)


def decode_turn(value: bytes) -> TurnLine:
    """A result line's session fields. msgspec.DecodeError / ValidationError for bytes that are not a
    JSON object of the right shape (the caller dead-letters it)."""
    return _TURN_DECODER.decode(value)


# Turn timestamps before this (2000-01-01T00:00:00Z) or more than `MAX_FUTURE_S` past the turn's arrival
# are absurd: the turn is placed by its arrival time instead (and counted by the caller).
MIN_TIMESTAMP = 946_684_800.0
MAX_FUTURE_S = 86_400.0


def place_turn(timestamp: float | None, arrival: float) -> tuple[float, bool]:
    """When a turn happened, for ordering it in its session: its own timestamp when it is sane, else
    its arrival time. Returns (time, placed_by_arrival)."""
    if timestamp is None or not MIN_TIMESTAMP <= timestamp <= arrival + MAX_FUTURE_S:  # NaN fails too
        return arrival, True
    return timestamp, False


class Turn(msgspec.Struct, gc=False):
    """One turn held by a session: where it came from and what a session's metrics and judges read.

    `timestamp` is when the turn's request started (seconds since the epoch); when the line's own
    timestamp was missing or absurd it is the arrival time and `placed_by_arrival` is True."""

    trace_id: str | None
    request_id: str | None
    mlflow_trace_id: str | None
    root_span_id: str | None
    timestamp: float
    placed_by_arrival: bool
    request: str | None
    response: str | None
    failed: bool | None
    error: str | None
    input_tokens: int | None
    output_tokens: int | None
    tool_calls: int
    latency_seconds: float | None
    partition: int | None = None
    offset: int | None = None

    @classmethod
    def from_line(cls, line: TurnLine, *, timestamp: float, placed_by_arrival: bool,
                  partition: int | None = None, offset: int | None = None) -> Turn:
        tokens = line.tokens
        return cls(line.trace_id, line.request_id, line.mlflow_trace_id, line.root_span_id, timestamp,
                   placed_by_arrival, line.request, line.response, line.failed, line.error,
                   tokens.input if tokens else None, tokens.output if tokens else None,
                   len(line.trajectory) if line.trajectory else 0, line.latency_seconds, partition, offset)

    @classmethod
    def from_result(cls, result: EvaluationResult, *, arrival: float) -> Turn:
        """The turn of an in-memory result (offline, the Python API); placed as `place_turn` says."""
        r = result.record
        when, by_arrival = place_turn(r.timestamp, arrival)
        tokens = r.tokens
        return cls(r.trace_id, r.request_id, result.mlflow_trace_id, r.root_span_id, when, by_arrival,
                   r.request, r.response, r.failed, r.error, tokens.input if tokens else None,
                   tokens.output if tokens else None, len(r.trajectory) if r.trajectory else 0,
                   r.latency_seconds, result.source.partition, result.source.offset)

    def ref(self) -> TurnRef:
        return TurnRef(self.trace_id, self.request_id, self.mlflow_trace_id, self.root_span_id,
                       self.timestamp, self.placed_by_arrival, self.failed, self.partition, self.offset)


class TurnRef(msgspec.Struct, gc=False):
    """A turn as the session result names it (its text is on the results topic)."""

    trace_id: str | None = None
    request_id: str | None = None
    mlflow_trace_id: str | None = None
    root_span_id: str | None = None
    timestamp: float | None = None
    placed_by_arrival: bool = False
    failed: bool | None = None
    partition: int | None = None
    offset: int | None = None


# -- session metrics ------------------------------------------------------------------------------


def session_metrics(turns: Sequence[Turn]) -> dict[str, float | None]:
    """The computed metrics of a session (every session, judged or not), turns in timestamp order:

    turns; duration_seconds (first turn's start to the last turn's end: its start plus its latency
    when known); failed_turns; input_tokens / output_tokens (sums over the turns that report them;
    None when none does); tool_calls; turns_until_first_failure (1-based index of the first failed
    turn; None when no turn failed); last_turn_failed (1.0 / 0.0; None when unknown)."""
    n = len(turns)
    if not n:
        return {"turns": 0.0}
    first, last = turns[0], turns[-1]
    end = last.timestamp + (last.latency_seconds or 0.0)
    failed_at = next((i for i, t in enumerate(turns, 1) if t.failed), None)
    ins = [t.input_tokens for t in turns if t.input_tokens is not None]
    outs = [t.output_tokens for t in turns if t.output_tokens is not None]
    return {
        "turns": float(n),
        "duration_seconds": max(0.0, end - first.timestamp),
        "failed_turns": float(sum(1 for t in turns if t.failed)),
        "input_tokens": float(sum(ins)) if ins else None,
        "output_tokens": float(sum(outs)) if outs else None,
        "tool_calls": float(sum(t.tool_calls for t in turns)),
        "turns_until_first_failure": float(failed_at) if failed_at is not None else None,
        "last_turn_failed": None if last.failed is None else float(bool(last.failed)),
    }


# -- the session result ---------------------------------------------------------------------------


@dataclass(slots=True)
class SessionSource:
    """Where the session's turns came from: a results-topic partition and the offsets of its first
    and last turns, or input files (offline)."""

    format: str = "tracejudge_result"
    topic: str | None = None
    partition: int | None = None
    first_offset: int | None = None
    last_offset: int | None = None
    file: str | None = None


_ENCODER = msgspec.json.Encoder(enc_hook=str)


@dataclass(slots=True)
class SessionResult:
    """One evaluated session (see the module docstring for the line)."""

    session_id: str
    user_id: str | None
    app: str | None
    status: str
    close_reason: str
    turns: list[TurnRef]
    started_at: float | None
    ended_at: float | None
    metrics: dict[str, float | None] = field(default_factory=dict)
    assessments: list[Assessment] = field(default_factory=list)
    evaluation: int = 1
    source: SessionSource = field(default_factory=SessionSource)

    @property
    def key(self) -> str:
        """The Kafka key: the session key (`schemas.result.session_key`)."""
        return session_key(self.session_id)[0]

    @property
    def first_turn(self) -> TurnRef | None:
        """The chronologically first turn: MLflow's session scoring writes a session's assessments on
        its first trace, and so does the MLflow sink."""
        return self.turns[0] if self.turns else None

    @property
    def last_turn(self) -> TurnRef | None:
        """The last turn: the OpenTelemetry sink parents a session verdict to its root span."""
        return self.turns[-1] if self.turns else None

    def assessment(self, name: str) -> Assessment:
        for a in self.assessments:
            if a.name == name:
                return a
        raise KeyError(f"no assessment {name!r}; have {[a.name for a in self.assessments]}")

    @property
    def passed(self) -> bool:
        """True only when the session judges judged the session (`judged`) and every verdict passed:
        a session judge that was skipped (`not_sampled`, `budget`, `circuit_open`, …) or errored is
        never a pass, and a session no judge gave a verdict on did not pass. The turns' own results
        say whether each turn passed."""
        return all_passed(self.assessments)

    @property
    def judged(self) -> bool:
        """True when every session judge that applies gave a verdict and at least one did."""
        return all_judged(self.assessments)

    @property
    def statuses(self) -> dict[str, str]:
        """Each session judge's outcome by name (`Assessment.status`)."""
        return {a.name: a.status for a in self.assessments}

    @property
    def why_not_passed(self) -> list[str]:
        """Why `passed` is False, one line per session judge (empty when it passed)."""
        return [] if self.passed else why_not_passed(self.assessments)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": SESSION_KIND}
        out.update(msgspec.to_builtins(self, enc_hook=str))
        return out

    def to_json(self) -> bytes:
        body = _ENCODER.encode(self)
        return b'{"schema_version":%d,"kind":"session",' % SCHEMA_VERSION + body[1:]

    @classmethod
    def from_dict(cls, line: Mapping[str, Any]) -> SessionResult:
        """The session result of a decoded line; ValueError for a line that is not a session result
        or of a newer schema version, msgspec.ValidationError for one of the wrong shape."""
        version = schema_version_of(line)
        if version > SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
        if line.get("kind") != SESSION_KIND:
            raise ValueError(f"not a session result (kind {line.get('kind')!r})")
        fields = {k: v for k, v in line.items() if k not in ("schema_version", "kind")}
        return msgspec.convert(fields, cls, strict=False)


def is_session_line(line: Mapping[str, Any]) -> bool:
    """True for a decoded session result line (`"kind": "session"`)."""
    return line.get("kind") == SESSION_KIND
