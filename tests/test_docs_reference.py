"""The generated references of the documentation site (docs/hooks/reference.py): the configuration
reference from the settings models, the metrics reference from the registered Prometheus series.

Every settings field has a description; every family the code registers is in the metrics reference with
its type and labels; a field added to a model appears without anything listed by hand; a marker the
hooks do not know fails the build; and the site builds (strict, from another working directory) with both
references in it.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from pydantic import Field

from tracejudge.consumer.config.common import Section
from tracejudge.consumer.config.settings import Settings

REPO = Path(__file__).resolve().parent.parent
HOOKS = REPO / "docs" / "hooks"
PACKAGE_DIRS = ("api", "consumer", "metrics", "schemas")
METRIC_CLASSES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "CounterMetricFamily",
                  "GaugeMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily", "InfoMetricFamily"}


def _load(name: str) -> ModuleType:
    """A module of docs/hooks/ (not part of the package), imported as the hook imports its generators."""
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))
    module = importlib.import_module(name)
    assert Path(module.__file__ or "").resolve() == HOOKS / f"{name}.py"
    return module


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return _load("reference")


@pytest.fixture(scope="module")
def config_ref() -> ModuleType:
    return _load("reference_config")


@pytest.fixture(scope="module")
def metrics_ref() -> ModuleType:
    return _load("reference_metrics")


# --- configuration ---------------------------------------------------------------------------------


def test_every_settings_field_has_a_description(config_ref: ModuleType) -> None:
    sections = config_ref.sections()
    missing = [f"{key.path} ({section.model.__module__}.{section.model.__qualname__})"
               for section in sections for key in section.keys if not key.description.strip()]
    assert not missing, f"{len(missing)} settings fields have no description:\n" + "\n".join(missing)


def test_the_reference_covers_every_section_and_the_sinks_own(config_ref: ModuleType) -> None:
    paths = {s.path for s in config_ref.sections()}
    for path in ("kafka", "stream", "judges", "judges.endpoints.<name>", "judges.custom.<name>", "metrics",
                 "metrics.signals", "sink.mlflow", "sink.otlp", "sink.phoenix", "collections[]", "slos[]",
                 "alerts", "findings", "otlp.assembly"):
        assert path in paths, path
    keys = {k.path: k for s in config_ref.sections() for k in s.keys}
    # Secrets, defaults as YAML shows them (a default_factory evaluated), constraints, environment.
    assert keys["kafka.sasl_plain_password"].secret and not keys["kafka.sasl_plain_username"].secret
    assert keys["sink.otlp.headers"].secret
    assert keys["kafka.bootstrap_servers"].default == "['localhost:9092']"
    assert keys["kafka.bootstrap_servers"].env == "TRACEJUDGE_KAFKA__BOOTSTRAP_SERVERS"
    assert keys["otlp.assembly.quiet_period_s"].env == "TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S"
    assert keys["sink.mlflow.max_concurrency"].env == "TRACEJUDGE_SINK__MLFLOW__MAX_CONCURRENCY"
    assert keys["kafka.session_timeout_ms"].constraints == "> 0"
    assert "`SASL_SSL`" in keys["kafka.security_protocol"].constraints
    assert keys["collections[].name"].env is None  # a list of entries: the file only
    assert keys["judges.endpoints.<name>.model"].default == "required"


class _MadeUpSection(Section):
    """A section that only this test has."""

    # How many answers the made-up key allows.
    answers: int = Field(default=42, gt=0, le=100)
    token: str = Field(default="x", description="Said by Field(description=...).")
    word: str = "plain"
    """Said by an attribute docstring."""


class _BiggerSettings(Settings):
    made_up: _MadeUpSection = Field(default_factory=_MadeUpSection)
    flag: bool = True  # a comment at the end of the line


def test_a_field_added_to_a_model_shows_up(config_ref: ModuleType) -> None:
    text = config_ref.render(_BiggerSettings)
    assert "made_up.answers" not in config_ref.render()
    row = next(line for line in text.splitlines() if line.startswith("| `made_up.answers`"))
    assert "`42`" in row and "> 0; ≤ 100" in row and "`TRACEJUDGE_MADE_UP__ANSWERS`" in row
    assert "How many answers the made-up key allows." in row
    assert "Said by Field(description=...)." in text and "Said by an attribute docstring." in text
    assert "a comment at the end of the line" in text
    assert "{ #config-made-up }" in text and "A section that only this test has." in text


# --- metrics ---------------------------------------------------------------------------------------


def _rows(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, label names) of the generated table."""
    out = {}
    for line in text.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `tracejudge_") or len(cells) < 5:
            continue
        name = cells[0].strip("| `")
        labels = tuple(re.findall(r"(?:^|, )`([a-z_]+)`", re.sub(r" \([^)]*\)", "", cells[2])))
        out[name] = (cells[1].split(" ")[0], labels)
    return out


def _registered_names() -> set[str]:
    """Every family name the package's code passes to a metric constructor as a literal."""
    names = set()
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                first = node.args[0]
                literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
                if func in METRIC_CLASSES and literal and first.value.startswith("tracejudge_"):
                    names.add((first.value, func))
    return names


