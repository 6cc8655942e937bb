"""The `findings:` section: what the failures have in common (`tracejudge findings`, the stage
`consumer/stages/findings.py`, and the analysis behind `tracejudge findings FILE...` and the
`tracejudge eval` summary) (`tracejudge.consumer.config`)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from tracejudge.consumer.config.common import Section, group_id_value, optional_topic, split_list
from tracejudge.metrics.findings import DIMENSIONS, ClusterOptions, FindingsOptions
from tracejudge.metrics.findings.models import ModelOptions
from tracejudge.metrics.judges.config import JudgesConfig
from tracejudge.schemas.errors import ConfigError

__all__ = ["AUTO", "ClusteringSettings", "FindingsSettings"]

# `findings.clustering.embeddings: auto`: the judges' embeddings endpoint, when there is one.
AUTO = "auto"

# A sliding window keeps one pane of counts per slide: at most this many.
MAX_PANES = 60


class ClusteringSettings(Section):
    """`findings.clustering`: how requests are grouped into clusters: by word-set Jaccard similarity
    against each cluster's first request (`metrics/findings/clusters.py`), or by the cosine of their
    embeddings through a judges endpoint (`embeddings`), falling back to words when it cannot answer."""

    # A request joins the most similar cluster at or above this similarity (0-1).
    threshold: float = Field(default=0.5, gt=0, le=1)
    # Clusters remembered; past it the least recently joined is forgotten.
    max_clusters: int = Field(default=1000, gt=0, le=100_000)
    # Only the start of a request is read, and at most this many distinct words of it.
    max_request_chars: int = Field(default=2000, gt=0)
    # Distinct words of a request read, at most.
    max_words: int = Field(default=64, gt=0, le=1000)
    # Words in a cluster's label.
    label_words: int = Field(default=3, gt=0, le=10)
    # Cluster by meaning through a `judges.endpoints` name with an `embedding_model` (`auto`: the one the
    # judges embed with, when there is one); None: by words only (`metrics/findings/models.py`).
    embeddings: str | None = None
    # Cosine similarity a request needs to join a cluster when it has a vector (0-1).
    embedding_threshold: float = Field(default=0.85, gt=0, le=1)
    # Texts per embeddings call, texts embedded per window (past it: by words), vectors and names cached.
    embedding_batch: int = Field(default=64, ge=1, le=2048)
    # Texts embedded per window, at most; past it requests are clustered by words.
    max_embedded: int = Field(default=2000, ge=1, le=1_000_000)
    # Embedding vectors and cluster names cached, each.
    cache_size: int = Field(default=10_000, ge=1, le=1_000_000)
    # Name each cluster of a finding (2-5 words) through this `judges.endpoints` name; None: words only.
    name_with: str | None = None
    # Names asked for per window, and example requests each cluster keeps for its name.
    max_names: int = Field(default=10, ge=1, le=1000)
    # Example requests each cluster keeps to be named from.
    name_examples: int = Field(default=3, ge=1, le=10)

    def options(self) -> ClusterOptions:
        return ClusterOptions(threshold=self.threshold, max_clusters=self.max_clusters,
                              max_request_chars=self.max_request_chars, max_words=self.max_words,
                              label_words=self.label_words, embedding_threshold=self.embedding_threshold,
                              examples=self.name_examples if self.name_with else 0)

    def model_options(self) -> ModelOptions:
        return ModelOptions(batch_size=self.embedding_batch, max_texts=self.max_embedded,
                            cache_size=self.cache_size, max_names=self.max_names,
                            max_request_chars=self.max_request_chars)

    def endpoints(self, judges: JudgesConfig | None) -> tuple[str | None, str | None]:
        """(embeddings, name_with) resolved against `judges.endpoints`: `auto` is the endpoint the
        judges embed with (answer_relevancy's `embeddings_endpoint`, else the default endpoint, else the
        only endpoint with an `embedding_model`; None when there is none). `ConfigError` naming the key
        for an unknown endpoint or one without what the call needs."""
        known = judges.endpoints if judges is not None else {}
        emb = self.embeddings
        if emb == AUTO:
            emb = _auto_embeddings(judges)
        elif emb is not None:
            if emb not in known:
                raise ConfigError("findings.clustering.embeddings", f"unknown endpoint {emb!r}; "
                                  f"judges.endpoints has: {', '.join(known) or 'none'}")
            if not known[emb].embedding_model:
                raise ConfigError("findings.clustering.embeddings", f"endpoint {emb!r} has no "
                                  f"embedding_model (set judges.endpoints.{emb}.embedding_model)")
        if self.name_with is not None and self.name_with not in known:
            raise ConfigError("findings.clustering.name_with", f"unknown endpoint {self.name_with!r}; "
                              f"judges.endpoints has: {', '.join(known) or 'none'}")
        return emb, self.name_with


def _auto_embeddings(judges: JudgesConfig | None) -> str | None:
    """The endpoint the judges embed with, when there is one."""
    if judges is None:
        return None
    settings = judges.judge_settings().get("answer_relevancy")
    preferred = [getattr(settings, "embeddings_endpoint", None), judges.default_endpoint_name]
    for name in preferred:
        if name is not None and name in judges.endpoints and judges.endpoints[name].embedding_model:
            return name
    with_model = [n for n, e in judges.endpoints.items() if e.embedding_model]
    return with_model[0] if len(with_model) == 1 else None


class FindingsSettings(Section):
    """`findings:`. The stage reads the trace results (`input_topic`, default `stream.results_topic`)
    in its own consumer group, and at the end of each window publishes its findings to
    `findings_topic` (optional: without it they are only exported to Prometheus) and `/metrics`."""

    # The trace results analysed. Default: stream.results_topic.
    input_topic: str | None = None
    # Where each window's findings are published (read by `tracejudge run`'s `finding:` collection rules and
    # the MLflow sink); unset: they are only exported to Prometheus.
    findings_topic: str | None = None
    # Default: tracejudge-findings.
    group_id: str | None = None
    # The window the stage analyses (wall clock); with `slide_s` it slides by that much (a sliding
    # window of window_s / slide_s panes), without it windows are tumbling (back to back).
    window_s: float = Field(default=900.0, gt=0)
    # With it, the window slides by this much (window_s / slide_s panes); unset: windows are back to back.
    slide_s: float | None = Field(default=None, gt=0)
    # A value must be on at least `min_failing` failing verdicts and `min_share` of the window's
    # failing verdicts (per app and judge) to be tested.
    min_failing: int = Field(default=5, ge=1)
    # The share of the window's failing verdicts (per app and judge) a value must be on to be tested.
    min_share: float = Field(default=0.05, ge=0, le=1)
    # The simultaneous confidence of the lift intervals (Bonferroni over the values tested).
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    # Findings per app and judge (also the Prometheus series per app and judge).
    top_k: int = Field(default=10, ge=1, le=100)
    # Memory bounds per window: distinct values per dimension per (app, judge), and (app, judge) pairs.
    max_values: int = Field(default=1000, ge=10, le=1_000_000)
    # (app, judge) pairs analysed per window, at most; verdicts of more are dropped (counted).
    max_groups: int = Field(default=1000, ge=1, le=100_000)
    # Example failing trace ids per finding.
    examples: int = Field(default=5, ge=0, le=5)
    # Verdicts (with their value sets) kept per (app, judge) per window for the conditioned tests that
    # explain correlates away (`metrics/findings/conditioning.py`); past it a uniform sample.
    sample: int = Field(default=5000, ge=100, le=1_000_000)
    # What the failing verdicts are compared by: the retrieved documents, tools called, tool errors, the app's
    # version, the model, the cheap signals and the request clusters.
    dimensions: list[str] = Field(default_factory=lambda: list(DIMENSIONS))
    # How requests are grouped into clusters (the `request_cluster` dimension).
    clustering: ClusteringSettings = Field(default_factory=ClusteringSettings)

    _topic = field_validator("input_topic", "findings_topic")(optional_topic)
    _group = field_validator("group_id")(group_id_value)

    @field_validator("dimensions", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return split_list(v)

    @field_validator("dimensions")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [d for d in v if d not in DIMENSIONS]
        if unknown:
            raise ValueError(f"unknown dimension {unknown[0]!r}; known: {', '.join(DIMENSIONS)}")
        if not v:
            raise ValueError("must name at least one dimension")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _panes(self) -> FindingsSettings:
        if self.slide_s is not None:
            panes = self.window_s / self.slide_s
            if self.slide_s > self.window_s or abs(panes - round(panes)) > 1e-9:
                raise ConfigError("slide_s", f"must divide window_s ({self.window_s:g}) into whole panes, "
                                             f"got {self.slide_s:g}")
            if round(panes) > MAX_PANES:
                raise ConfigError("slide_s", f"makes {round(panes)} panes of window_s; at most {MAX_PANES}")
        return self

    @property
    def panes(self) -> int:
        """Panes per window: 1 for a tumbling window."""
        return 1 if self.slide_s is None else round(self.window_s / self.slide_s)

    def options(self) -> FindingsOptions:
        """The analysis options (`metrics.findings.FindingsOptions`)."""
        return FindingsOptions(min_failing=self.min_failing, min_share=self.min_share,
                               confidence=self.confidence, top_k=self.top_k, max_values=self.max_values,
                               max_groups=self.max_groups, examples=self.examples,
                               dimensions=tuple(self.dimensions), sample=self.sample)
