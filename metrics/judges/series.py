"""Prometheus metrics of the judges (names and labels are a public contract, see
docs/pages/reference/metrics.md).

Label values are bounded: `judge` comes from configuration, `verdict`/`reason`/`direction` from closed
sets, and `app` goes through the caller's `app_label` limiter (the stream's cap on distinct apps).
The trace id never becomes a label; it rides on verdict and score observations as an exemplar, which
Prometheus keeps when it scrapes the OpenMetrics format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tracejudge.metrics.app_labels import default_app_label
from tracejudge.metrics.version_labels import NO_VERSION, default_version_label

__all__ = ["SKIP_REASONS", "JudgeMetrics"]

# The closed set of skip reasons (`Assessment.skipped` and the `reason` label).
SKIP_REASONS = frozenset(
    {
        "failed_trace",
        "filtered",
        "missing_inputs",
        "not_applicable",
        "not_sampled",
        "budget",
        "circuit_open",
        "overloaded",
        "too_large",
        "closed",
    }
)
# The closed set of error reasons (the `reason` label of the errors counter).
ERROR_REASONS = frozenset(
    {
        "timeout",
        "rate_limited",
        "http_5xx",
        "http_4xx",
        "connection",
        "circuit_open",
        "invalid_response",
        "unparseable",
        "invalid_answer",
        "internal",
    }
)

SCORE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
DURATION_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Exemplar label names + values must stay within 128 characters.
_EXEMPLAR_ID_MAX = 100


def _exemplar(trace_id: str | None) -> dict[str, str] | None:
    return {"trace_id": trace_id[:_EXEMPLAR_ID_MAX]} if trace_id else None


def judge_families(m: object, registry: CollectorRegistry, prefix: str, subject: str,
                   coverage: tuple[str, ...], releases: bool = False) -> None:
    """The families every judge runner exports, named `<prefix>_*`, set as attributes of `m`: verdicts,
    score, eligible, sampled, skipped, errors, duration, tokens, requests, retries, circuit_refusals,
    circuit_open, in_flight.
    `subject` is what is judged ("trace", "session"); `coverage` the labels of the eligible, sampled
    and skipped counters (the trace judges' carry `app`, the session judges' do not). With `releases`
    the verdicts carry the app's `version` too (`tracejudge.metrics.version_labels`)."""
    things = subject + "s"
    f: dict[str, object] = {
        "verdicts": Counter(f"{prefix}_verdicts", f"Judge verdicts on sampled {things}, by outcome"
                            + (" and the app's version (empty: none stated)." if releases else "."),
                            ["app", "judge", "verdict", *(["version"] if releases else [])],
                            registry=registry),
        "score": Histogram(f"{prefix}_score", f"Judge scores of {things} in [0, 1] (1 = good).",
                           ["app", "judge"], buckets=SCORE_BUCKETS, registry=registry),
        "eligible": Counter(f"{prefix}_eligible", f"{things.capitalize()} a judge could judge (filters "
                            "passed, inputs present).", list(coverage), registry=registry),
        "sampled": Counter(f"{prefix}_sampled", f"Eligible {things} chosen by the judge's sample rate.",
                           list(coverage), registry=registry),
        "skipped": Counter(f"{prefix}_skipped", f"Judgements of {things} not run, by reason.",
                           [*coverage, "reason"], registry=registry),
        "errors": Counter(f"{prefix}_errors", f"Judgements of {things} that ran but gave no verdict, by "
                          "reason.", ["judge", "reason"], registry=registry),
        "duration": Histogram(f"{prefix}_duration_seconds", f"Wall time of one judge on one {subject}, "
                              "retries included.", ["judge"], buckets=DURATION_BUCKETS, registry=registry),
        "tokens": Counter(f"{prefix}_tokens", f"Tokens sent to (input) and received from (output) judge "
                          f"endpoints by the {subject} judges.", ["judge", "direction"], registry=registry),
        "requests": Counter(f"{prefix}_requests", f"HTTP requests of the {subject} judges to judge "
                            "endpoints, by outcome.", ["endpoint", "outcome"], registry=registry),
        "retries": Counter(f"{prefix}_retries", f"Requests of the {subject} judges sent again, by the "
                           "reason of the attempt before (rate_limited: after waiting its Retry-After).",
                           ["endpoint", "reason"], registry=registry),
        "circuit_refusals": Counter(f"{prefix}_circuit_refusals", f"Calls of the {subject} judges an "
                                    "endpoint's open circuit breaker refused, nothing sent: attempt=first "
                                    "(judgement skipped) or retry (it reports the error it got).",
                                    ["endpoint", "attempt"], registry=registry),
        "circuit_open": Gauge(f"{prefix}_circuit_open", f"1 while the {subject} judges' circuit breaker "
                              "of an endpoint refuses calls.", ["endpoint"], registry=registry),
        "in_flight": Gauge(f"{prefix}_in_flight", f"{things.capitalize()} with judgements in progress.",
                           registry=registry),
    }
    for name, family in f.items():
        setattr(m, name, family)


