"""The first ten minutes with `tracejudge`, as a user reads them: every command's `--help` says what it
does, the shared flags read the same everywhere, the long-running stages can run side by side on one
host (distinct default metrics ports, an explicit `http.port` still winning), `backfill` serves its
progress, the wheel builds without setuptools warnings and ships its data, and the demo's output
carries no library warnings or errors."""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.kafka import produce, read_topic, unique, value, wait_until
from support.openai_stub import OpenAIStub, Reply

import tracejudge.consumer.runtime.logs as log_setup
from tracejudge.consumer.commands import cli
from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.runtime.arguments import METRICS_PORTS

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
# What each command's --help must say it is for (beyond the one-line summary the top level lists).
PURPOSE = {"eval": "JSON Lines", "calibrate": "human labels", "run": "Kafka", "sessions": "conversations",
           "sink": "MLflow", "agreement": "labels", "backfill": "time range", "demo": "broker",
           "findings": "over-represented", "dataset": "regression set", "slo": "error budget",
           "alerts": "Prometheus rules"}
# The one spelling of each shared flag's value; every command that has the flag uses it.
METAVARS = {"--config": "FILE", "--bootstrap-servers": "HOST:PORT[,...]", "--metrics-port": "PORT",
            "--metrics-bind-address": "ADDR", "--group-id": "GROUP", "--results-topic": "TOPIC",
            "--dead-letter-topic": "TOPIC", "--input-topic": "TOPIC", "--labels-topic": "TOPIC"}
STAGES = ("run", "sink", "sessions", "agreement", "backfill")
KAFKA_COMMANDS = (*STAGES, "demo")
# The stages with --check-config, as a user starts them (a sink needs its kind).
STAGE_ARGV = {"run": ("run",), "sink": ("sink", "otlp"), "sessions": ("sessions",),
              "agreement": ("agreement",)}


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def flag_values(text: str) -> dict[str, set[str | None]]:
    """Every `--flag VALUE` of a help text's options list (None for a flag that takes no value)."""
    out: dict[str, set[str | None]] = {}
    for match in re.finditer(r"^\s+(?:-\w(?: \S+)?, )?(--[\w-]+)(?: (\S+))?", text, re.MULTILINE):
        out.setdefault(match[1], set()).add(match[2])
    return out


# -- --help ---------------------------------------------------------------------------------------


def test_top_level_help_is_whole_sentences_and_lists_every_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.rstrip().endswith("."), description  # it once stopped at "`sink` (write-back),"
    assert "COMMAND --help" in text
    for name in cli.SUBCOMMANDS:
        assert re.search(rf"^\s+{name}\s", text, re.MULTILINE), name
    assert "--log-level" in text and "DEBUG adds" in " ".join(text.split())


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_every_command_help_says_what_it_is_for(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, name)
    assert text.startswith(f"usage: tracejudge {name} ")
    summary = " ".join(cli.SUBCOMMANDS[name][1].split())
    assert summary in " ".join(text.split())
    assert PURPOSE[name] in text


@pytest.mark.parametrize(("kind", "names", "keys"), [
    ("mlflow", ("MLflow", "Feedback"), ("sink.mlflow:", "tracking_uri", "token_file",
                                       "max_concurrency (default 16)", "write_metrics (default false)")),
    ("otlp", ("OpenTelemetry", "gen_ai.evaluation.result"), ("sink.otlp:", "endpoint (default http://",
                                                              "emit_spans (default false)", "compression")),
])
def test_sink_kind_help_describes_that_sink_and_its_settings(kind: str, names: tuple[str, ...],
                                                             keys: tuple[str, ...],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "sink", kind)
    flat = " ".join(text.split())
    for word in (*names, *keys):
        assert word in flat, word
    assert f"tracejudge-sink-{kind}" in flat
    other = "otlp" if kind == "mlflow" else "mlflow"
    assert f"sink.{other}:" not in flat


