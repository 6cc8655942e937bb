"""Secrets in the configuration stay secret: `--check-config` of every command shows each setting by its
declared secrecy (never by a substring of its key's name), a URL that carries credentials is refused
wherever a URL is configured, and no error message quotes a secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.sinks.mlflow import MlflowSinkSettings
from tracejudge.consumer.sinks.otlp import OtlpSinkSettings
from tracejudge.metrics.judges.config import JudgeConfigError, load_judges_config

# Each secret is unique, so finding one anywhere in an output names the leak.
SECRETS = {
    "header": "HDR-SECRET-6f1c",
    "query": "QP-SECRET-91ab",
    "header_env": "ENV-SECRET-27cd",
    "api_key": "KEY-SECRET-5e0f",
    "kafka": "KAFKA-SECRET-3d88",
    "otlp_header": "OTLP-SECRET-a41b",
    "mlflow_token": "MLFLOW-SECRET-0c7e",
    "plugin": "PLUGIN-SECRET-77d2",
}
USER, PASSWORD = "alice-user-x9", "hunter2-pw-x9"

CONFIG: dict[str, Any] = {
    "stream": {"topics": ["traces"], "results_topic": "results"},
    "sessions": {"results_topic": "session-results"},
    "agreement": {"labels_topic": "labels"},
    "kafka": {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_plain_username": "svc"},
    "judges": {
        "endpoints": {
            "default": {
                "base_url": "https://judge.example.com/openai/deployments/gpt",
                "model": "gpt-4.1-mini",
                "api_key_env": "JUDGE_KEY_VAR",
                "api_key_header": "api-key",
                "max_tokens_param": "max_completion_tokens",
                "headers": {"Authorization": f"Bearer {SECRETS['header']}", "X-Plain": SECRETS["header"]},
                "headers_from_env": {"X-Tenant-Token": "TENANT_TOKEN_VAR"},
                "query_params": {"sig": SECRETS["query"], "api-version": "2024-06-01"},
            }
        }
    },
    "sink": {
        "plugins": {"acme": "acme_sink:AcmeSink"},
        "acme": {"password": SECRETS["plugin"], "url": f"https://acme.example/api?key={SECRETS['plugin']}",
                 "batch": 10},
        "otlp": {"endpoint": "http://collector.example:4318",
                 "headers": {"authorization": f"Basic {SECRETS['otlp_header']}"}},
        "mlflow": {"tracking_uri": "http://mlflow.example:5000", "token_env": "MLFLOW_TOKEN_VAR"},
    },
}
ENV = {
    "JUDGE_KEY_VAR": SECRETS["api_key"],
    "TENANT_TOKEN_VAR": SECRETS["header_env"],
    "MLFLOW_TOKEN_VAR": SECRETS["mlflow_token"],
    "TRACEJUDGE_KAFKA__SASL_PLAIN_PASSWORD": SECRETS["kafka"],
}
COMMANDS = {
    "run": ["run"],
    "sessions": ["sessions"],
    "agreement": ["agreement"],
    "sink mlflow": ["sink", "mlflow"],
    "sink otlp": ["sink", "otlp"],
}


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "tracejudge.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def tracejudge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line, as a process, at DEBUG so every library may speak."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "--log-level", "DEBUG",
                           *args],
                          capture_output=True, text=True, timeout=120, check=False, env=environ)


ALL_SECRETS = (*SECRETS.values(), USER, PASSWORD)


def leaked(text: str) -> list[str]:
    return [s for s in ALL_SECRETS if s in text]


@pytest.mark.parametrize("command", list(COMMANDS), ids=list(COMMANDS))
def test_check_config_shows_no_secret_and_shows_what_is_not_one(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path, CONFIG)
    proc = tracejudge(*COMMANDS[command], "--config", str(config), "--check-config", env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert not leaked(proc.stdout + proc.stderr), proc.stdout
    assert proc.stdout.strip()
    lines = dict(line.split(" = ", 1) for line in proc.stdout.splitlines() if " = " in line)
    if "kafka.sasl_plain_password" in lines:
        assert lines["kafka.sasl_plain_password"] == '"**********"'
        assert lines["kafka.sasl_plain_username"] == '"svc"'
    if command == "run":
        prefix = "judges.endpoints.default"
        # Declared secrets are masked, each header and query value...
        assert lines[f"{prefix}.headers.Authorization"] == '"**********"'
        assert lines[f"{prefix}.query_params.sig"] == '"**********"'
        # ...and what only has a secret-sounding name is shown as it is.
        assert lines[f"{prefix}.max_tokens_param"] == '"max_completion_tokens"'
        assert lines[f"{prefix}.api_key_env"] == '"JUDGE_KEY_VAR"'
        assert lines[f"{prefix}.api_key_header"] == '"api-key"'
        assert lines[f"{prefix}.headers_from_env.X-Tenant-Token"] == '"TENANT_TOKEN_VAR"'
        # A sink plugin's section is not validated here: its strings are masked, its URL shown redacted.
        assert lines["sink.acme.password"] == '"**********"'
        assert lines["sink.acme.url"] == '"https://acme.example/api?key=**********"'
        assert lines["sink.acme.batch"] == "10"
    if command == "sink otlp":
        assert '"headers": {"authorization": "**********"}' in lines["sink.otlp (effective)"]
        assert '"endpoint": "http://collector.example:4318"' in lines["sink.otlp (effective)"]
    if command == "sink mlflow":  # the sink declares its settings: names of variables are not secrets
        assert '"token_env": "MLFLOW_TOKEN_VAR"' in lines["sink.mlflow (effective)"]


# (command, section path, key, a URL with credentials) -> refused, the key named, nothing of them quoted.
CREDENTIAL_URLS = [
    ("run", ("judges", "endpoints", "default"), "base_url", f"https://{USER}:{PASSWORD}@judge.example.com/v1",
     "judges.endpoints.default.base_url"),
    ("run", ("judges", "endpoints", "default"), "base_url", f"ftp://{USER}:{PASSWORD}@judge.example.com/v1",
     "judges.endpoints.default.base_url"),
    ("sink mlflow", ("sink", "mlflow"), "tracking_uri", f"http://{USER}:{PASSWORD}@mlflow.example:5000",
     "sink.mlflow.tracking_uri"),
    ("sink otlp", ("sink", "otlp"), "endpoint", f"https://{USER}:{PASSWORD}@collector.example:4318",
     "sink.otlp.endpoint"),
    ("sink otlp", ("sink", "otlp"), "endpoint", f"http://{PASSWORD}@collector.example:4318",
     "sink.otlp.endpoint"),
]


@pytest.mark.parametrize(("command", "section", "key", "url", "named"), CREDENTIAL_URLS,
                         ids=[f"{c[0]}-{c[2]}-{c[3].split(':')[0]}" for c in CREDENTIAL_URLS])
def test_a_url_with_credentials_is_refused_naming_the_key(tmp_path: Path, command: str,
                                                          section: tuple[str, ...], key: str, url: str,
                                                          named: str) -> None:
    config = yaml.safe_load(yaml.safe_dump(CONFIG))
    node = config
    for part in section:
        node = node[part]
    node[key] = url
    proc = tracejudge(*COMMANDS[command], "--config", str(write_config(tmp_path, config)), "--check-config",
                      env=ENV)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert "must not carry credentials" in proc.stderr or "must be an http" in proc.stderr, proc.stderr
    assert not leaked(proc.stdout + proc.stderr), proc.stderr


def test_the_mlflow_tracking_uri_from_the_environment_is_refused_too(tmp_path: Path) -> None:
    config = yaml.safe_load(yaml.safe_dump(CONFIG))
    del config["sink"]["mlflow"]["tracking_uri"]
    proc = tracejudge("sink", "mlflow", "--config", str(write_config(tmp_path, config)), "--check-config",
                      env={**ENV, "MLFLOW_TRACKING_URI": f"https://{USER}:{PASSWORD}@mlflow.example"})
    assert proc.returncode == 2
    assert "sink.mlflow.tracking_uri: must not carry credentials" in proc.stderr
    assert "token_env" in proc.stderr  # where the credential belongs
    assert not leaked(proc.stdout + proc.stderr), proc.stderr


@pytest.mark.parametrize("server", [f"{USER}:{PASSWORD}@broker.example:9092",
                                    f"SASL_SSL://{USER}:{PASSWORD}@broker.example:9092"])
def test_a_bootstrap_server_with_credentials_is_refused(server: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={"TRACEJUDGE_KAFKA__BOOTSTRAP_SERVERS": server},
                      overrides={"stream.topics": ["a"]})
    report = exc.value.report()
    assert "kafka.bootstrap_servers (from TRACEJUDGE_KAFKA__BOOTSTRAP_SERVERS)" in report
    assert "sasl_plain_password" in report
    assert not leaked(report)


def test_a_judge_base_url_with_a_query_is_refused_and_its_values_not_quoted() -> None:
    with pytest.raises(JudgeConfigError) as exc:
        load_judges_config({"endpoints": {"default": {"base_url": f"https://j.example/v1?code={PASSWORD}",
                                                      "model": "m"}}})
    assert exc.value.key == "judges.endpoints.default.base_url"
    assert "query_params" in exc.value.detail and PASSWORD not in str(exc.value)
    with pytest.raises(JudgeConfigError) as bad_scheme:
        load_judges_config({"endpoints": {"default": {"base_url": f"file:///etc?k={PASSWORD}",
                                                      "model": "m"}}})
    assert "must be an http(s) URL" in str(bad_scheme.value) and PASSWORD not in str(bad_scheme.value)


@pytest.mark.parametrize(("overrides", "key"), [
    # A wrongly typed value of a declared secret (a header's, a query parameter's) is not echoed.
    ({"judges": {"endpoints": {"default": {"base_url": "https://j.example/v1", "model": "m",
                                           "headers": {"X-Key": {"v": PASSWORD}}}}}},
     "judges.endpoints.default.headers.X-Key"),
    ({"judges": {"endpoints": {"default": {"base_url": "https://j.example/v1", "model": "m",
                                           "query_params": {"sig": [PASSWORD]}}}}},
     "judges.endpoints.default.query_params.sig"),
    # A sink plugin's section that is not a mapping (it may be the secret itself).
    ({"sink": {"plugins": {"acme": "acme_sink:AcmeSink"}, "acme": PASSWORD}}, "sink.acme"),
    # An unvalidated sink section of the wrong type.
    ({"sink": {"otlp": PASSWORD}}, "sink.otlp"),
])
def test_errors_about_secret_values_never_quote_them(tmp_path: Path, overrides: dict[str, Any],
                                                     key: str) -> None:
    config = {"stream": {"topics": ["a"]}, **overrides}
    with pytest.raises(ConfigError) as exc:
        load_settings(write_config(tmp_path, config), environ={})
    report = exc.value.report()
    assert key in report, report
    assert PASSWORD not in report


def test_declared_secrets_stay_out_of_reprs(tmp_path: Path) -> None:
    """A repr is what a traceback, a debugger or a careless log line shows."""
    settings = load_settings(write_config(tmp_path, CONFIG), environ=ENV)
    endpoint = settings.judges.endpoints["default"] if settings.judges else None
    assert endpoint is not None and endpoint.query_params["sig"] == SECRETS["query"]
    assert not leaked(repr(endpoint) + str(endpoint) + repr(settings.kafka))


def test_the_sinks_own_settings_mask_what_they_declare_secret() -> None:
    otlp = OtlpSinkSettings.from_mapping({"headers": {"authorization": f"Bearer {SECRETS['otlp_header']}"}},
                                         env={"OTEL_EXPORTER_OTLP_HEADERS": f"x-token={SECRETS['plugin']}"})
    shown = otlp.redacted()
    assert shown["headers"] == {"authorization": "**********", "x-token": "**********"}
    assert not leaked(repr(shown) + repr(otlp))
    mlflow = MlflowSinkSettings.from_mapping({"tracking_uri": "http://mlflow.example:5000",
                                              "token_env": "MY_TOKEN"}, env={"MY_TOKEN": PASSWORD})
    assert mlflow.redacted()["token_env"] == "MY_TOKEN"
    assert PASSWORD not in repr(mlflow.redacted()) + repr(mlflow)
    with pytest.raises(ConfigError) as exc:
        OtlpSinkSettings.from_mapping({"headers_env": f"authorization=Bearer {PASSWORD}"}, env={})
    assert "sink.otlp.headers_env" in exc.value.report() and PASSWORD not in exc.value.report()
