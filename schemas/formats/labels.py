"""Human labels: people's verdicts per (trace or request id, judge), from wherever people give them.

Sources:
- JSON Lines files, one label per line: `{"trace_id"|"request_id": "...", "judge": "groundedness",
  "label": "pass"|"fail"|true|false|0.8}` (the calibration kit's records carry these keys too, so a kit
  file is its own labels file);
- MLflow `HUMAN` feedback: a record's `human_labels` (read from the trace's `info.assessments`), or an
  MLflow tracking server's traces of an experiment, through the `mlflow` client.

What a label means: "pass"/"yes"/true is a human pass, "fail"/"no"/false a human fail; a number is a
score in [0, 1] (1 = good) and passes at >= 0.5. Anything else is malformed. A malformed label, or one
for a judge that is not configured, is reported with its line (or trace id), counted in
`LabelSet.problems`, and skipped: never fatal. When several sources label the same (id, judge), the
last one read wins and the conflict is counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import InputError, LabelsError
from tracejudge.schemas.formats.input_files import Oversized, diagnose_unreadable, read_lines
from tracejudge.schemas.formats.mlflow_rules import human_feedback
from tracejudge.schemas.record import EvalRecord, HumanLabel

__all__ = ["LabelSet", "LabelsError", "label_passes", "normalise_id"]

_PASS = {"pass", "passed", "yes", "true", "good", "correct"}
_FAIL = {"fail", "failed", "no", "false", "bad", "incorrect"}
# Reported problems kept for printing; beyond this only the counts grow.
MAX_REPORTED = 50
# The longest labels line read (a calibration kit's line is a whole record): the stream's default.
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024


def label_passes(value: Any) -> bool | None:
    """True/False for a human pass/fail, None when `value` is not a label."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value >= 0.5 if 0.0 <= value <= 1.0 else None
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _PASS:
            return True
        if v in _FAIL:
            return False
    return None


def normalise_id(value: str) -> str:
    """Trace ids as records carry them: MLflow's "tr-<hex>" and any hex id lowercased without the
    prefix; other ids (request ids) unchanged."""
    if value.startswith("tr-"):
        return value[3:].lower()
    return value