def test_sink_help_without_a_kind_names_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    flat = " ".join(help_of(capsys, "sink").split())
    assert "mlflow (MLflow" in flat and "otlp (OpenTelemetry" in flat and "sink.plugins" in flat


# -- one vocabulary -------------------------------------------------------------------------------


def test_shared_flags_are_spelled_the_same_in_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, dict[str, set[str | None]]] = {}
    for name in cli.SUBCOMMANDS:
        for flag, values in flag_values(help_of(capsys, name)).items():
            if flag in METAVARS:
                seen.setdefault(flag, {})[name] = values
    for flag, metavar in METAVARS.items():
        assert seen.get(flag), f"no command has {flag}"
        wrong = {name: values for name, values in seen[flag].items() if values != {metavar}}
        assert not wrong, f"{flag} should read {flag} {metavar}: {wrong}"
    assert {"eval", "calibrate", *STAGES} <= set(seen["--config"])
    assert set(KAFKA_COMMANDS) <= set(seen["--bootstrap-servers"])
    # Every long-running stage serves /metrics and takes both flags (agreement once lacked the address,
    # backfill the port).
    assert set(STAGES) <= set(seen["--metrics-port"]) and set(STAGES) <= set(seen["--metrics-bind-address"])


def test_every_stage_with_a_configuration_check_has_check_config(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("run", "sink", "sessions", "agreement"):
        assert flag_values(help_of(capsys, name)).get("--check-config") == {None}, name


def test_a_bad_metrics_port_is_status_2_naming_the_flag(stage_config: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for argv in STAGE_ARGV.values():  # checked with the configuration, before anything connects
        assert cli.main([*argv, "--config", str(stage_config), "--metrics-port", "70000"]) == 2
        err = capsys.readouterr().err
        assert "http.port (from --metrics-port): must be <= 65535, got 70000" in err, err
    with pytest.raises(SystemExit) as exit_info:  # backfill's port is its own, not http.port
        cli.main(["backfill", "--from", "1h", "--config", str(stage_config), "--metrics-port", "70000"])
    assert exit_info.value.code == 2
    assert "argument --metrics-port: 70000 is not a port" in capsys.readouterr().err


# -- distinct default metrics ports --------------------------------------------------------------


@pytest.fixture
def stage_config(tmp_path: Path) -> Path:
    """One file every stage can check: no http.port, so each takes its own default."""
    path = tmp_path / "tracejudge.yaml"
    path.write_text(json.dumps({"stream": {"topics": ["in"], "results_topic": "res"},
                                "sessions": {"results_topic": "sres"},
                                "agreement": {"labels_topic": "labels"}}))
    return path


def checked(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    """`tracejudge ... --check-config`: the printed settings (status 0 asserted)."""
    assert cli.main([*argv, "--check-config"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return {k: json.loads(v) for k, v in (line.split(" = ", 1) for line in out.splitlines())
            if not k.endswith("(effective)")}


def test_each_stage_has_its_own_documented_default_metrics_port(stage_config: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    ports = {name: checked(capsys, *argv, "--config", str(stage_config))["http.port"]
             for name, argv in STAGE_ARGV.items()}
    assert ports == {"run": 9464, "sink": 9465, "sessions": 9466, "agreement": 9467}
    assert len(set(METRICS_PORTS.values())) == len(METRICS_PORTS) and METRICS_PORTS["backfill"] == 9468
    # Each command's --help quotes its own default.
    for name in STAGES:
        flat = " ".join(help_of(capsys, *STAGE_ARGV.get(name, (name,))).split())
        assert f"default {METRICS_PORTS[name]} for `{name}`" in flat, name
    # The documentation's ports table (docs/pages/commands/index.md), and each command's own page.
    commands = ROOT / "docs" / "pages" / "commands"
    table = (commands / "index.md").read_text(encoding="utf-8")
    for name, port in METRICS_PORTS.items():
        assert re.search(rf"^\| `tracejudge {name}[^|]*\| {port}\b", table, re.MULTILINE), name
        page = " ".join((commands / f"{name}.md").read_text(encoding="utf-8").split())
        assert f"port **{port}**" in page, f"docs/pages/commands/{name}.md does not say port {port}"


def test_an_explicit_http_port_still_wins_file_then_environment_then_flag(
        stage_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(json.dumps({**json.loads(stage_config.read_text()), "http": {"port": 9100}}))
    for argv in STAGE_ARGV.values():
        assert checked(capsys, *argv, "--config", str(pinned))["http.port"] == 9100
        assert checked(capsys, *argv, "--config", str(pinned), "--metrics-port", "9200")["http.port"] == 9200
    monkeypatch.setenv("TRACEJUDGE_HTTP__PORT", "9300")
    for argv in STAGE_ARGV.values():
        assert checked(capsys, *argv, "--config", str(stage_config))["http.port"] == 9300


def test_agreement_takes_the_metrics_bind_address(stage_config: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    shown = checked(capsys, "agreement", "--config", str(stage_config), "--metrics-bind-address", "127.0.0.1")
    assert shown["http.bind_address"] == "127.0.0.1" and shown["http.port"] == 9467


# -- backfill's metrics --------------------------------------------------------------------------


class Lines:
    """A subprocess's stderr, read line by line on a thread (a full pipe would block it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream: Iterator[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def find(self, pattern: str) -> re.Match[str] | None:
        return next((m for line in list(self.lines) if (m := re.search(pattern, line))), None)

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(self.lines)


def test_backfill_serves_its_progress_on_metrics_port(broker: LocalBroker, stub: OpenAIStub,
                                                      tmp_path: Path) -> None:
    source, results = unique("cli-backfill-in"), unique("cli-backfill-out")
    rows = [json.dumps({"request_id": f"r{i}", "request": "What is the refund window?",
                        "response": "30 days."}).encode() for i in range(4)]
    produce(broker.bootstrap_servers, source, rows)
    release = threading.Event()
    held = Reply.verdict("yes")
    held.hold = release  # every judgement waits: the backfill is mid-run while it is scraped
    stub.responder = lambda _req: held
    config = tmp_path / "tracejudge.yaml"
    config.write_text(json.dumps({
        "stream": {"topics": [f"{source}:agent_eval"], "results_topic": results},
        "judges": {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model"}},
                   "sample_rate": 1.0, "builtin": {"relevance_to_query": {}}}}))
    proc = subprocess.Popen([*CLI, "backfill", "--from", "1h", "--config", str(config), "--bootstrap-servers",
                             broker.bootstrap_servers, "--metrics-port", "0", "--metrics-bind-address",
                             "127.0.0.1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    err = Lines(proc)
    try:
        url = wait_until(lambda: err.find(r"progress metrics on (http://127\.0\.0\.1:\d+/metrics)"), 60,
                         message=err.text)[1]
        wait_until(lambda: stub.count("/chat/completions") >= len(rows), 60, message="judge calls")
        # Every record read, every partition read to its end; nothing published: all held at the judge.
        def read_to_the_end() -> str | None:
            text = httpx.get(url, timeout=5).text
            done = value(text, "tracejudge_backfill_partitions", state="done")
            return text if done >= 1 and value(text, "tracejudge_backfill_partitions", state="reading") == 0 \
                else None

        text = wait_until(read_to_the_end, 60, message="every partition read")
        assert value(text, "tracejudge_backfill_records_read_total") == len(rows)
        assert value(text, "tracejudge_backfill_results_published_total") == 0
        assert "tracejudge_judge_" not in text  # the live stream's series stay the live stream's
        release.set()
        assert proc.wait(timeout=120) == 0, err.text()
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(read_topic(broker.bootstrap_servers, results, at_least=len(rows))) == len(rows)


def test_backfill_on_a_taken_port_it_was_asked_for_exits_4_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tracejudge.yaml"
    config.write_text(json.dumps({"stream": {"topics": ["in"], "results_topic": "out"}, "judges": {}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No broker is contacted: the port is checked before Kafka is read.
        status = cli.main(["backfill", "--from", "1h", "--config", str(config), "--bootstrap-servers",
                           "127.0.0.1:9", "--metrics-port", str(port), "--metrics-bind-address", "127.0.0.1"])
    assert status == 4  # SERVICE_FAILED: the service could not start
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-port)" in capsys.readouterr().err


# -- packaging -----------------------------------------------------------------------------------


def test_the_wheel_builds_without_setuptools_warnings_and_ships_every_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    folders = ("api", "consumer", "metrics", "schemas")
    for name in folders:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    warnings = [line for line in output.splitlines()
                if "warning" in line.lower() and not line.startswith("WARNING: Location")]  # pip's index
    assert warnings == [], "\n".join(warnings)
    (wheel,) = out.glob("tracejudge-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    installed_as = {"api": "tracejudge", "consumer": "tracejudge/consumer", "metrics": "tracejudge/metrics",
                    "schemas": "tracejudge/schemas"}
    expected = {f"{installed_as[name]}/{path.relative_to(src / name).as_posix()}"
                for name in folders for path in (src / name).rglob("*") if path.is_file()}
    assert expected - shipped == set()
    trust = "tracejudge/metrics/judges/trust"
    assert {"tracejudge/consumer/examples/traces.jsonl", f"{trust}/canary_set.jsonl",
            f"{trust}/calibration_kit/groundedness.jsonl", "tracejudge/py.typed"} <= shipped


# -- quiet logs ----------------------------------------------------------------------------------


@pytest.fixture
def kafka_log_setup() -> Iterator[None]:
    yield
    log_setup.configure_library_logs("INFO")


def test_kafka_python_scheduler_and_close_time_noise_is_debug_only(
        kafka_log_setup: None, caplog: pytest.LogCaptureFixture) -> None:
    import kafka.net.selector as selector
    from kafka import errors

    # The exact text kafka-python writes (read from the installed module, so an upgrade that rewords
    # it fails here rather than reaching users' terminals).
    assert "blocking the event loop" in Path(selector.__file__).read_text(encoding="utf-8")
    slow = ("Task <kafka.net.selector.Task object at 0x7f> ran for 0.132s (>0.100s threshold). It is "
            "blocking the event loop -- likely a tight sync loop inside a coroutine. Other pollers will "
            "time out.")
    log_setup.configure_library_logs("INFO")
    log_setup.KAFKA_CONNECTION_LOGS.filter(logging.LogRecord(
        "kafka.net.connection", logging.ERROR, __file__, 1, "Connection lost: %s",
        (OSError(111, "ECONNREFUSED"),), None))
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("kafka.net.selector").warning(slow)
        logging.getLogger("kafka.cluster").error("Metadata refresh: failed %s", errors.Cancelled())
        logging.getLogger("kafka.cluster").error("Topic %s is not authorized for this client", "t")
        logging.getLogger("kafka.net.selector").warning("Selector got READ event without reader...")
    shown = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert shown == [("kafka.cluster", "ERROR", "Topic t is not authorized for this client"),
                     ("kafka.net.selector", "WARNING", "Selector got READ event without reader...")]
    # A cancellation at close does not replace the real cause quoted in "cannot reach Kafka".
    assert log_setup.KAFKA_CONNECTION_LOGS.last_error() == "ConnectionRefusedError: [Errno 111] ECONNREFUSED"

    caplog.clear()
    log_setup.configure_library_logs("DEBUG")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("kafka.net.selector").warning(slow)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", slow)]


def test_the_demo_output_has_no_library_warnings_or_errors() -> None:
    proc = subprocess.run([*CLI, "demo", "--duration", "3", "--metrics-port", "0"], capture_output=True,
                          text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "final summary" in proc.stdout
    for noise in ("ERROR", "WARNING kafka", "Traceback", "blocking the event loop"):
        assert noise not in output, output
