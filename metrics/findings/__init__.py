"""What the failures have in common: per app and judge over a window, which retrieved documents,
tools, tool errors, versions, models, signals and request clusters are over-represented among the
failing verdicts (`FindingsWindow.analyse` -> `Finding`s). Pure: no Kafka, no Prometheus; the stream
stage is `consumer/stages/findings.py`, the offline command `consumer/commands/findings.py`."""

from tracejudge.metrics.findings.clusters import ClusterOptions, RequestClusterer
from tracejudge.metrics.findings.dimensions import DIMENSIONS, dimension_values, verdicts
from tracejudge.metrics.findings.window import FINDING_KIND, Finding, FindingsOptions, FindingsWindow

__all__ = ["DIMENSIONS", "FINDING_KIND", "ClusterOptions", "Finding", "FindingsOptions", "FindingsWindow",
           "RequestClusterer", "dimension_values", "verdicts"]
