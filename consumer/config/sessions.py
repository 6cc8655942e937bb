"""The sections of the stages past evaluation: `sessions:` (`tracejudge sessions`) and `agreement:`
(`tracejudge agreement`) (`tracejudge.consumer.config`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from tracejudge.consumer.config.common import Section, group_id_value, optional_topic

__all__ = ["AgreementSettings", "SessionsSettings"]


class SessionsSettings(Section):
    """`tracejudge sessions`: the session stage (`consumer/stages/sessions.py`). It reads the trace results
    (`input_topic`, default `stream.results_topic`), gathers the turns of each session, and writes one
    session result per closed session to `results_topic` (required for the stage)."""

    # Default: stream.results_topic.
    input_topic: str | None = None
    # Where the session results go, one per closed session; required by `tracejudge sessions`.
    results_topic: str | None = None
    # Where records that are not trace results (or of a newer schema version) go; else logged.
    dead_letter_topic: str | None = None
    # Default: tracejudge-sessions.
    group_id: str | None = None
    # A session closes this long after its last turn (stream time of its partition, or wall clock).
    inactivity_s: float = Field(default=300.0, gt=0)
    # A session reaching either is closed early, as incomplete.
    max_turns: int = Field(default=100, gt=0)
    # A session lasting longer than this (first turn to last) is closed early, as incomplete.
    max_duration_s: float = Field(default=3600.0, gt=0)
    # Memory caps: past one, the least recently active sessions are closed early (evicted).
    max_open_sessions: int = Field(default=100_000, gt=0)
    # Turns held by open sessions, at most; past it the least recently active sessions are closed early.
    max_turns_held: int = Field(default=1_000_000, gt=0)
    # Bytes (estimated from text lengths) held by open sessions, at most; past it the least recently active
    # sessions are closed early.
    max_bytes_held: int = Field(default=536_870_912, gt=0)
    # Closed sessions remembered (with their turns) so a late turn reopens them; 0 never reopens.
    max_closed_sessions: int = Field(default=10_000, ge=0)

    _topic = field_validator("input_topic", "results_topic", "dead_letter_topic")(optional_topic)

    _group = field_validator("group_id")(group_id_value)


class AgreementSettings(Section):
    """`tracejudge agreement`: the online-agreement stage (`consumer/stages/agreement.py`). It reads the trace
    results (`results_topic`, default `stream.results_topic`) and the human labels (`labels_topic`,
    required for the stage) and joins them by trace id / request id within `window_s`."""

    # The trace results whose verdicts are compared. Default: stream.results_topic.
    results_topic: str | None = None
    # The topic of human labels (a trace or request id, a judge, a pass/fail value); required by `tracejudge
    # agreement`.
    labels_topic: str | None = None
    # Default: tracejudge-agreement.
    group_id: str | None = None
    # How long a verdict waits for its label and a label for its verdict (wall clock); a label still
    # unmatched then is counted as unmatched.
    window_s: float = Field(default=3600.0, gt=0)
    # Verdicts and labels held waiting, each; past it the oldest is dropped (counted).
    max_pending: int = Field(default=100_000, gt=0)

    _topic = field_validator("results_topic", "labels_topic")(optional_topic)

    _group = field_validator("group_id")(group_id_value)
