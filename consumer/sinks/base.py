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
now (network error, 429, 5xx) raises `RetryLater`: the runtime pauses the partition, waits `after_s`,
and calls `write` again with the same batch, uncommitted; its lag grows, nothing is lost.

A record that cannot be written *yet* while the rest of the batch can (its trace has not reached the
backend) is *deferred*: `report.defer(record, reason, after_s)`. The runtime counts the others done and
parks the deferred ones in a bounded set, their offsets uncommitted (a partition is committed only up
to its lowest parked record), and offers them again, in a batch of their own, after `after_s`; the
sink decides each wait (a growing back-off) and when to stop. The partition keeps flowing meanwhile.
When the parked set is full (`sink.max_parked_records`), the runtime holds the partition instead, as
for `RetryLater`. A write that can never succeed for one record (a trace still unknown after its
retry window) is *skipped* by the sink and counted in the report by reason (`report.give_up(reason)`
also counts the record as given up), so one bad record cannot hold a partition, or stay parked, for
ever. Any other exception ends the sink process (non-zero exit,
nothing committed past the failed batch): a bug must not be mistaken for a skip.

Settings. A sink declares its settings, the `sink.<kind>` section, as a `SinkSection`: a pydantic model
(the one configuration idiom, `tracejudge.metrics.sections`) named by the class attribute
`settings_class` or by the annotation of the constructor's first parameter:

    class PrintSettings(SinkSection):
        section_key = "sink.print"
        width: int = Field(default=80, gt=0)
        token: Annotated[str | None, SECRET] = None   # tracejudge.metrics.judges.secrets.SECRET

    class PrintSink(Sink):
        kind = "print"
        settings_class = PrintSettings

The runtime builds it with `from_mapping(section, "sink.<kind>")`: unknown keys and bad values are one
`ConfigError` naming each key (`sink.print.width: must be an integer, got 'wide'`); a stated null means
the default, except for a key whose type admits None (null turns it off). `resolve(env)` is the hook for
what the section reads from the environment at start-up (credentials), and `redacted()` the settings as
`tracejudge sink <kind> --check-config` prints them, the fields declared `SECRET` or `SecretStr` masked
and URLs shown without credentials or query values. Any other class with `from_mapping(section, where)`
and `redacted()` still works (the former way); a sink without either gets the section as a plain
mapping. The runtime's own listing shows a sink's section masked (`OPAQUE`: it cannot know which of its
values are secrets), URLs without credentials or query values. A URL that carries credentials
(`user:password@`) is refused by the built-in sinks (`tracejudge.metrics.judges.secrets.url_problem`).

Session results. Besides one result per evaluated trace, the session stage (`tracejudge sessions`)
writes one *session result* per evaluated conversation (`"kind": "session"`, `schemas.session.
SessionResult`) to `sessions.results_topic`. The runtime reads that topic too (`sink.session_results_topic`,
default `sessions.results_topic`), but only for a sink whose class says `accepts_sessions = True`, so a
sink written before sessions never meets one: its records stay trace results. For a sink that does,
`record.session` is the decoded `SessionResult` (its `first_turn` / `last_turn` name the traces to hang
the session's verdicts on) and `record.result` the line as a dict (no `trace_id`: a session has several
traces); `record.assessments()` are the session judges' assessments. A session evaluated again (a turn
arrived after it closed) comes again with `evaluation` n+1; its verdicts replace the earlier ones.

Findings. `tracejudge findings` publishes what the failing verdicts have in common (`"kind": "finding"`
lines, `metrics.findings.Finding`) to `findings.findings_topic`; a sink whose class says
`accepts_findings = True` reads that topic too (`sink.findings_topic`) and gets each line as a record
with `record.kind == "finding"` and `record.result` the finding dict (no `trace_id`: its
`example_trace_ids` name the traces). Such a record defers and gives up like any other.
"""

from __future__ import annotations

import os
import types
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    SecretStr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from tracejudge.metrics.judges.secrets import MASK, SECRET, redact_url
from tracejudge.metrics.sections import Section, problems, render_key
from tracejudge.schemas.errors import ConfigError

if TYPE_CHECKING:
    from tracejudge.schemas.session import SessionResult

__all__ = ["Deferral", "OptionalName", "RetryLater", "Sink", "SinkBatch", "SinkRecord", "SinkSection",
           "WriteReport", "key_from_environment"]


@dataclass(frozen=True, slots=True)
class SinkRecord:
    """One result line from the results topic (or the session results topic), decoded, with where it
    came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    # The result line as `EvaluationResult.to_dict()` (or `SessionResult.to_dict()`) wrote it
    # (docs/pages/concepts/record.md): a dict for either kind, so sinks written before sessions keep working.
    result: dict[str, Any]
    # The session result, for a `"kind": "session"` line (only sinks with `accepts_sessions` get
    # those); None for a trace result.
    session: SessionResult | None = None

    @property
    def kind(self) -> str:
        """"session" for a session result, "finding" for a finding line (only sinks with
        `accepts_findings` get those), "trace" for a trace result."""
        if self.session is not None:
            return "session"
        return "finding" if self.result.get("kind") == "finding" else "trace"

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


@dataclass(frozen=True, slots=True)
class Deferral:
    """Why a record was not written yet, and when to offer it again."""

    reason: str
    after_s: float


