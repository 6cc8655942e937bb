"""The `version` label of the judge verdict series: bounded per app, the most recent releases kept
(issue 26 item 4). The limiter on its own, then `tracejudge run` on the real broker with heuristic
judges, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import subprocess
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from support.kafka import produce, running, samples, scrape, settings, unique, value, wait_until

from tracejudge.metrics.version_labels import OTHER_VERSION, VersionLabelLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def limiter(max_versions: int) -> tuple[VersionLabelLimiter, CollectorRegistry, list[tuple[str, str]]]:
    registry = CollectorRegistry()
    overflow = Counter("overflow", "", registry=registry)
    first_seen = Gauge("first_seen", "", ["app", "version"], registry=registry)
    lim = VersionLabelLimiter(max_versions, overflow, first_seen, clock=Clock())
    retired: list[tuple[str, str]] = []
    lim.on_retire(lambda app, version: retired.append((app, version)))
    return lim, registry, retired


def test_the_most_recent_versions_are_kept_and_older_ones_are_other_and_counted() -> None:
    lim, registry, retired = limiter(2)
    sample = registry.get_sample_value
    assert [lim("shop", v) for v in ("v1", "v2", "v1", "v2")] == ["v1", "v2", "v1", "v2"]
    assert lim.admitted("shop") == ["v1", "v2"] and retired == []
    # A third release retires the oldest: its series go, its stragglers become `other`, counted.
    assert lim("shop", "v3") == "v3"
    assert retired == [("shop", "v1")] and lim.admitted("shop") == ["v2", "v3"]
    assert [lim("shop", "v1"), lim("shop", "v1")] == [OTHER_VERSION, OTHER_VERSION]
    assert sample("overflow_total") == 2
    assert sample("first_seen", {"app": "shop", "version": "v1"}) is None
    assert sample("first_seen", {"app": "shop", "version": "v3"}) > sample("first_seen", {"app": "shop",
                                                                                          "version": "v2"})
    # Per app: another app's releases are its own.
    assert [lim("bank", v) for v in ("v1", "v2")] == ["v1", "v2"] and lim.admitted("bank") == ["v1", "v2"]
    # No version: the empty label (Prometheus reads it as no label); never counted as overflow.
    assert (lim("shop", None), lim("shop", "")) == ("", "")
    assert sample("overflow_total") == 2
    # A long or non-ASCII version is cut to 100 characters and kept writable.
    long = "x" * 300
    assert lim("bank", long) == "x" * 100 and lim("bank", "\udc80a") == "?a"


def test_max_versions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_versions"):
        VersionLabelLimiter(0, Counter("o", "", registry=CollectorRegistry()))


def row(version: Any, i: int) -> bytes:
    """An agent-evaluation row of app shop that the heuristic judges judge (grounded, relevant)."""
    out = {"app": "shop", "request_id": f"r-{i}", "request": "What does the premium plan cost?",
           "response": "The premium plan costs 49 dollars a month.",
           "retrieved_context": [{"content": "The premium plan costs 49 dollars a month."}]}
    if version is not None:
        out["version"] = version
    return orjson.dumps(out)


def test_the_stream_labels_verdicts_by_version_and_publishes_first_seen(broker: Any) -> None:
    bootstrap = broker.bootstrap_servers
    topic = unique("traces")
    s = settings(bootstrap, [f"{topic}:agent_eval"], judges={"sample_rate": 1.0},
                 stream__app_tag="app", prometheus__max_versions=2)
    verdicts = "tracejudge_judge_verdicts_total"
    sent = 0

    def phase(port: int, versions: list[Any]) -> None:
        nonlocal sent
        produce(bootstrap, topic, [row(v, sent + i) for i, v in enumerate(versions)],
                keys=[b"k"] * len(versions))
        sent += len(versions)
        # The groundedness judge ran on every row (its duration is observed with each verdict, and
        # never removed: a retired version's verdict series are).
        wait_until(lambda: value(scrape(port).text, "tracejudge_judge_duration_seconds_count",
                                 judge="groundedness") == sent, 60, message=f"{sent} groundedness judgements")

    with running(s) as runner:
        port = runner.http_port
        phase(port, ["v1", "v1", "v2"])
        text = scrape(port).text
        assert value(text, verdicts, app="shop", judge="groundedness", version="v1", verdict="pass") == 2
        assert value(text, verdicts, app="shop", judge="groundedness", version="v2") == 1
        phase(port, [3, 3, 3])  # a number is its text; "3" is the newest release
        phase(port, ["v1", None, ""])
        wait_until(lambda: value(scrape(port).text, verdicts, judge="groundedness", version="") == 2, 30,
                   message="the unversioned verdicts")
        text = scrape(port).text
        first_seen = "tracejudge_app_version_first_seen_timestamp_seconds"
    # "3" retired v1 (cap 2): v1's series are gone; its straggler is `other`, counted per verdict.
    assert not [k for k in samples(text) if k[0] == verdicts and ("version", "v1") in k[1]]
    assert value(text, verdicts, app="shop", judge="groundedness", version="v2") == 1
    assert value(text, verdicts, app="shop", judge="groundedness", version="3") == 3
    assert value(text, verdicts, app="shop", judge="groundedness", version="other") == 1
    assert value(text, verdicts, app="shop", judge="groundedness", version="") == 2
    overflow = value(text, "tracejudge_version_label_overflow_total")
    assert overflow == value(text, verdicts, version="other") == 2
    assert value(text, first_seen, app="shop", version="v1") == 0
    assert value(text, first_seen, app="shop", version="3") > value(text, first_seen, version="v2") > 0
    # Every pass-rate rule sums by (app, judge): the totals are still every verdict.
    assert value(text, verdicts, app="shop", judge="groundedness") == sent - 2  # v1's two were removed
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                          check=False, timeout=60)
    problems = [line for line in (lint.stdout + lint.stderr).splitlines()
                if "tracejudge_judge_verdicts" in line or "version" in line]
    assert problems == [], problems


def test_exporter_series_text_names_the_version_label() -> None:
    from tracejudge.metrics.judges.series import JudgeMetrics

    registry = CollectorRegistry()
    metrics = JudgeMetrics(registry)
    metrics.observe_verdict("shop", "groundedness", passed=True, score=1.0, trace_id=None, version="2.0")
    metrics.observe_verdict("shop", "groundedness", passed=False, score=0.0, trace_id=None)
    text = generate_latest(registry).decode()
    line = 'tracejudge_judge_verdicts_total{app="shop",judge="groundedness",verdict="pass",version="2.0"} 1.0'
    assert line in text
    metrics.retire_version("shop", "2.0")
    text = generate_latest(registry).decode()
    assert 'version="2.0"' not in text and 'verdict="fail",version=""} 1.0' in text
