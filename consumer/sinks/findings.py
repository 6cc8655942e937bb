"""Finding lines read back by the write-back stage: one findings-topic record -> the finding dict.

`tracejudge findings` (`consumer/stages/findings.py`) publishes each `Finding` (what is over-represented
among an (app, judge)'s failing verdicts in a window, `metrics/findings/window.py`) as one JSON line,
`"kind": "finding"`, to `findings.findings_topic`. A sink whose class says `accepts_findings = True`
(the MLflow and OTLP sinks) also reads that topic (`sink.findings_topic`) and writes each finding on its
example traces. This module checks a line before any sink sees it, so a sink may rely on the types
below; a line that fails is dead-lettered by the stage with the reason here (the `reason` label of
`tracejudge_sink_dead_letters_total`).
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from tracejudge.metrics.findings import FINDING_KIND
from tracejudge.schemas.results_line import INVALID_JSON, BadResult

__all__ = ["FINDING_FORMAT", "FINDING_KIND", "NOT_A_FINDING", "decode_finding"]

# Why a findings-topic record is not read (besides `invalid_json`).
NOT_A_FINDING = "not_a_finding"
# The format dead letters of finding lines carry in their `tracejudge-format` header.
FINDING_FORMAT = "tracejudge_finding"
# Example trace ids per finding a sink writes at most (the stage publishes `findings.examples`, 5 by
# default): a hand-made line cannot make a sink write thousands of tags.
MAX_EXAMPLES = 100


def decode_finding(value: bytes | None) -> dict[str, Any]:
    """The finding line as a dict, or `BadResult` naming the first field that is missing or of the wrong
    type: `kind` "finding"; `app`, `judge`, `dimension`, `value` non-empty strings (`app` may be
    empty); `label` a string or null; `failing`, `total`, `rank` integers; `lift` a finite number;
    `lift_interval` two numbers (or null); `example_trace_ids` a list of at most 100 non-empty strings;
    `window` an object whose `start` / `end` are numbers (Unix seconds) or null."""
    if value is None:
        raise BadResult(NOT_A_FINDING, "the record has no value (a tombstone)")
    try:
        line = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadResult(INVALID_JSON, f"not JSON: {exc}") from None
    if not isinstance(line, dict):
        raise BadResult(NOT_A_FINDING, f"a JSON {type(line).__name__}, not an object")
    if line.get("kind") != FINDING_KIND:
        raise BadResult(NOT_A_FINDING, f"kind must be {FINDING_KIND!r}, got {line.get('kind')!r:.80}")
    for key in ("judge", "dimension", "value"):
        if not isinstance(line.get(key), str) or not line[key]:
            raise _bad(key, "a non-empty string", line.get(key))
    if not isinstance(line.get("app"), str):
        raise _bad("app", "a string", line.get("app"))
    if line.get("label") is not None and not isinstance(line["label"], str):
        raise _bad("label", "a string or null", line["label"])
    for key in ("failing", "total", "rank"):
        if type(line.get(key)) is not int:
            raise _bad(key, "an integer", line.get(key))
    if not _finite(line.get("lift")):
        raise _bad("lift", "a finite number", line.get("lift"))
    interval = line.get("lift_interval")
    if not (isinstance(interval, list) and len(interval) == 2
            and all(x is None or _number(x) for x in interval)):
        raise _bad("lift_interval", "two numbers (null: unbounded)", interval)
    examples = line.get("example_trace_ids")
    if not (isinstance(examples, list) and all(isinstance(t, str) and t for t in examples)):
        raise _bad("example_trace_ids", "a list of trace ids (strings)", examples)
    if len(examples) > MAX_EXAMPLES:
        raise _bad("example_trace_ids", f"at most {MAX_EXAMPLES} trace ids", f"{len(examples)} of them")
    window = line.get("window")
    if not isinstance(window, dict) or not all(window.get(k) is None or _finite(window.get(k))
                                               for k in ("start", "end")):
        raise _bad("window", "an object with start and end (Unix seconds or null)", window)
    return line


def _bad(key: str, expected: str, got: Any) -> BadResult:
    return BadResult(NOT_A_FINDING, f"not a tracejudge finding: {key} must be {expected}, got {got!r:.80}")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return _number(v) and math.isfinite(v)
