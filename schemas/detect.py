"""PLACEHOLDER (owned by the foundation engineer, who replaces this file): detect a record's format and
normalise it into an `EvalRecord`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.record import EvalRecord


def normalise(payload: bytes | str | Mapping[str, Any], fmt: str | None = None, *,
              app_tag: str | None = None) -> EvalRecord:
    if isinstance(payload, (bytes, str)):
        try:
            payload = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise RecordError(errors.INVALID_JSON, str(exc)) from exc
    if not isinstance(payload, Mapping):
        raise RecordError(errors.UNKNOWN_FORMAT, "a record must be a JSON object")
    req = payload.get("request")
    return EvalRecord(request_id=payload.get("request_id"), request=req if isinstance(req, str) else None,
                      response=payload.get("response"), source_format="agent_eval")
