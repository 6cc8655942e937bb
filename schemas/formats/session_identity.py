"""Which conversation a request belongs to and who made it, as each convention states it.

MLflow keeps them in trace metadata (`mlflow.trace.session`, `mlflow.trace.user`); OpenTelemetry
producers put them on spans, usually on every span of the trace (OpenInference and Traceloop propagate
them as context attributes; MLflow's OTLP export sets them on the root); agent-evaluation and
inference-log rows have a column. Read by every format reader (`mlflow_rules`, `otlp`, `agent_eval`,
`inference_log`) so an id means the same whichever wire it came on (see ../shared/notes/sessions.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from tracejudge.schemas.trace import Span

__all__ = ["MLFLOW_SESSION", "MLFLOW_USER", "SESSION_ATTRIBUTES", "SESSION_COLUMN", "USER_ATTRIBUTES",
           "USER_COLUMN", "identity", "spans_identity"]

MLFLOW_SESSION: Final = "mlflow.trace.session"
MLFLOW_USER: Final = "mlflow.trace.user"
# By priority on one span: OpenInference / MLflow OTLP export, GenAI semantic conventions, Traceloop
# association properties (the keys apps pass to `Traceloop.set_association_properties`).
SESSION_ATTRIBUTES: Final = ("session.id", "gen_ai.conversation.id",
                             "traceloop.association.properties.session_id")
USER_ATTRIBUTES: Final = ("user.id", "traceloop.association.properties.user_id")
# The column of an agent-evaluation or inference-log row.
SESSION_COLUMN: Final = "session_id"
USER_COLUMN: Final = "user_id"


def identity(value: Any) -> str | None:
    """A session or user id as a record holds it: a non-blank string as it is, an integer or a
    float as its decimal text (some producers count conversations), anything else (an empty or
    blank string, a bool, a list, an object) None: it identifies nothing and is never guessed at."""
    kind = type(value)
    if kind is str:
        return value if value and not value.isspace() else None
    if kind is int or (kind is float and math.isfinite(value)):
        return str(value)
    return None


def _span_identity(span: Span, keys: tuple[str, ...]) -> str | None:
    attrs = span.attributes
    for key in keys:
        if key in attrs:
            found = identity(attrs[key])
            if found is not None:
                return found
    return None


def spans_identity(spans: Sequence[Span], root: Span | None,
                   keys: tuple[str, ...] = SESSION_ATTRIBUTES) -> str | None:
    """The id the attributes `keys` (by priority on one span) state on the spans of one trace: the
    root's when it states one, else the first span's (in the order given: start order, so the app
    span below a non-GenAI root comes before the spans it made) that does; None when none does.
    Producers that propagate the id as a context attribute put it on every span, MLflow's OTLP
    export on the root only, an instrumentation below an uninstrumented root on its own spans."""
    if root is not None:
        found = _span_identity(root, keys)
        if found is not None:
            return found
    for span in spans:
        found = _span_identity(span, keys)
        if found is not None:
            return found
    return None