@dataclass
class LabelSet:
    """Labels by (id, judge). `judges`: the configured judge names (None: accept any judge)."""

    judges: frozenset[str] | None = None
    labels: dict[tuple[str, str], bool] = field(default_factory=dict)
    problems: Counter[str] = field(default_factory=Counter)
    reported: list[str] = field(default_factory=list)

    def _problem(self, kind: str, where: str, detail: str) -> None:
        self.problems[kind] += 1
        if len(self.reported) < MAX_REPORTED:
            self.reported.append(f"{where}: {detail}")

    def add(self, ident: str, judge: str, value: Any, where: str) -> bool:
        """Add one label; False (and a counted problem) when it is malformed or its judge unknown."""
        passed = label_passes(value)
        if passed is None:
            self._problem("malformed", where, f"label {value!r} for {judge!r} is not pass/fail/true/false "
                                              "or a score in [0, 1]")
            return False
        if self.judges is not None and judge not in self.judges:
            self._problem("unknown_judge", where, f"judge {judge!r} is not configured "
                                                  f"({', '.join(sorted(self.judges)) or 'none'})")
            return False
        key = (normalise_id(ident), judge)
        if key in self.labels and self.labels[key] != passed:
            self._problem("conflicting", where, f"{judge!r} label for {ident!r} differs from an earlier one "
                                                "(the last one wins)")
        self.labels[key] = passed
        return True

    # ------------------------------------------------------------------------------ sources
    def read_jsonl(self, stream: IO[bytes], name: str, max_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
        """Read a labels file (opened with `input_files.open_input`: .gz, byte-order mark); returns how many
        labels it added. A file none of whose lines is a label at all (a CSV file, pretty-printed
        JSON, a records file without label keys) is the wrong file, not a file of bad labels:
        `LabelsError` names the likely cause. So is a file that cannot be read to its end."""
        added = labelled = 0
        first: tuple[bytes, str, str] | None = None
        try:
            for lineno, line in read_lines(stream, name, max_bytes):
                where = f"{name}:{lineno}"
                problem = self._label_line(line, where)
                if isinstance(problem, tuple):
                    first = first or (line.head if isinstance(line, Oversized) else line, *problem)
                    self._problem("malformed", where, problem[1])
                    continue
                labelled += 1
                added += problem
        except InputError as exc:
            raise LabelsError(str(exc)) from None
        if first is not None and labelled == 0:
            cause = diagnose_unreadable(name, *first)
            raise LabelsError(f"{name}: no line could be read as a label: {cause}")
        return added

    def _label_line(self, line: bytes | Oversized, where: str) -> int | tuple[str, str]:
        """1 or 0 (added or not, as `add`) for a line shaped as a label, else (reason, detail)."""
        if isinstance(line, Oversized):
            return errors.TOO_LARGE, f"{line.size} bytes, more than a label line may have"
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            return errors.INVALID_JSON, errors.not_json(exc)
        if not isinstance(obj, dict):
            got = ", got an array" if isinstance(obj, list) else ""
            return errors.INVALID_RECORD, f"expected an object{got}"
        ident = obj.get("trace_id") or obj.get("request_id")
        judge = obj.get("judge")
        if not isinstance(ident, str) or not isinstance(judge, str) or "label" not in obj:
            return errors.INVALID_RECORD, 'expected "trace_id" or "request_id", "judge" and "label"'
        return int(self.add(ident, judge, obj["label"], where))

    def read_records(self, records: Iterable[EvalRecord]) -> int:
        """The human labels the records carry (MLflow HUMAN feedback on their traces)."""
        added = 0
        for record in records:
            ident = record.trace_id or record.request_id
            if not record.human_labels or ident is None:
                continue
            for label in record.human_labels:
                added += self.add(ident, label.name, label.value, f"trace {ident}")
        return added

    def read_mlflow(self, tracking_uri: str, experiment_ids: list[str], page_size: int = 200) -> int:
        """HUMAN feedback on the traces of `experiment_ids` on an MLflow tracking server, read with the
        `mlflow` client (install mlflow-skinny). Assessments only: the spans are not fetched."""
        added = 0
        for trace_id, labels in mlflow_human_feedback(tracking_uri, experiment_ids, page_size):
            for label in labels:
                added += self.add(trace_id, label.name, label.value, f"mlflow trace {trace_id}")
        return added

    # ------------------------------------------------------------------------------ lookup
    def of(self, record: EvalRecord, judge: str) -> bool | None:
        """The human verdict on `record` for `judge`, by trace id then request id."""
        for ident in (record.trace_id, record.request_id):
            if ident is not None:
                found = self.labels.get((normalise_id(ident), judge))
                if found is not None:
                    return found
        return None

    def __len__(self) -> int:
        return len(self.labels)


def mlflow_human_feedback(tracking_uri: str, experiment_ids: list[str],
                          page_size: int = 200) -> Iterator[tuple[str, list[HumanLabel]]]:
    """(trace id, its HUMAN feedback) for every trace of the experiments that has any."""
    try:
        from mlflow import MlflowClient
    except ImportError as exc:
        raise LabelsError("--labels-from-mlflow needs the mlflow client: pip install mlflow-skinny") from exc
    client = MlflowClient(tracking_uri=tracking_uri)
    token: str | None = None
    while True:
        try:
            page = client.search_traces(locations=experiment_ids, max_results=page_size, page_token=token,
                                        include_spans=False)
        except Exception as exc:  # the client raises MlflowException, requests' errors, …
            raise LabelsError(f"cannot read traces from {tracking_uri}: {exc}") from exc
        for trace in page:
            assessments = [a.to_dictionary() for a in (trace.info.assessments or [])]
            labels = human_feedback(assessments)
            if labels:
                yield trace.info.trace_id, labels
        token = page.token
        if not token:
            return
