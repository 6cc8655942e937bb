"""Traces from real agent frameworks and their real instrumentation libraries, derived right.

Each app in `tests/support/instrumented/apps/` is a small real program on an agent framework, traced
by that framework's instrumentor from PyPI and run against the loopback OpenAI stub
(`support/instrumented/harness.py`). It states what it actually did per case: the question, the
answer the framework returned, the documents its retriever returned, the tools that ran, whether it
failed; the harness adds the token usage the stub answered each model call with.

`LIVE` apps install beside the test extra and run on every test run; the others pin versions that
conflict with it, so their output is a checked-in fixture (`tests/fixtures/instrumented/<app>/`,
made by `support/instrumented/generate.py` from a pinned requirements file). The same assertions
run on both: their spans go through `tracejudge eval` as OTLP/JSON, and through the broker and the
stream runner as the OTLP protobuf the SDK's encoder wrote.
"""

from __future__ import annotations

import base64
import json
import pathlib
import signal
import subprocess
import sys
from typing import Any

import orjson
import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from support.kafka import RunnerProcess, produce, read_topic, unique

HERE = pathlib.Path(__file__).resolve().parent
HARNESS = HERE / "support" / "instrumented" / "harness.py"
FIXTURES = HERE / "fixtures" / "instrumented"

# Apps whose framework and instrumentor are in the test extra (pyproject.toml): run live.
LIVE: tuple[str, ...] = (
    "fastapi_openai", "langchain_rag", "langgraph_agent", "openai_agents", "openai_genai",
    "openai_genai_events", "openai_openinference", "pydantic_ai_agent", "traceloop_langchain",
)
# Apps whose instrumentor records no token usage on any span: their records' tokens are None, never
# guessed. DSPy's instrumentation traces `LM.__call__` with the text only; LiteLLM's usage, which
# DSPy calls through, is not in the trace.
NO_USAGE = {"dspy_react"}
FIXTURE_APPS = tuple(sorted(p.parent.name for p in FIXTURES.glob("*/traces.json")))
APPS = tuple(sorted({*LIVE, *(f"{a}[fixture]" if a in LIVE else a for a in FIXTURE_APPS)}))


