"""Which release (version) of the app a record came from, as each convention states it.

Releases are a dimension: a judge's pass rate per version, the current release beside the previous
one (`ReleaseRegressed`). The version is read, never guessed; the rules per source, by precedence:

* the tag `stream.version_tag` names, wherever the source keeps tags (an MLflow tag or metadata key,
  an OTLP trace tag `mlflow.traceTag.<name>` or span attribute, a row's field or `tags` key);
* MLflow traces (3.x `trace_metadata`, 2.x `request_metadata`): `mlflow.modelId`, the LoggedModel
  MLflow's version tracking links each trace to (`mlflow.set_active_model`,
  `mlflow.genai.enable_git_model_versioning`, a served model's prediction context), else
  `mlflow.source.git.commit`, the commit of the app's checkout MLflow records on every trace when
  GitPython is installed (an empty string outside a repository: nothing stated);
* OpenTelemetry spans: `gen_ai.agent.version` on the root span, else on the first span (in start
  order) stating it; else the resource's `service.version` (the root span's resource, as the app is
  its `service.name`);
* inference-log and agent-evaluation rows: their `version` column (an inference log's legacy
  `request_metadata.model_version` after it), else their embedded trace's version.

A value is an identity as `session_identity.identity` reads one: a non-blank string, a number as
its text; a blank string, a bool, a list or an object states nothing (a row column of such a type is
rejected naming the column, as a `session_id` column is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from tracejudge.schemas.formats.session_identity import identity, spans_identity
from tracejudge.schemas.trace import Span

__all__ = ["AGENT_VERSION", "MLFLOW_GIT_COMMIT", "MLFLOW_MODEL_ID", "MLFLOW_VERSION_KEYS", "SERVICE_VERSION",
           "VERSION_COLUMN", "mlflow_version", "resource_version", "spans_version"]

MLFLOW_MODEL_ID: Final = "mlflow.modelId"
MLFLOW_GIT_COMMIT: Final = "mlflow.source.git.commit"
# By precedence: the LoggedModel (an explicit version), then the checkout's commit (environmental).
MLFLOW_VERSION_KEYS: Final = (MLFLOW_MODEL_ID, MLFLOW_GIT_COMMIT)
AGENT_VERSION: Final = "gen_ai.agent.version"
SERVICE_VERSION: Final = "service.version"
VERSION_COLUMN: Final = "version"


def mlflow_version(tags: Mapping[str, str], metadata: Mapping[str, str],
                   version_tag: str | None = None) -> str | None:
    """The version an MLflow trace's info states: the `version_tag` tag (else metadata key), else
    `mlflow.modelId`, else `mlflow.source.git.commit` (metadata, else a tag of the same name: MLflow
    2 apps could only set tags); None when none does. Both maps hold strings (the readers keep only
    those): a blank one states nothing. On every MLflow trace's path, hence no helper calls."""
    if version_tag:
        for value in (tags.get(version_tag), metadata.get(version_tag)):
            if value and not value.isspace():
                return value
    for key in MLFLOW_VERSION_KEYS:
        value = metadata.get(key)
        if value and not value.isspace():
            return value
        value = tags.get(key)
        if value and not value.isspace():
            return value
    return None


def resource_version(resource: Mapping[str, Any]) -> str | None:
    """An OTLP resource's `service.version`, None when unset or blank."""
    return identity(resource.get(SERVICE_VERSION))


def spans_version(spans: Sequence[Span], root: Span | None, tags: Mapping[str, Any],
                  resource: str | None, version_tag: str | None = None) -> str | None:
    """The version an assembled OTLP trace states: the `version_tag` trace tag or span attribute,
    else `gen_ai.agent.version` (root first), else its resource's `service.version`."""
    if version_tag:
        found = identity(tags.get(version_tag)) or spans_identity(spans, root, (version_tag,))
        if found is not None:
            return found
    return spans_identity(spans, root, (AGENT_VERSION,)) or resource