def test_every_registered_family_is_in_the_metrics_reference(metrics_ref: ModuleType) -> None:
    rows = _rows(metrics_ref.render())
    missing = []
    for name, func in _registered_names():
        exposed = name + ("_total" if func.startswith("Counter") and not name.endswith("_total") else "")
        if exposed not in rows:
            missing.append(exposed)
    assert not missing, "registered but not in the metrics reference: " + ", ".join(sorted(missing))


def _owned(*owners: object) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for owner in owners:
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                name = metric._name + ("_total" if metric._type == "counter" else "")
                out[name] = (metric._type, tuple(metric._labelnames))
    return out


def test_the_reference_gives_each_family_its_type_and_labels(metrics_ref: ModuleType) -> None:
    from tracejudge.metrics.cost import JudgeCostMetrics
    from tracejudge.metrics.judges.series import JudgeMetrics
    from tracejudge.metrics.judges.sessions import SessionJudgeMetrics
    from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
    from tracejudge.metrics.telemetry.findings import FindingsMetrics
    from tracejudge.metrics.telemetry.sessions import SessionMetrics
    from tracejudge.metrics.telemetry.sinks import SinkMetrics, SinkWriteMetrics

    text = metrics_ref.render()
    rows = _rows(text)
    real = _owned(PrometheusExporter(CollectorRegistry()), JudgeMetrics(CollectorRegistry()),
                  JudgeCostMetrics(CollectorRegistry()), SessionMetrics(CollectorRegistry()),
                  SessionJudgeMetrics(CollectorRegistry()), FindingsMetrics(CollectorRegistry()),
                  SinkMetrics(CollectorRegistry(), "otlp"),
                  SinkWriteMetrics("mlflow", CollectorRegistry(), deletes=True))
    assert len(real) > 100
    for name, family in real.items():
        assert rows.get(name) == family, f"{name}: {rows.get(name)} in the reference, {family} registered"
    # The families of collectors (read at each scrape) too, and which commands export what.
    assert rows["tracejudge_signals_total"] == ("counter", ("app", "signal"))
    assert rows["tracejudge_backfill_partitions"] == ("gauge", ("state",))
    families = metrics_ref.families()
    assert set(families["tracejudge_commits_total"].commands) >= {
        "tracejudge run", "tracejudge sink mlflow", "tracejudge sessions", "tracejudge agreement",
        "tracejudge findings run"}
    assert set(families["tracejudge_sink_writes_total"].commands) == {
        "tracejudge sink mlflow", "tracejudge sink otlp", "tracejudge sink phoenix"}
    assert "with `collections:` rules" in families["tracejudge_collected_total"].commands["tracejudge run"]
    # Label values the code exports from the start (closed sets), never a configured name's placeholder.
    assert families["tracejudge_assembly_traces_emitted_total"].values["reason"] >= {"complete", "timeout"}
    assert "collection" not in families["tracejudge_collected_total"].values


# --- the hook and the site -------------------------------------------------------------------------


def test_the_hook_fills_its_markers_and_refuses_an_unknown_one(hook: ModuleType) -> None:
    page = "# Title\n\n<!-- generated: metrics -->\n\nAfter.\n"
    filled = hook.on_page_markdown(page)
    assert "<!-- generated" not in filled and "| `tracejudge_records_total` | counter |" in filled
    with pytest.raises(hook.GenerationError, match="unknown marker <!-- generated: nonsense -->"):
        hook.on_page_markdown("<!-- generated: nonsense -->\n")
    # A marker shown in a code block is left as written; another hook's (usage) is left for it.
    shown = "```text\n<!-- generated: nonsense -->\n```\n<!-- generated: usage tracejudge run -->\n"
    assert hook.on_page_markdown(shown) == shown
    with pytest.raises(hook.GenerationError, match="left unfilled"):
        hook.on_page_content("<p>x</p><!-- generated: usage tracejudge run -->")


def test_a_failing_generator_fails_the_build(hook: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> str:
        raise ValueError("no models")

    monkeypatch.setitem(hook.GENERATORS, "configuration", broken)
    failed = "generating 'configuration' failed: ValueError: no models"
    with pytest.raises(hook.GenerationError, match=failed):
        hook.on_page_markdown("<!-- generated: configuration -->\n")


def test_the_snippets_read_from_the_repository_root(hook: ModuleType) -> None:
    config = {"mdx_configs": {"pymdownx.snippets": {"base_path": [".."], "check_paths": True}}}
    hook.on_config(config)
    assert config["mdx_configs"]["pymdownx.snippets"] == {"base_path": [str(REPO)], "check_paths": True}


def test_the_site_builds_with_both_references(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-q",
                           "-f", str(REPO / "docs" / "mkdocs.yml"), "-d", str(site)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = (site / "reference" / "configuration" / "index.html").read_text(encoding="utf-8")
    for text in ("kafka.bootstrap_servers", "TRACEJUDGE_KAFKA__BOOTSTRAP_SERVERS", "sink.mlflow.tracking_uri",
                 "judges.endpoints.&lt;name&gt;.base_url", "TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S"):
        assert text in config, text
    metrics = (site / "reference" / "metrics" / "index.html").read_text(encoding="utf-8")
    for name in ("tracejudge_records_total", "tracejudge_judge_verdicts_total",
                 "tracejudge_sink_lag_records", "tracejudge_sessions_total",
                 "tracejudge_failure_concentration", "tracejudge_backfill_partitions"):
        assert name in metrics, name
    assert "<!-- generated" not in config + metrics