@dataclass(slots=True)
class WriteReport:
    """What `write` did with a batch: writes made, writes already there (a redelivery), skips by
    reason (exported as `tracejudge_sink_skipped_total{sink, reason}`), the records deferred (offered
    again later, see the module docstring) and the records given up on by reason."""

    written: int = 0
    already_written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    # Offset -> why and when: records not written yet; every other record of the batch is done.
    deferred: dict[int, Deferral] = field(default_factory=dict)
    # Records whose write the sink gave up on after retrying (`tracejudge_sink_given_up_total`).
    given_up: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] += n

    def defer(self, record: SinkRecord, reason: str, after_s: float) -> None:
        """Offer `record` again in `after_s` seconds (its offset stays uncommitted until then)."""
        self.deferred[record.offset] = Deferral(reason, max(0.0, float(after_s)))

    def give_up(self, reason: str, n: int = 1) -> None:
        """`n` records will never be written (their verdicts counted with `skip`)."""
        self.given_up[reason] += n


class SinkSection(Section):
    """A sink's settings, the `sink.<kind>` section (see the module docstring). Frozen: a sink shares
    them between threads. Numbers given as strings (environment overrides) are taken; numbers are
    taken for strings (an experiment id written as `7`)."""

    model_config = ConfigDict(frozen=True, coerce_numbers_to_str=True)

    # The section's key path, for errors when `from_mapping` is not told it.
    section_key: ClassVar[str] = "sink"

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # A stated null (`key:` with no value) means the default, unless the key's type admits None.
        if isinstance(data, Mapping):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or _admits_none(fields[k].annotation)}
        return data

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None, where: str | None = None, *,
                     env: Mapping[str, str] | None = None) -> Self:
        """Validate the section; a `ConfigError` names every bad key under `where` (`sink.<kind>`).
        `env` (default `os.environ`) is the validators' `env` context and `resolve`'s."""
        where = where or cls.section_key
        env = os.environ if env is None else env
        if section is not None and not isinstance(section, Mapping):
            raise ConfigError(where, f"must be a mapping, got {type(section).__name__}")
        try:
            settings = cls.model_validate(dict(section or {}), context={"env": env})
            return settings.resolve(env)
        except ValidationError as exc:
            raise ConfigError([(f"{where}.{render_key(loc)}", message)
                               for loc, message in problems(exc, cls)]) from None
        except ConfigError as exc:  # from `resolve`, its keys relative to the section
            raise ConfigError([(f"{where}.{key}" if key else where, message)
                               for key, message in exc.problems]) from None

    @classmethod
    def keys_help(cls) -> list[str]:
        """The section's keys as `--help` lists them: `name (default value)`, the value as YAML writes it;
        a key without a plain default (required, or built at start-up) by its name alone."""
        out = []
        for name, info in cls.model_fields.items():
            shown = None if info.default_factory is not None or info.is_required() else info.default
            if isinstance(shown, bool):
                shown = "true" if shown else "false"
            out.append(name if shown in (None, "") else f"{name} (default {shown})")
        return out

    def resolve(self, env: Mapping[str, str]) -> Self:
        """What the section takes from the environment, read once at start-up so a problem (an
        unreadable token file) is a `ConfigError` before anything runs; raise it with keys relative
        to the section. The default takes nothing."""
        return self

    def redacted(self) -> dict[str, Any]:
        """The settings as `--check-config` prints them: fields declared `SECRET` or `SecretStr` masked
        (each value of a mapping)."""
        out: dict[str, Any] = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if SECRET in info.metadata or isinstance(value, SecretStr):
                value = dict.fromkeys(sorted(value), MASK) if isinstance(value, Mapping) else \
                    (None if value is None else MASK)
            elif isinstance(value, str) and "://" in value:
                value = redact_url(value)
            out[name] = value
        return out


def _admits_none(annotation: Any) -> bool:
    return annotation is None or (get_origin(annotation) in (Union, types.UnionType)
                                  and type(None) in get_args(annotation))


def _empty_is_none(v: Any) -> Any:
    return None if v == "" else v


def _not_blank(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError("must not be empty")
    return v


# An optional setting naming a variable, a file or an id: a stated empty value (an environment override
# `TRACEJUDGE_SINK__MLFLOW__TOKEN_ENV=`) means none, a blank one is an error (`must not be empty`).
OptionalName = Annotated[str | None, BeforeValidator(_empty_is_none), AfterValidator(_not_blank)]


def key_from_environment(data: Any, info: ValidationInfo, key: str, variable: str) -> Any:
    """A section's raw mapping with `key`, when not stated, taken from the environment `variable` (a
    backend's own, such as MLFLOW_TRACKING_URI), read from the validators' `env` context, else os.environ.
    For a `model_validator(mode="before")`."""
    env = (info.context or {}).get("env", os.environ)
    stated = env.get(variable)
    if isinstance(data, Mapping) and data.get(key) is None and stated:
        return {**data, key: stated}
    return data


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
    # True when `write` handles finding lines (`record.kind == "finding"`, `record.result` the line as
    # `consumer/sinks/findings.decode_finding` checked it); the runtime then reads the findings topic too.
    accepts_findings: ClassVar[bool] = False

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Connect and check the configuration before the first poll; raise `ConfigError` (named
        key, what is wrong) for a configuration that cannot work."""

    @abstractmethod
    def write(self, batch: SinkBatch) -> WriteReport:
        """Write the batch's verdicts; return only when every record is written, deliberately
        skipped, or deferred (`report.defer`: offered again later on its own). Raise `RetryLater` to
        have the same batch offered again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release connections; called once at shutdown, after the last `write`."""
