"""Every exception a user of tracejudge catches, in one place, and why a record could not be read.

What a user catches, and when:

- `RecordError`: a record that cannot be decoded or normalised (`reason` is a bounded token, the
  `reason` label of `tracejudge_dead_letters_total`; `detail` names the field). Raised by every parser.
- `ConfigError`: an invalid configuration, before anything connects or any record is read. `problems`
  is a list of (key path, message), all reported together; `key` / `detail` are the first one's. Raised
  where the problem is found: a section's validation, a plug-in spec (`package.module:attr`) that does
  not load, a file a key names that cannot be read.
- `JudgeConfigError`: a `ConfigError` of the `judges:` section (`key` starts with `judges.`).
- `MetricLoadError`: a `ConfigError` of a custom metric function (`metrics.custom[name].function`).
- `LabelsError`: a source of human labels that cannot be read at all (`tracejudge calibrate`).
- `InputError` / `OutputError`: `tracejudge eval` cannot read an input (exit status 2) or write an
  output (exit status 3).
- `BackfillError`: `tracejudge backfill` cannot start (bad arguments, no judges, unknown topic).
- `StartupError`: a stage could not start (broker unreachable, port taken).
- `BadResult`: a results-topic line that is not a tracejudge result this code can read
  (`tracejudge.schemas.results_line`, re-exported here).
- `RetryLater`: raised by a write-back sink, not caught by users (`tracejudge.consumer.sinks.base`).

The `RecordError` helpers below (`not_json`, `describe_value`, `exception_text`) word a bad record's
message without quoting its content. The face (`tracejudge`) exports the ones a library user meets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Final

from tracejudge.schemas.results_line import BadResult

__all__ = ["REASONS", "BackfillError", "BadResult", "ConfigError", "InputError", "JudgeConfigError",
           "LabelsError", "MetricLoadError", "OutputError", "RecordError", "StartupError", "describe_value",
           "exception_text", "not_json", "unquoted"]

# The closed set of reasons. Adding one is fine; never put free text in `reason`.
INVALID_JSON: Final = "invalid_json"
INVALID_PROTOBUF: Final = "invalid_protobuf"
UNKNOWN_FORMAT: Final = "unknown_format"
INVALID_RECORD: Final = "invalid_record"
TOO_LARGE: Final = "too_large"
NOT_UTF8: Final = "not_utf8"
# A logs record with a `gen_ai.evaluation.result` event that cannot be read (its other events are read).
INVALID_EVALUATION_EVENT: Final = "invalid_evaluation_event"

REASONS: Final = frozenset({INVALID_JSON, INVALID_PROTOBUF, UNKNOWN_FORMAT, INVALID_RECORD, TOO_LARGE,
                            NOT_UTF8, INVALID_EVALUATION_EVENT})


class RecordError(ValueError):
    """A record that cannot be decoded or normalised.

    `field` is a dotted path into the record ("data.spans[2].start_time_unix_nano") when one field is
    to blame; `detail` says what was wrong with it.
    """

    def __init__(self, reason: str, detail: str, field: str | None = None):
        if reason not in REASONS:
            raise ValueError(f"unknown RecordError reason {reason!r}")
        self.reason = reason
        self.detail = detail
        self.field = field
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.field}: {self.detail}" if self.field else self.detail


class ConfigError(ValueError):
    """An invalid configuration: `problems` is a list of (key path, message), all reported together.

    `ConfigError("kafka.group_id", "must not be empty")` is one problem; `ConfigError([(key, message),
    ...])` several. Raised inside a pydantic validator, its key is relative to the model being
    validated (the loader prefixes the model's own path); it is a `ValueError` so pydantic carries it.
    """

    def __init__(self, problems: Sequence[tuple[str, str]] | str, detail: str | None = None):
        if isinstance(problems, str):
            problems = [(problems, detail or "")]
        self.problems = list(problems)
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in self.problems))

    @property
    def key(self) -> str:
        """The key path of the first problem."""
        return self.problems[0][0] if self.problems else ""

    @property
    def detail(self) -> str:
        """What is wrong with the first problem's key."""
        return self.problems[0][1] if self.problems else ""

    def report(self) -> str:
        lines = [f"  {key}: {msg}" if key else f"  {msg}" for key, msg in self.problems]
        return "invalid configuration:\n" + "\n".join(lines)


class JudgeConfigError(ConfigError):
    """A configuration error of the `judges:` section, reported before anything runs."""

    def __init__(self, key: str, detail: str):
        super().__init__(key, detail)


class MetricLoadError(ConfigError):
    """A custom metric's function could not be imported; raised at start-up, before any record."""


class LabelsError(Exception):
    """A labels source that cannot be read at all (a missing file, an unreachable server)."""


class InputError(Exception):
    """An input that cannot be read at all, or an invalid option: exit status 2."""


class OutputError(Exception):
    """An output that cannot be written (disk full, permission denied, a closed pipe): exit status 3."""

    def __init__(self, name: str, exc: OSError) -> None:
        self.name = name
        self.broken_pipe = isinstance(exc, BrokenPipeError)
        super().__init__(f"cannot write {name}: {exc.strerror or exc}")


class BackfillError(Exception):
    """Cannot start: bad arguments, no judges, no results topic, unknown topic."""


class StartupError(RuntimeError):
    """The runtime could not start (broker unreachable, port taken); the message says what to fix."""


def not_json(exc: ValueError) -> str:
    """The detail of a payload that does not parse as JSON, from an `orjson.JSONDecodeError` (or the
    standard library's, which has the same fields): "not JSON: unexpected 'x' at line 1, column 7".

    The parser's own wording misleads on the commonest bad lines: `nope` or a CSV row `nan,1` is an
    "invalid literal, expected 'null'" to it. The message names the character found instead (one
    character, never the text around it: a payload may hold personal data) and where."""
    msg = str(getattr(exc, "msg", exc))
    lineno, colno = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    where = f" at line {lineno}, column {colno}" if lineno and colno else ""
    if msg.startswith("Input is a zero-length"):
        return "not JSON: it is empty (zero length)"
    if "byte order mark" in msg:
        return f"not JSON: it starts with a UTF-8 byte-order mark (EF BB BF){where}"
    if msg.startswith(("invalid literal", "unexpected character", "Expecting value")):
        found = _found(getattr(exc, "doc", None), getattr(exc, "pos", None))
        expected = msg.partition(", ")[2]
        # "expected 'null'" only says which literal the first letter could have begun.
        tail = f", {expected}" if expected and not msg.startswith("invalid literal") else ""
        return f"not JSON: unexpected {found}{tail}{where}"
    if msg == "unexpected content after document":
        found = _found(getattr(exc, "doc", None), getattr(exc, "pos", None))
        return f"not JSON: unexpected {found} after a complete JSON value{where}"
    if msg == "unexpected end of data":
        return f"not JSON: the text ends before the JSON value is complete{where}"
    return f"not JSON: {msg}{where}"


def _found(doc: object, pos: object) -> str:
    if not isinstance(doc, str) or not isinstance(pos, int) or not 0 <= pos < len(doc):
        return "text"
    ch = doc[pos]
    return repr(ch) if ch.isprintable() and not ch.isspace() else f"character U+{ord(ch):04X}"


# Numbers up to this many characters are quoted in a message (a count, a flag, a small fraction); a
# longer one may be an account, card or phone number and is described by its digit count instead.
_SHOWN_NUMBER_CHARS = 4


def describe_value(value: object) -> str:
    """How a message names a record's bad value: its JSON type and size, never its content.

    A reject message, a dead-letter header and a log line are read by people who may not see the
    record itself, and a wrongly typed field holds whatever the producer put there: an e-mail
    address, a card number, a name (which no detector recognises). So a string is "a string of 23
    characters", a list "a list of 2 items", an object "an object of 3 keys"; null, true, false,
    short numbers (`1.5`, `-1`) and non-finite ones are written as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        name = "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
        return f"{name} (a non-finite number)"
    if isinstance(value, int | float):
        text = repr(value)
        if len(text) <= _SHOWN_NUMBER_CHARS:
            return text
        digits = sum(c.isdigit() for c in text)
        return f"{'an integer' if isinstance(value, int) else 'a number'} of {digits} digits"
    if isinstance(value, str):
        return f"a string of {_count(len(value), 'character')}" if value else "an empty string"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{_count(len(value), 'byte')} of binary data"
    if isinstance(value, Mapping):
        return f"an object of {_count(len(value), 'key')}" if value else "an empty object"
    if isinstance(value, list | tuple | set | frozenset):
        return f"a list of {_count(len(value), 'item')}" if value else "an empty list"
    return f"a value of type {type(value).__name__}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# A quoted part of an exception's message: where Python's own messages put the input they choke on
# ("invalid literal for int() with base 10: 'x'", "Invalid isoformat string: 'x'", a KeyError's key).
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")


def unquoted(text: str) -> str:
    """`text` with each quoted part described (`describe_value`) instead of quoted."""
    return _QUOTED.sub(lambda m: f"<{describe_value(m.group()[1:-1])}>", text) if "'" in text or '"' in text \
        else text


def exception_text(exc: BaseException, limit: int = 200) -> str:
    """`Type: message` of an exception raised while reading a record (a parser bug, a library's own
    error), for a reject message or a dead-letter header: each quoted part of the message is
    described (`unquoted`) instead of quoted, since it is usually the record's own text."""
    text = unquoted(str(exc))
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
