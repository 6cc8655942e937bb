"""What a result is made of, as findings compare it: its values per dimension, and its verdicts.

The dimensions (`DIMENSIONS`), each a set of values per result (a result has a value or not):

- `doc_uri`: the `doc_uri` of each retrieved document (`record.retrieved_context`), a URL without its
  credentials and query values;
- `tool`: each tool the trajectory called (`record.trajectory`);
- `tool_error`: each tool whose call failed (`ToolCall.error`, schema 6: the tool span's exception
  event or ERROR status, an agent-eval row's `error`/`failed`). A failing tool is `tool_error=NAME`
  and, with its successful calls, `tool=NAME`: while every call of it fails the two have the same
  verdicts and the more specific `tool_error` is named (`window.analyse` prefers it on a tie);
- `version`: the app's release (`record.version`, schema 6);
- `model`: each model the trace's calls used (`record.model_usage`);
- `signal`: each computed metric `signal_<name>` equal to 1.0 (the cheap per-trace signals, such as
  `signal_tool_retry_loop`), by `<name>`;
- `request_cluster`: the cluster of the request's text (`clusters.RequestClusterer`).

Verdicts (`verdicts`): one per live judge that passed or failed (`schemas.result.assessment_status`);
shadow judges, errors, skips and verdicts without pass or fail are not counted.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from tracejudge.metrics.findings.clusters import RequestClusterer
from tracejudge.metrics.judges.secrets import redact_url
from tracejudge.schemas.result import FAILED, PASSED, EvaluationResult, assessment_status

__all__ = ["DIMENSIONS", "SIGNAL_PREFIX", "VALUE_MAX_CHARS", "dimension_values", "verdicts"]

DIMENSIONS = ("doc_uri", "tool", "tool_error", "version", "model", "signal", "request_cluster")
SIGNAL_PREFIX = "signal_"
# A value longer than this is cut (a doc_uri with a long query string): memory per value is bounded.
VALUE_MAX_CHARS = 300
# A fragment kept in a doc_uri value: a short anchor, nothing that could be a token or a parameter.
_ANCHOR = re.compile(r"[A-Za-z0-9_-]{1,24}")
# Values of one dimension taken from one result; the rest of a huge trajectory is not counted.
VALUES_PER_RESULT = 64


def verdicts(result: EvaluationResult) -> list[tuple[str, bool]]:
    """(judge, passed) of each live judge that passed or failed the result."""
    out = []
    for a in result.assessments:
        if a.shadow_of is not None:
            continue
        status = assessment_status(a)
        if status in (PASSED, FAILED):
            out.append((a.name, status == PASSED))
    return out


def _add(values: dict[str, None], value: object) -> None:
    if isinstance(value, str) and value and len(values) < VALUES_PER_RESULT:
        values[value[:VALUE_MAX_CHARS]] = None


def _shown_uri(uri: str | None) -> str | None:
    """A doc_uri as a value: without the credentials or query values a URL may carry (a signed link's
    `?sig=`), which would otherwise reach metric labels and findings (`secrets.redact_url`). A plain
    anchor (`#p1`, `#section-2`: a chunk of a page) stays, so the chunks of one page stay apart; any
    other fragment (`#access_token=...`, a long token) is masked with the rest."""
    if not uri or "://" not in uri or not ("@" in uri or "?" in uri or "#" in uri):
        return uri
    head, _, anchor = uri.partition("#")
    if anchor and _ANCHOR.fullmatch(anchor):
        return (redact_url(head) if "@" in head or "?" in head else head) + "#" + anchor
    return redact_url(uri)


def dimension_values(result: EvaluationResult, enabled: Collection[str],
                     clusterer: RequestClusterer | None = None) -> dict[str, tuple[str, ...]]:
    """The result's distinct values of each `enabled` dimension that has any."""
    rec = result.record
    out: dict[str, tuple[str, ...]] = {}
    found: dict[str, None] = {}
    if "doc_uri" in enabled and rec.retrieved_context:
        for doc in rec.retrieved_context:
            _add(found, _shown_uri(doc.doc_uri))
        if found:
            out["doc_uri"], found = tuple(found), {}
    if rec.trajectory and ("tool" in enabled or "tool_error" in enabled):
        failed: dict[str, None] = {}
        for call in rec.trajectory:
            _add(found, call.tool_name)
            if call.error is not None:
                _add(failed, call.tool_name)
        if found and "tool" in enabled:
            out["tool"] = tuple(found)
        if failed and "tool_error" in enabled:
            out["tool_error"] = tuple(failed)
        found = {}
    if "version" in enabled and rec.version:
        out["version"] = (rec.version[:VALUE_MAX_CHARS],)
    if "model" in enabled and rec.model_usage:
        for model in rec.model_usage:
            _add(found, model)
        if found:
            out["model"], found = tuple(found), {}
    if "signal" in enabled:
        for name, value in result.metrics.items():
            if value == 1.0 and name.startswith(SIGNAL_PREFIX) and len(name) > len(SIGNAL_PREFIX):
                _add(found, name[len(SIGNAL_PREFIX):])
        if found:
            out["signal"] = tuple(found)
    if "request_cluster" in enabled and clusterer is not None:
        cluster = clusterer.assign(rec.request)
        if cluster is not None:
            out["request_cluster"] = (cluster,)
    return out