class JudgeSeries:
    """What every judge runner's series have in common (`judge_families`) and the observations that
    read the same for trace and session judges."""

    verdicts: Counter
    score: Histogram
    eligible: Counter
    sampled: Counter
    skipped: Counter
    errors: Counter
    duration: Histogram
    tokens: Counter
    requests: Counter
    retries: Counter
    circuit_refusals: Counter
    circuit_open: Gauge
    in_flight: Gauge

    def observe_error(self, judge: str, reason: str) -> None:
        self.errors.labels(judge, reason if reason in ERROR_REASONS else "internal").inc()

    def observe_duration(self, judge: str, seconds: float) -> None:
        self.duration.labels(judge).observe(seconds)

    def observe_tokens(self, judge: str, input_tokens: int, output_tokens: int) -> None:
        if input_tokens:
            self.tokens.labels(judge, "input").inc(input_tokens)
        if output_tokens:
            self.tokens.labels(judge, "output").inc(output_tokens)

    def observe_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def observe_retry(self, endpoint: str, reason: str) -> None:
        self.retries.labels(endpoint, reason if reason in ERROR_REASONS else "internal").inc()

    def observe_circuit_refusal(self, endpoint: str, attempt: str) -> None:
        self.circuit_refusals.labels(endpoint, attempt).inc()

    def set_circuit_open(self, endpoint: str, is_open: bool) -> None:
        self.circuit_open.labels(endpoint).set(1 if is_open else 0)


class JudgeMetrics(JudgeSeries):
    """The trace judges' series (`judge_families` with the `tracejudge_judge` prefix) and the judge
    trust counters of canaries and shadow judges."""

    def __init__(
        self, registry: CollectorRegistry, app_label: Callable[[str | None], str] = default_app_label
    ):
        self.registry = registry
        self.app_label = app_label
        # (app label, record version) -> version label; `JudgeRunner` installs the stream's limiter.
        self.version_label: Callable[[str, str | None], str] = default_version_label
        # (app, version) -> the (judge, verdict) children counted, to remove when the version retires.
        self._release_children: dict[tuple[str, str], set[tuple[str, str]]] = {}
        judge_families(self, registry, "tracejudge_judge", "trace", ("app", "judge"), releases=True)
        # Judge trust (tracejudge.metrics.judges.trust.canaries, tracejudge.metrics.judges.trust.shadows):
        # never app quality.
        self.canary = Counter(
            "tracejudge_judge_canary",
            "Canary judgements (labelled records, not app traffic) by agreement with the known answer.",
            ["judge", "outcome"],
            registry=registry,
        )
        self.canary_skipped = Counter(
            "tracejudge_judge_canary_skipped",
            "Canary judgements not run (runner overloaded, budget spent, circuit open, one in flight).",
            ["judge", "reason"],
            registry=registry,
        )
        self.canary_invalid = Counter(
            "tracejudge_judge_canary_invalid",
            "Canary set lines or labels not used, by reason.",
            ["reason"],
            registry=registry,
        )
        self.shadow = Counter(
            "tracejudge_judge_shadow",
            "A shadow (candidate) judge's verdicts compared with the live judge's on the same trace.",
            ["judge", "shadow", "outcome"],
            registry=registry,
        )

    def observe_eligible(self, app: str, judge: str) -> None:
        self.eligible.labels(app, judge).inc()

    def observe_sampled(self, app: str, judge: str) -> None:
        self.sampled.labels(app, judge).inc()

    def observe_skipped(self, app: str, judge: str, reason: str) -> None:
        self.skipped.labels(app, judge, reason).inc()

    def observe_verdict(
        self, app: str, judge: str, *, passed: bool | None, score: float | None, trace_id: str | None,
        version: str = NO_VERSION,
    ) -> None:
        ex = _exemplar(trace_id)
        if passed is not None:
            verdict = "pass" if passed else "fail"
            self.verdicts.labels(app, judge, verdict, version).inc(exemplar=ex)
            if version:
                self._release_children.setdefault((app, version), set()).add((judge, verdict))
        if score is not None:
            self.score.labels(app, judge).observe(min(1.0, max(0.0, score)), exemplar=ex)

    def retire_version(self, app: str, version: str) -> None:
        """Remove a retired version's verdict series (`VersionLabelLimiter.on_retire`)."""
        for judge, verdict in self._release_children.pop((app, version), ()):
            with contextlib.suppress(KeyError):  # already gone
                self.verdicts.remove(app, judge, verdict, version)

    def observe_canary(self, judge: str, outcome: str) -> None:
        self.canary.labels(judge, outcome).inc()

    def observe_canary_skipped(self, judge: str, reason: str) -> None:
        self.canary_skipped.labels(judge, reason).inc()

    def observe_shadow(self, judge: str, shadow: str, agree: bool) -> None:
        self.shadow.labels(judge, shadow, "agree" if agree else "disagree").inc()
