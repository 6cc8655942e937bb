"""What the sections of the configuration share: the environment's naming, the input formats, the runtime's
`Section` base and the validators of topic names and group ids (`tracejudge.consumer.config`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict

from tracejudge.metrics.sections import Section as BaseSection

__all__ = ["ENV_NESTING", "ENV_PREFIX", "FORMATS", "TOPIC_NAME", "Section", "group_id_value",
           "optional_topic", "split_list"]

ENV_PREFIX = "TRACEJUDGE_"
ENV_NESTING = "__"
# otlp_logs_*: the Collector's logs topic, whose GenAI content events join their spans in assembly.
FORMATS = ("auto", "agent_eval", "mlflow", "inference_log", "otlp_proto", "otlp_json", "otlp_logs_proto",
           "otlp_logs_json")
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


class Section(BaseSection):
    """A section of the runtime's configuration (`tracejudge.metrics.sections.Section`): its defaults
    are validated too."""

    model_config = ConfigDict(validate_default=True)


def split_list(v: Any) -> Any:
    """A comma-separated value from the environment (`TRACEJUDGE_STREAM__TOPICS=a,b`) as a list."""
    if isinstance(v, str):
        return [item.strip() for item in v.split(",") if item.strip()]
    return v


def optional_topic(v: str | None) -> str | None:
    """An optional topic key (results, dead letters, sessions, labels): a valid Kafka topic name;
    "" means unset."""
    if v is not None and (not TOPIC_NAME.match(v) or v in (".", "..")):
        raise ValueError(f"{v!r} is not a valid Kafka topic name")
    return v or None


def group_id_value(v: str | None) -> str | None:
    """An optional consumer group id: unset, or not blank."""
    if v is not None and not v.strip():
        raise ValueError("must not be empty")
    return v