def _run_live(app: str, out: pathlib.Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HARNESS), app, str(out)], capture_output=True, text=True,
                          timeout=240)
    if proc.returncode != 0:
        raise AssertionError(f"app {app} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every app's output: live apps run now (in parallel, each in its own process), the rest read."""
    tmp = tmp_path_factory.mktemp("instrumented")
    procs = {app: subprocess.Popen([sys.executable, str(HARNESS), app, str(tmp / f"{app}.json")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for app in LIVE}
    out: dict[str, dict[str, Any]] = {}
    for app, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"app {app} failed (exit {proc.returncode}):\n{err[-4000:]}")
        out[app] = json.loads((tmp / f"{app}.json").read_text())
    for app in FIXTURE_APPS:
        # A live app's fixture stays under test too: the shapes it recorded are what a user on
        # those versions sends.
        name = f"{app}[fixture]" if app in LIVE else app
        out[name] = json.loads((FIXTURES / app / "traces.json").read_text())
    return out


@pytest.fixture(scope="module")
def evaluated(outputs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, dict[str, Any]]:
    """`tracejudge eval` over one OTLP/JSON line per app: result lines by trace id."""
    tmp = tmp_path_factory.mktemp("eval")
    src, dst = tmp / "spans.jsonl", tmp / "results.jsonl"
    lines = []
    for doc in outputs.values():
        lines.append(orjson.dumps(doc["otlp_json"]))
        if doc.get("otlp_logs_json"):  # content the instrumentor wrote as log records
            lines.append(orjson.dumps(doc["otlp_logs_json"]))
    src.write_bytes(b"\n".join(lines) + b"\n")
    proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(src), "-o",
                           str(dst),
                           "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Trace result lines (the session result lines of apps that state a session are another shape).
    results = map(json.loads, dst.read_text().splitlines())
    return {r["trace_id"]: r for r in results if r.get("kind") != "session"}


def mismatches(case: dict[str, Any], got: dict[str, Any], *, usage: bool = True) -> list[str]:
    """What the result line says that differs from what the app did, one line each."""
    where = f"{case['case']}:"
    wrong = []

    def check(field: str, want: Any, have: Any) -> None:
        if want != have:
            wrong.append(f"{where} {field}: want {want!r:.200}, got {have!r:.200}")

    check("request", case["request"], got["request"])
    check("response", case["response"], got["response"])
    want_context = None if case["context"] is None else [list(d) for d in case["context"]]
    have_context = (None if got["retrieved_context"] is None
                    else [[d["content"], d.get("doc_uri")] for d in got["retrieved_context"]])
    check("retrieved_context", want_context, have_context)
    check("tools", case["tools"], [t["tool_name"] for t in got["trajectory"] or []])
    check("failed", case["failed"], got["failed"])
    # A tool's input is the call's arguments, not the instrumentation's wrapper around them
    # (OpenLLMetry's {"input_str", "inputs", "kwargs", ...}, OpenInference's {"kwargs": ...}).
    for step in got["trajectory"] or []:
        if isinstance(step.get("tool_input"), dict) and {"input_str", "kwargs"} & set(step["tool_input"]):
            wrong.append(f"{where} {step['tool_name']}'s tool_input is a wrapper: {step['tool_input']!r:.80}")
    if not usage:
        check("tokens", None, got["tokens"])
        return wrong
    tokens = got["tokens"] or {}
    check("output tokens", case["chat_output_tokens"] or None, tokens.get("output"))
    # Embedding calls count where the instrumentor records their usage (each model call once).
    chat, embedding = case["chat_input_tokens"], case["embedding_tokens"]
    inputs = {chat or None, (chat + embedding) or None}
    if tokens.get("input") not in inputs:
        wrong.append(f"{where} input tokens: want one of {sorted(inputs, key=str)}, "
                     f"got {tokens.get('input')}")
    return wrong


def _service(doc: dict[str, Any]) -> str:
    """The service.name the app's resource states (the `app` of every result)."""
    names = {a["value"]["stringValue"] for rs in doc["otlp_json"]["resourceSpans"]
             for a in rs["resource"]["attributes"] if a["key"] == "service.name"}
    assert len(names) == 1, names
    return names.pop()


@pytest.mark.parametrize("app", APPS)
def test_eval_derives_what_the_app_did(app: str, outputs: dict[str, dict[str, Any]],
                                       evaluated: dict[str, dict[str, Any]]) -> None:
    doc = outputs[app]
    assert doc["cases"], f"{app} recorded no case"
    wrong = []
    for case in doc["cases"]:
        got = evaluated.get(case["trace_id"])
        if got is None:
            wrong.append(f"{case['case']}: no result for trace {case['trace_id']}")
            continue
        wrong += mismatches(case, got, usage=app.removesuffix("[fixture]") not in NO_USAGE)
        if got["app"] != _service(doc):
            wrong.append(f"{case['case']}: app: want {_service(doc)!r}, got {got['app']!r}")
    assert not wrong, f"{app} ({doc['versions']}):\n" + "\n".join(wrong)


def test_every_app_covers_a_failure_and_the_suite_covers_tools_retrieval_and_recovery(
        outputs: dict[str, dict[str, Any]]) -> None:
    cases = [c for doc in outputs.values() for c in doc["cases"]]
    assert all(any(c["failed"] for c in doc["cases"]) for doc in outputs.values()), \
        [app for app, doc in outputs.items() if not any(c["failed"] for c in doc["cases"])]
    assert any(c["context"] for c in cases) and any(c["tools"] for c in cases)
    # A tool that raised and was recovered from: the case ran a tool and did not fail.
    assert any(c["tools"] and not c["failed"] and "raise" in (c["note"] + c["case"]) for c in cases)


def logs_proto(doc: dict[str, Any]) -> bytes:
    """OTLP/JSON logs (hex ids) as the protobuf the SDK's OTLP log exporter sends."""
    doc = json.loads(json.dumps(doc))
    for rl in doc["resourceLogs"]:
        for sl in rl["scopeLogs"]:
            for rec in sl["logRecords"]:
                for key in ("traceId", "spanId"):
                    if rec.get(key):
                        rec[key] = base64.b64encode(bytes.fromhex(rec[key])).decode()
    return ParseDict(doc, ExportLogsServiceRequest()).SerializeToString()


def test_the_stream_derives_the_same_records(outputs: dict[str, dict[str, Any]],
                                             evaluated: dict[str, dict[str, Any]], broker) -> None:
    """The same spans as OTLP protobuf records (and the content log records on a logs topic) through
    the broker and the real `tracejudge run` process."""
    bs = broker.bootstrap_servers
    topic, results, group = unique("instrumented"), unique("results"), unique("group")
    values = [base64.b64decode(doc["otlp_proto_b64"]) for doc in outputs.values()]
    produce(bs, topic, values)
    # Content log records go to their own topic, as the Collector's Kafka exporter writes logs.
    logs_topic = unique("instrumented-logs")
    logs = [logs_proto(doc["otlp_logs_json"]) for doc in outputs.values() if doc.get("otlp_logs_json")]
    assert logs, "no app writes content as log records"
    produce(bs, logs_topic, logs)
    trace_ids = {c["trace_id"] for doc in outputs.values() for c in doc["cases"]}
    runner = RunnerProcess(bs, "--topic", f"{topic}:otlp_proto", "--topic", f"{logs_topic}:otlp_logs_proto",
                           "--group-id", group, "--results-topic", results,
                           env={"TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S": "2",
                                "TRACEJUDGE_OTLP__ASSEMBLY__MAX_WAIT_S": "10"}).wait_ready()
    try:
        out = read_topic(bs, results, at_least=len(trace_ids), timeout=60)
        # Every trace was whole when it left assembly: no span or log record came after its trace.
        assert runner.metric("tracejudge_assembly_spans_total") > 0
        assert runner.metric("tracejudge_assembly_late_spans_total") == 0
        assert runner.metric("tracejudge_assembly_traces_emitted_total", reason="complete") == len(trace_ids)
    finally:
        runner.signal(signal.SIGTERM)
        assert runner.finish(60) == 0
    streamed = {orjson.loads(r.value)["trace_id"]: orjson.loads(r.value) for r in out}
    fields = ("request", "response", "retrieved_context", "trajectory", "tokens", "failed", "app")
    for trace_id in trace_ids:
        assert {f: streamed[trace_id][f] for f in fields} == {f: evaluated[trace_id][f] for f in fields}
