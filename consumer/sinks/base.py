"""The interface between the sink runtime and a sink: what `tracejudge sink <kind>` calls.

A sink reads the results topic (the system of record) as its own consumer group and writes each
result's verdicts where people debug: MLflow assessments, OpenTelemetry evaluation events. The
runtime (`tracejudge.consumer.runtime.loop`) owns Kafka: the poll loop, offsets, commits, rebalances,
signals, `/metrics` and the probes. It decodes each record into a `SinkRecord` (a record that is not a
tracejudge result, or of an unknown schema version, is dead-lettered by the runtime and never reaches
the sink), gathers them per partition, and at each checkpoint calls `Sink.write(batch)` once per
partition with what arrived since the last one. When `write` returns, every record of the batch is
done and its offset may be committed. Modelled on Quix Streams' `BatchingSink`.

    class PrintSink(Sink):
        kind = "print"
        def __init__(self, settings, registry):  # the runtime builds a sink as Class(settings, registry)
            self.settings = settings
        def write(self, batch: SinkBatch) -> WriteReport:
            report = WriteReport()
            for record in batch.records:
                for a in record.assessments():
                    print(record.trace_id, a["name"], a.get("value"))
                    report.written += 1
            return report

Delivery is at least once: after a crash or a rebalance a batch may be written again, so a sink
must make its writes idempotent (look for its own key before writing). A sink that cannot write
now (network error, 429, 5xx, a trace the backend does not know yet) raises `RetryLater`: the runtime
pauses the partition, waits `after_s`, and calls `write` again with the same batch, uncommitted; its
lag grows, nothing is lost. A write that can never succeed for one record (a trace still unknown
after its retry window) is *skipped* by the sink and counted in the report by reason, so one bad
record cannot hold a partition for ever. Any other exception ends the sink process (non-zero exit,
nothing committed past the failed batch): a bug must not be mistaken for a skip.

Settings. A sink's class may take a settings type with `from_mapping(section, where)` (validation,
`ConfigError` naming each bad key) and `redacted()`: the settings as `tracejudge sink <kind>
--check-config` prints them, the values the sink declares secret (header values, tokens) masked. The
runtime's own listing shows a sink's section masked (`OPAQUE`: it cannot know which of its values are
secrets), URLs without credentials or query values. A URL that carries credentials (`user:password@`)
is refused by the built-in sinks (`tracejudge.metrics.judges.secrets.url_problem`).

Session results. Besides one result per evaluated trace, the session stage (`tracejudge sessions`)
writes one *session result* per evaluated conversation (`"kind": "session"`, `schemas.session.
SessionResult`) to `sessions.results_topic`. The runtime reads that topic too (`sink.session_results_topic`,
default `sessions.results_topic`), but only for a sink whose class says `accepts_sessions = True`, so a
sink written before sessions never meets one: its records stay trace results. For a sink that does,
`record.session` is the decoded `SessionResult` (its `first_turn` / `last_turn` name the traces to hang
the session's verdicts on) and `record.result` the line as a dict (no `trace_id`: a session has several
traces); `record.assessments()` are the session judges' assessments. A session evaluated again (a turn
arrived after it closed) comes again with `evaluation` n+1; its verdicts replace the earlier ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from tracejudge.schemas.session import SessionResult

__all__ = ["RetryLater", "Sink", "SinkBatch", "SinkRecord", "WriteReport"]


@dataclass(frozen=True, slots=True)
class SinkRecord:
    """One result line from the results topic (or the session results topic), decoded, with where it
    came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    # The result line as `EvaluationResult.to_dict()` (or `SessionResult.to_dict()`) wrote it (README,
    # "Result schema"): a dict for either kind, so sinks written before sessions keep working.
    result: dict[str, Any]
    # The session result, for a `"kind": "session"` line (only sinks with `accepts_sessions` get
    # those); None for a trace result.
    session: SessionResult | None = None

    @property
    def kind(self) -> str:
        """"session" for a session result, "trace" for a trace result."""
        return "trace" if self.session is None else "session"

    @property
    def trace_id(self) -> str | None:
        """The evaluated trace's id; None for a session result (see `session.first_turn`/`last_turn`)."""
        return self.result.get("trace_id")

    def assessments(self) -> list[dict[str, Any]]:
        """The judge assessments of the result (skipped ones included: a sink decides)."""
        return list(self.result.get("assessments") or [])


@dataclass(slots=True)
class SinkBatch:
    """What one partition delivered since the last checkpoint, in offset order."""

    topic: str
    partition: int
    records: list[SinkRecord]


@dataclass(slots=True)
class WriteReport:
    """What `write` did with a batch: writes made, writes already there (a redelivery), and skips
    by reason (exported as `tracejudge_sink_skipped_total{sink, reason}`)."""

    written: int = 0
    already_written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] += n


class RetryLater(Exception):
    """The batch cannot be written now; call `write` again with it after `after_s` seconds."""

    def __init__(self, reason: str, after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after_s = after_s


class Sink(ABC):
    """A write-back target. Subclasses set `kind` (the `tracejudge sink <kind>` name and the `sink`
    label of its metrics) and implement `write`."""

    kind: ClassVar[str]
    # True when `write` handles session results (`SinkRecord.session`); the runtime then reads the
    # session results topic too. False (the default): the sink is offered trace results only.
    accepts_sessions: ClassVar[bool] = False

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Connect and check the configuration before the first poll; raise `ConfigError` (named
        key, what is wrong) for a configuration that cannot work."""

    @abstractmethod
    def write(self, batch: SinkBatch) -> WriteReport:
        """Write the batch's verdicts; return only when every record is written or deliberately
        skipped. Raise `RetryLater` to have the same batch offered again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release connections; called once at shutdown, after the last `write`."""
