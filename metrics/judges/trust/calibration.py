"""The calibration file: what `tracejudge calibrate` measured of each judge, keyed by the judge's
fingerprint, so a judge whose prompt, model, endpoint or parsing changed is never credited with an
old judge's agreement.

    {"schema": 1,
     "judges": {"groundedness": {"3f9a0c12b7de": {
         "endpoint": "default", "model": "gpt-4.1-mini", "n": 212, "tp": 150, "fn": 12, "fp": 9, "tn": 41,
         "tpr": 0.926, "tpr_interval": [0.875, 0.957], "tnr": 0.82, "tnr_interval": [0.692, 0.902],
         "balanced_accuracy": 0.873, "kappa": 0.73, "kappa_interval": [0.62, 0.84],
         "calibrated": true, "minimum_labels": 30, "created_at": "2026-11-25T14:40:00Z"}}}}

The version key is `JudgeIdentity.version`. Several versions of one judge may be kept (saving merges
into an existing file): the stream looks up the version it runs. `calibrated` is false when either
class had fewer than `MINIMUM_LABELS` labels; such an entry is kept for the record but never used to
correct a pass rate.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracejudge.metrics.judges.trust.agreement import MINIMUM_LABELS, Agreement, Interval, corrected_rate
from tracejudge.schemas.result import JudgeIdentity

__all__ = ["CALIBRATION_SCHEMA", "Calibration", "CalibrationError", "CalibrationFile", "load", "save"]

CALIBRATION_SCHEMA = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be read (its path and what is wrong are in the message)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """One judge version's measured agreement."""

    judge: str
    version: str
    endpoint: str | None
    model: str | None
    n: int
    tp: int
    fn: int
    fp: int
    tn: int
    tpr: float | None
    tnr: float | None
    tpr_interval: Interval | None
    tnr_interval: Interval | None
    balanced_accuracy: float | None
    kappa: float | None
    kappa_interval: Interval | None
    calibrated: bool
    created_at: str
    minimum_labels: int = MINIMUM_LABELS

    @classmethod
    def measured(cls, judge: str, identity: JudgeIdentity, agreement: Agreement,
                 now: dt.datetime | None = None) -> Calibration:
        c = agreement.confusion
        when = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(judge, identity.version, identity.endpoint, identity.model, c.n, c.tp, c.fn, c.fp, c.tn,
                   agreement.tpr, agreement.tnr, agreement.tpr_interval, agreement.tnr_interval,
                   agreement.balanced_accuracy, agreement.kappa, agreement.kappa_interval,
                   agreement.enough_labels, when)

    def corrected(self, observed: float) -> float | None:
        """The pass rate corrected for this judge's error (Rogan–Gladen), None unless calibrated."""
        if not self.calibrated or self.tpr is None or self.tnr is None:
            return None
        return corrected_rate(observed, self.tpr, self.tnr)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            if name in ("judge", "version"):
                continue
            value = getattr(self, name)
            out[name] = [value.low, value.high] if isinstance(value, Interval) else value
        return out

    @classmethod
    def from_json(cls, judge: str, version: str, obj: Any) -> Calibration:
        if not isinstance(obj, dict):
            raise TypeError("an entry must be an object")

        def interval(key: str) -> Interval | None:
            v = obj.get(key)
            return None if v is None else Interval(float(v[0]), float(v[1]))

        def number(key: str) -> float | None:
            v = obj.get(key)
            return None if v is None else float(v)

        return cls(
            judge, version, obj.get("endpoint"), obj.get("model"), int(obj["n"]), int(obj["tp"]),
            int(obj["fn"]), int(obj["fp"]), int(obj["tn"]), number("tpr"), number("tnr"),
            interval("tpr_interval"), interval("tnr_interval"), number("balanced_accuracy"),
            number("kappa"), interval("kappa_interval"), bool(obj["calibrated"]), str(obj["created_at"]),
            int(obj.get("minimum_labels", MINIMUM_LABELS)),
        )


@dataclass
class CalibrationFile:
    """Every calibration in one file: judge name -> version -> `Calibration`."""

    judges: dict[str, dict[str, Calibration]] = field(default_factory=dict)

    def put(self, calibration: Calibration) -> None:
        self.judges.setdefault(calibration.judge, {})[calibration.version] = calibration

    def get(self, judge: str, identity: JudgeIdentity) -> Calibration | None:
        """The calibration of exactly this judge version, or None."""
        return self.judges.get(judge, {}).get(identity.version)

    def stale(self, judge: str, identity: JudgeIdentity) -> bool:
        """True when `judge` was calibrated, but never in this version: its prompt, model, endpoint
        or parsing changed since, and the measured agreement no longer describes it."""
        versions = self.judges.get(judge)
        return bool(versions) and identity.version not in versions

    def to_json(self) -> dict[str, Any]:
        return {"schema": CALIBRATION_SCHEMA,
                "judges": {name: {v: c.to_json() for v, c in sorted(versions.items())}
                           for name, versions in sorted(self.judges.items())}}


def load(path: str | os.PathLike[str]) -> CalibrationFile:
    """Read a calibration file; raises `CalibrationError` naming the file and the bad entry."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CalibrationError(f"{path}: not JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("judges"), dict):
        raise CalibrationError(f"{path}: expected an object with a 'judges' object")
    if obj.get("schema", CALIBRATION_SCHEMA) > CALIBRATION_SCHEMA:
        raise CalibrationError(f"{path}: schema {obj['schema']} is newer than this tracejudge reads "
                               f"({CALIBRATION_SCHEMA})")
    out = CalibrationFile()
    for judge, versions in obj["judges"].items():
        if not isinstance(versions, dict):
            raise CalibrationError(f"{path}: judges.{judge}: expected an object of versions")
        for version, entry in versions.items():
            try:
                out.put(Calibration.from_json(judge, version, entry))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise CalibrationError(f"{path}: judges.{judge}.{version}: malformed entry "
                                       f"({exc!r})") from None
    return out


def save(path: str | os.PathLike[str], calibrations: CalibrationFile) -> None:
    """Write `calibrations`, merged into what `path` already holds (other judges and versions are
    kept; the same judge version is replaced). Written to a temporary file and renamed, so a reader
    never sees half a file."""
    target = Path(path)
    merged = load(target) if target.exists() else CalibrationFile()
    for versions in calibrations.judges.values():
        for c in versions.values():
            merged.put(c)
    # A temporary file of its own beside the target (two writers never share one), removed if the
    # write fails, so a failed save leaves the previous file and no stray temporary.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(merged.to_json(), indent=1) + "\n")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
