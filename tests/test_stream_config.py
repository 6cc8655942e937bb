"""`tracejudge run` settings: YAML < TRACEJUDGE_* environment < flags, errors naming the key, secrets."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from tracejudge.consumer.commands.run import add_arguments, main, settings_from_args
from tracejudge.consumer.config import ConfigError, load_settings

SECRET = "s3cr3t-Pa55"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level")  # the `tracejudge` command's top-level flag
    add_arguments(parser)
    return parser.parse_args(argv)


def problems(exc: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(exc.value.problems)


def test_layers_yaml_then_environment_then_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("""
kafka:
  bootstrap_servers: [kafka-1:9092, kafka-2:9092]
  group_id: from-file
  session_timeout_ms: 30000
stream:
  topics:
    - {name: spans, format: otlp_proto}
    - traces:mlflow
  results_topic: results
http: {port: 9100}
""")
    env = {"TRACEJUDGE_KAFKA__GROUP_ID": "from-env", "TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS": "12000",
           "TRACEJUDGE_STREAM__MAX_IN_FLIGHT": "64", "TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S": "2.5",
           "UNRELATED": "x", "TRACEJUDGE_SINGLE": "ignored: not SECTION__KEY"}
    s = load_settings(cfg, environ=env, overrides={"kafka.group_id": "from-flag", "http.port": None})
    assert s.kafka.bootstrap_servers == ["kafka-1:9092", "kafka-2:9092"]
    assert s.kafka.group_id == "from-flag"
    assert s.kafka.session_timeout_ms == 12000
    assert [(t.name, t.format) for t in s.stream.topics] == [("spans", "otlp_proto"), ("traces", "mlflow")]
    assert s.stream.results_topic == "results" and s.stream.max_in_flight == 64
    assert s.otlp.assembly.quiet_period_s == 2.5
    assert s.http.port == 9100  # a flag left unset does not override


def test_defaults_match_an_at_least_once_consumer():
    s = load_settings(environ={}, overrides={"stream.topics": ["traces"]})
    consumer = s.kafka.consumer_config()
    assert consumer["enable_auto_commit"] is False
    assert consumer["auto_offset_reset"] == "earliest"
    assert (consumer["session_timeout_ms"], consumer["heartbeat_interval_ms"]) == (10000, 2000)
    assert s.http.port == 9464 and s.stream.topics[0].format == "auto"
    assert s.judges is None  # no judges unless the section is there


def test_flags_map_onto_keys():
    args = parse("--log-level", "debug", "--bootstrap-servers", "b1:9092,b2:9093", "--topic", "a",
                 "--topic", "b:inference_log",
                 "--group-id", "g", "--metrics-port", "9999", "--results-topic", "r",
                 "--dead-letter-topic", "d", "--metrics-bind-address", "127.0.0.1")
    s = settings_from_args(args)
    assert s.kafka.bootstrap_servers == ["b1:9092", "b2:9093"] and s.kafka.group_id == "g"
    assert [str(t) for t in s.stream.topics] == ["a:auto", "b:inference_log"]
    assert (s.stream.results_topic, s.stream.dead_letter_topic) == ("r", "d")
    assert (s.http.port, s.http.bind_address, s.logging.level) == (9999, "127.0.0.1", "DEBUG")


def test_environment_lists_are_comma_separated():
    s = load_settings(environ={"TRACEJUDGE_STREAM__TOPICS": "a:mlflow, b",
                               "TRACEJUDGE_KAFKA__BOOTSTRAP_SERVERS": "k1:9092,k2:9092"})
    assert [str(t) for t in s.stream.topics] == ["a:mlflow", "b:auto"]
    assert s.kafka.bootstrap_servers == ["k1:9092", "k2:9092"]


def test_every_bad_key_is_named_with_where_its_value_came_from(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("kafka:\n  session_timeout_ms: 0\n  max_pol_records: 5\nstream:\n  topics: [ok]\n"
                   "  max_record_bytes: lots\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(cfg, environ={"TRACEJUDGE_HTTP__PORT": "70000"},
                      overrides={"stream.topics": ["t:protobuf"]})
    got = problems(exc)
    assert got[f"kafka.session_timeout_ms (from {cfg})"] == "must be > 0, got 0"
    assert got[f"kafka.max_pol_records (from {cfg})"] == "unknown key; did you mean 'max_poll_records'?"
    assert got[f"stream.max_record_bytes (from {cfg})"] == "must be an integer, got 'lots'"
    assert got["http.port (from TRACEJUDGE_HTTP__PORT)"] == "must be <= 65535, got '70000'"
    assert got["stream.topics[0].format (from --topic)"].startswith("must be one of 'auto', 'agent_eval'")
    assert exc.value.report().startswith("invalid configuration:\n  kafka.session_timeout_ms")


@pytest.mark.parametrize(("overrides", "key", "message"), [
    ({}, "stream.topics", "at least one topic is required"),
    ({"stream.topics": ["a", "a:mlflow"]}, "stream.topics[1]", "topic 'a' is listed twice"),
    ({"stream.topics": ["a"], "stream.results_topic": "a"}, "stream.results_topic", "also a consumed topic"),
    ({"stream.topics": ["bad topic"]}, "stream.topics[0].name", "not a valid Kafka topic name"),
    ({"stream.topics": ["a"], "kafka.bootstrap_servers": "kafka"}, "kafka.bootstrap_servers",
     "'kafka' is not host:port"),
    ({"stream.topics": ["a"], "kafka.heartbeat_interval_ms": 10000}, "kafka.heartbeat_interval_ms",
     "must be lower than session_timeout_ms (10000)"),
    ({"stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL"}, "kafka.sasl_mechanism",
     "is required with security_protocol SASL_SSL"),
    ({"stream.topics": ["a"], "kafka.sasl_mechanism": "PLAIN"}, "kafka.security_protocol",
     "must be SASL_SSL or SASL_PLAINTEXT"),
    ({"stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL", "kafka.sasl_mechanism": "SCRAM-SHA-512",
      "kafka.sasl_plain_username": "svc"}, "kafka.sasl_plain_password", "is required with sasl_mechanism"),
    ({"stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL", "kafka.sasl_mechanism": "OAUTHBEARER"},
     "kafka.sasl_oauth_token_provider", "exactly one of"),
    ({"stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL", "kafka.sasl_mechanism": "OAUTHBEARER",
      "kafka.sasl_oauth_token_provider": "no_such_module_xyz:Provider"}, "kafka.sasl_oauth_token_provider",
     "cannot import 'no_such_module_xyz'"),
    ({"stream.topics": ["a"], "kafka.security_protocol": "SSL", "kafka.ssl_cafile": "/nonexistent/ca.pem"},
     "kafka.ssl_cafile", "does not exist"),
    ({"stream.topics": ["a"], "otlp.assembly.quiet_period_s": 90}, "otlp.assembly.max_wait_s",
     "must be at least quiet_period_s"),
])
def test_cross_field_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={}, overrides=overrides)
    named = {k.split(" (from")[0]: m for k, m in exc.value.problems}
    assert key in named, exc.value.report()
    assert message in named[key]


def test_yaml_syntax_and_file_errors_are_config_errors(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("kafka:\n  group_id: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+"):
        load_settings(bad, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", environ={})
    listing = tmp_path / "list.yaml"
    listing.write_text("- kafka\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_settings(listing, environ={})


def test_security_settings_pass_through_to_the_clients(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    token = tmp_path / "token"
    token.write_text("eyJ-first\n")
    s = load_settings(environ={"TRACEJUDGE_KAFKA__SSL_PASSWORD": SECRET}, overrides={
        "stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL", "kafka.sasl_mechanism": "OAUTHBEARER",
        "kafka.sasl_oauth_token_file": str(token), "kafka.ssl_cafile": str(ca)})
    cfg = s.kafka.client_config()
    assert cfg["security_protocol"] == "SASL_SSL" and cfg["sasl_mechanism"] == "OAUTHBEARER"
    assert cfg["ssl_cafile"] == str(ca) and cfg["ssl_password"] == SECRET
    provider = cfg["sasl_oauth_token_provider"]
    assert provider.token() == "eyJ-first"
    token.write_text("eyJ-rotated\n")  # a rotated mounted secret is read at the next authentication
    assert provider.token() == "eyJ-rotated"
    scram = load_settings(environ={}, overrides={
        "stream.topics": ["a"], "kafka.security_protocol": "SASL_SSL",
        "kafka.sasl_mechanism": "SCRAM-SHA-256", "kafka.sasl_plain_username": "svc",
        "kafka.sasl_plain_password": SECRET}).kafka
    assert scram.consumer_config()["sasl_plain_password"] == SECRET
    assert SECRET not in repr(scram) and SECRET not in str(scram.model_dump())


def test_secrets_never_appear_in_the_effective_config_or_in_errors(capsys):
    env = {"TRACEJUDGE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "TRACEJUDGE_KAFKA__SASL_MECHANISM": "PLAIN",
           "TRACEJUDGE_KAFKA__SASL_PLAIN_USERNAME": "svc", "TRACEJUDGE_KAFKA__SASL_PLAIN_PASSWORD": SECRET}
    s = load_settings(environ=env, overrides={"stream.topics": ["a"]})
    shown = s.redacted()
    assert shown["kafka.sasl_plain_password"] == "**********"
    assert SECRET not in repr(shown)
    # An invalid secret value is reported without echoing it.
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={**env, "TRACEJUDGE_KAFKA__SSL_CAFILE": "/no"},
                      overrides={"stream.topics": ["a"], "kafka.sasl_plain_password": {"v": SECRET}})
    assert SECRET not in exc.value.report()


def test_check_config_prints_the_redacted_settings(capsys, monkeypatch):
    monkeypatch.setenv("TRACEJUDGE_KAFKA__SASL_PLAIN_PASSWORD", SECRET)
    assert main(parse("--topic", "traces:mlflow", "--check-config")) == 0
    out = capsys.readouterr().out
    assert 'stream.topics = ["traces:mlflow"]' in out
    assert 'kafka.sasl_plain_password = "**********"' in out and SECRET not in out


def test_invalid_configuration_exits_2_before_connecting_to_anything():
    # The bootstrap server is a loopback socket that listens and never answers: a connection attempt
    # would sit in its backlog (accept() finds it after the process is gone). The config error comes
    # first, so there is none; no clock is involved.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.run",
                               "--bootstrap-servers", f"127.0.0.1:{listener.getsockname()[1]}",
                               "--topic", "traces", "--metrics-port", "-1"],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={"PATH": "/usr/bin:/bin", "TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS": "0"})
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert proc.returncode == 2, proc.stderr
    assert "http.port (from --metrics-port): must be >= 0, got -1" in proc.stderr
    assert "kafka.session_timeout_ms (from TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS): must be > 0" in proc.stderr


def test_a_custom_metric_that_cannot_be_imported_is_a_config_error(capsys):
    from tracejudge.consumer.stages.run import StreamRunner

    s = load_settings(environ={}, overrides={"stream.topics": ["a"]})
    s.metrics.custom.append(type(s.metrics).model_validate(
        {"custom": [{"name": "mine", "function": "no_such_module_xyz:fn"}]}).custom[0])
    with pytest.raises(ConfigError) as exc:
        StreamRunner(s)
    assert exc.value.problems[0][0] == "metrics.custom[mine].function"
    assert "cannot import 'no_such_module_xyz'" in exc.value.problems[0][1]


def test_the_startup_summary_names_every_setting_but_no_secret(caplog):
    from tracejudge.consumer.stages.run import StreamRunner

    env = {"TRACEJUDGE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
           "TRACEJUDGE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
           "TRACEJUDGE_KAFKA__SASL_PLAIN_USERNAME": "svc", "TRACEJUDGE_KAFKA__SASL_PLAIN_PASSWORD": SECRET}
    runner = StreamRunner(load_settings(environ=env, overrides={"stream.topics": ["traces"]}))
    with caplog.at_level("INFO", logger="tracejudge.run"):
        runner._log_effective_config()
    text = caplog.text
    assert "kafka.sasl_mechanism = SCRAM-SHA-512" in text and "stream.topics = ['traces:auto']" in text
    assert "kafka.sasl_plain_password = **********" in text and SECRET not in text
