"""`tracejudge eval DATASET --app MODULE:FUNCTION | --app-endpoint URL`: the user's app run over a dataset,
its answers evaluated by a real judge endpoint (the loopback OpenAI-compatible stub deciding correctness
by the expected answer's facts), the app a real Python function or a real chat completions server.
The retrieval metrics (hit rate, MRR, recall by doc_uri) are checked on hand-computed cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.eval_apps import DATASET, FLIPPED, KNOWLEDGE, app_responder, correctness_responder, good_app
from support.openai_stub import OpenAIStub, Reply, wait_until

from tracejudge.consumer.commands.eval_app import AppError, answer_from, app_messages, split_url
from tracejudge.metrics.computed import ComputedMetrics
from tracejudge.metrics.retrieval import first_hit_rank, retrieval_ranks
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import EvaluationResult

REPO = Path(__file__).resolve().parents[1]
TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
APPS = "tests.support.eval_apps"


@pytest.fixture(scope="module")
def judge() -> Iterator[OpenAIStub]:
    with OpenAIStub(correctness_responder) as s:
        yield s


@pytest.fixture
def files(tmp_path: Path, judge: OpenAIStub) -> dict[str, Path]:
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in DATASET))
    config = tmp_path / "judges.yaml"
    config.write_text(json.dumps({"judges": {
        "endpoints": {"default": {"base_url": judge.base_url, "model": "judge-model",
                                  "backoff_initial_seconds": 0.01}},
        "sample_rate": 1.0, "builtin": {"correctness": {}}}}))
    return {"dataset": dataset, "config": config, "out": tmp_path / "results.jsonl"}


def run(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    return subprocess.run([*TRACEJUDGE, "eval", *args], capture_output=True, text=True, timeout=180,
                          check=False, cwd=cwd, env={**clean, **(env or {})})


def results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def verdicts(rows: list[dict[str, Any]], judge: str = "correctness") -> list[str]:
    return [EvaluationResult.from_dict(r).statuses.get(judge, "-") for r in rows]


def retrieval(row: dict[str, Any]) -> tuple[float, float, float]:
    m = row["metrics"]
    return m["retrieval_hit_rate"], m["retrieval_mrr"], m["document_recall"]


def eval_app(files: dict[str, Path], *flags: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run(str(files["dataset"]), "--config", str(files["config"]), "-o", str(files["out"]), *flags, **kw)


# ------------------------------------------------------------------ a Python function as the app


def test_the_good_app_passes_correctness_and_the_broken_app_fails_it(files):
    good = eval_app(files, "--app", f"{APPS}:good_app")
    assert good.returncode == 0, good.stderr
    rows = results(files["out"])
    assert [r["request"] for r in rows] == [q for q, _, _ in KNOWLEDGE]
    assert verdicts(rows) == ["passed"] * len(KNOWLEDGE)
    assert all(r["response"] == a for r, (_, a, _) in zip(rows, KNOWLEDGE, strict=True))
    # The right document was retrieved first for every question: hit rate, MRR and recall are all 1.
    assert {retrieval(r) for r in rows} == {(1.0, 1.0, 1.0)}
    assert "app (callable): 12 rows called, 12 answered, 0 app errors" in good.stderr

    broken = eval_app(files, "--app", f"{APPS}:broken_app")
    assert broken.returncode == 0, broken.stderr  # no gate asked for: the verdicts are in the results
    rows = results(files["out"])
    assert verdicts(rows) == ["failed"] * len(KNOWLEDGE)
    assert {retrieval(r) for r in rows} == {(0.0, 0.0, 0.0)}
    assert all(r["failed"] is None and r["error"] is None for r in rows)


def test_the_retrieved_document_at_rank_two_gives_mrr_one_half(files):
    proc = eval_app(files, "--app", f"{APPS}:second_rank_app", "--fail-under", "correctness=1")
    assert proc.returncode == 0, proc.stderr
    rows = results(files["out"])
    assert {r["metrics"]["retrieval_mrr"] for r in rows} == {0.5}
    assert {r["metrics"]["retrieval_hit_rate"] for r in rows} == {1.0}
    assert "mean retrieval_mrr           0.5  (n=12)" in proc.stderr


def test_async_and_plain_text_functions_and_a_module_in_the_current_directory(files, tmp_path):
    (tmp_path / "shop_app.py").write_text(
        "from tests.support.eval_apps import good_app\n\n"
        "def answer(request):\n"
        "    return good_app(request)['response']\n")
    env = {"PYTHONPATH": str(REPO)}
    plain = eval_app(files, "--app", "shop_app:answer", cwd=tmp_path, env=env)
    assert plain.returncode == 0, plain.stderr
    rows = results(files["out"])
    assert verdicts(rows) == ["passed"] * len(KNOWLEDGE)
    # It states no retrieval: as for document_recall, nothing retrieved is nothing found.
    assert all(r["retrieved_context"] is None and retrieval(r) == (0.0, 0.0, 0.0) for r in rows)
    asynchronous = eval_app(files, "--app", f"{APPS}:async_good_app", "--app-concurrency", "4")
    assert asynchronous.returncode == 0, asynchronous.stderr
    assert verdicts(results(files["out"])) == ["passed"] * len(KNOWLEDGE)


def test_app_errors_are_counted_reported_and_never_a_pass(files, tmp_path):
    """An exception, an answer that is not one, a call that outlives --app-timeout: each is that row's
    error (a failed trace every judge skips), the other rows are evaluated, nothing is lost."""
    (tmp_path / "unreliable.py").write_text(
        "import threading\n"
        "from tests.support.eval_apps import KNOWLEDGE, good_app, question_of\n"
        "NEVER = threading.Event()\n\n"
        "def answer(request):\n"
        "    q = question_of(request)\n"
        "    if q == KNOWLEDGE[0][0]:\n"
        "        NEVER.wait()\n"
        "    if q == KNOWLEDGE[1][0]:\n"
        "        return 42\n"
        "    if q == KNOWLEDGE[3][0]:\n"
        "        raise RuntimeError('the warranty service is down')\n"
        "    return good_app(request)\n")
    env = {"PYTHONPATH": str(REPO)}
    proc = eval_app(files, "--app", "unreliable:answer", "--app-timeout", "1", "--app-concurrency", "3",
                    cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr
    rows = results(files["out"])
    assert [r["request"] for r in rows] == [q for q, _, _ in KNOWLEDGE]
    errors = {i: r["error"] for i, r in enumerate(rows) if r["failed"]}
    assert sorted(errors) == [0, 1, 3]
    assert errors[0].startswith("app call failed (timeout): no answer within 1s")
    assert errors[1].startswith("app call failed (invalid_answer): returned int")
    assert errors[3] == "app call failed (exception): RuntimeError: the warranty service is down"
    assert [rows[i]["assessments"][0]["skipped"] for i in (0, 1, 3)] == ["failed_trace"] * 3
    statuses = verdicts(rows)
    assert [statuses[i] for i in range(len(rows)) if i not in errors] == ["passed"] * 9
    dataset = str(files["dataset"])
    assert f"{dataset}:4: app error (exception): RuntimeError: the warranty service is down" in proc.stderr
    assert "12 rows called, 9 answered, 3 app errors" in proc.stderr
    assert "3 of 12 rows got no answer" in proc.stderr and "over --max-app-errors 0" in proc.stderr
    allowed = eval_app(files, "--app", "unreliable:answer", "--app-timeout", "1", "--app-concurrency", "3",
                       "--max-app-errors", "25%", cwd=tmp_path, env=env)
    assert allowed.returncode == 0, allowed.stderr


# ------------------------------------------------------------------ an HTTP endpoint as the app


def test_an_endpoint_app_answers_out_of_order_and_the_results_keep_the_dataset_order(files, tmp_path):
    """The first question's answer is held until the app has been asked three more (four calls in
    flight): later rows are answered first, and the results are still in the dataset's order, with the
    endpoint's retrieved context and token usage. A row given as chat messages is sent as those."""
    first = threading.Event()
    chat_row = {"request": {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": KNOWLEDGE[5][0]}]},
                "expected_response": KNOWLEDGE[5][1]}
    files["dataset"].write_text("".join(json.dumps(r) + "\n" for r in [*DATASET, chat_row]))
    with OpenAIStub(app_responder(good_app, holds={KNOWLEDGE[0][0]: first})) as app:
        def release() -> None:
            wait_until(lambda: app.count("/chat/completions") >= 4)
            first.set()

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        proc = eval_app(files, "--app-endpoint", app.base_url + "/chat/completions", "--app-model", "shop-v2",
                        "--app-concurrency", "4")
        releaser.join(10)
        sent = [r.body for r in app.chat_requests()]
    assert proc.returncode == 0, proc.stderr
    rows = results(files["out"])
    assert [r["source"]["line"] for r in rows] == list(range(1, len(KNOWLEDGE) + 2))
    assert [r["request"] for r in rows] == [*(q for q, _, _ in KNOWLEDGE), KNOWLEDGE[5][0]]
    assert verdicts(rows) == ["passed"] * (len(KNOWLEDGE) + 1)
    assert all(r["tokens"]["total"] == 28 and r["retrieved_context"][0]["doc_uri"].startswith("kb://")
               for r in rows)
    assert len(sent) == len(KNOWLEDGE) + 1 and {b["model"] for b in sent} == {"shop-v2"}
    roles = sorted(tuple(m["role"] for m in b["messages"]) for b in sent
                   if b["messages"][-1]["content"] == KNOWLEDGE[5][0])
    assert roles == [("system", "user"), ("user",)]


def test_endpoint_errors_after_retries_and_timeouts_are_row_errors_with_the_key_masked(files):
    key = "sk-app-secret-7f3a9c"
    failing = {KNOWLEDGE[2][0]: Reply.error(503, f"backend down for key {key}"),
               KNOWLEDGE[4][0]: Reply(hold=threading.Event())}
    with OpenAIStub(app_responder(good_app, failing=failing)) as app:
        proc = eval_app(files, "--app-endpoint", app.base_url, "--app-api-key-env", "SHOP_APP_KEY",
                        "--app-retries", "1", "--app-timeout", "1", env={"SHOP_APP_KEY": key})
        auth = {r.headers.get("authorization") for r in app.chat_requests()}
        tries = sum(1 for r in app.chat_requests() if r.body["messages"][-1]["content"] == KNOWLEDGE[2][0])
    assert proc.returncode == 1, proc.stderr
    assert auth == {f"Bearer {key}"} and tries == 2  # the first call and one retry
    rows = results(files["out"])
    assert len(rows) == len(KNOWLEDGE)
    assert rows[2]["failed"] and rows[2]["error"].startswith("app call failed (http_5xx): HTTP 503")
    assert rows[4]["failed"] and rows[4]["error"].startswith("app call failed (timeout)")
    assert all(not r["failed"] for i, r in enumerate(rows) if i not in (2, 4))
    everything = proc.stdout + proc.stderr + files["out"].read_text()
    assert key not in everything and "***" in rows[2]["error"]


def test_usage_errors_exit_2_naming_the_flag(files, tmp_path):
    both = eval_app(files, "--app", f"{APPS}:good_app", "--app-endpoint", "http://127.0.0.1:9/v1")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    alone = eval_app(files, "--app-model", "x")
    assert alone.returncode == 2 and "--app-model applies to the app" in alone.stderr
    missing = eval_app(files, "--app", "no_such_module_here:answer")
    assert missing.returncode == 2 and "--app: cannot import 'no_such_module_here'" in missing.stderr
    no_key = eval_app(files, "--app-endpoint", "http://127.0.0.1:9/v1", "--app-api-key-env",
                      "NO_SUCH_VAR_XYZ")
    assert no_key.returncode == 2 and "NO_SUCH_VAR_XYZ: the environment variable is not set" in no_key.stderr
    fmt = eval_app(files, "--app", f"{APPS}:good_app", "--format", "mlflow")
    assert fmt.returncode == 2 and "--format mlflow" in fmt.stderr
    for proc in (both, alone, missing, no_key, fmt):
        assert "Traceback" not in proc.stderr
    assert not files["out"].exists()


def test_a_line_that_is_not_a_dataset_row_is_rejected_and_the_rest_run(files):
    trace_line = json.dumps({"info": {"trace_id": "tr-1"}, "data": {"spans": []}})
    lines = [json.dumps(DATASET[0]), "{oops", trace_line, json.dumps(DATASET[1])]
    files["dataset"].write_text("".join(line + "\n" for line in lines))
    proc = eval_app(files, "--app", f"{APPS}:good_app")
    assert proc.returncode == 0, proc.stderr
    assert [r["request"] for r in results(files["out"])] == [DATASET[0]["request"], DATASET[1]["request"]]
    assert f"{files['dataset']}:2: rejected (invalid_json)" in proc.stderr
    assert "rejected lines               2" in proc.stderr


# ------------------------------------------------------------------ the pieces, by hand


def docs(*uris: str | None) -> list[Document]:
    return [Document(content=f"chunk {i}", doc_uri=u) for i, u in enumerate(uris)]


@pytest.mark.parametrize(("retrieved", "expected", "rank", "hit", "mrr", "recall"), [
    (("a", "b", "c"), ("a",), 1, 1.0, 1.0, 1.0),
    (("x", "a", "c"), ("a",), 2, 1.0, 0.5, 1.0),
    (("x", None, "y", "b"), ("a", "b"), 4, 1.0, 0.25, 0.5),     # a chunk without doc_uri takes a place
    (("x", "x", "a"), ("a", "b"), 3, 1.0, 1 / 3, 0.5),          # as does a second chunk of one document
    (("x", "y"), ("a",), 0, 0.0, 0.0, 0.0),
    ((), ("a",), 0, 0.0, 0.0, 0.0),                            # nothing retrieved: nothing found
])
def test_hit_rate_mrr_and_recall_on_hand_checked_cases(retrieved, expected, rank, hit, mrr, recall):
    record = EvalRecord(retrieved_context=docs(*retrieved), expected_retrieved_context=docs(*expected))
    assert first_hit_rank(record) == rank
    values, _ = ComputedMetrics().compute(record)
    assert (values["retrieval_hit_rate"], values["retrieval_mrr"], values["document_recall"]) == (
        hit, pytest.approx(mrr), recall)


def test_no_expected_uri_computes_no_retrieval_metric():
    record = EvalRecord(retrieved_context=docs("a"), expected_retrieved_context=docs(None))
    assert first_hit_rank(record) is None and retrieval_ranks(record) == {}
    values, _ = ComputedMetrics().compute(record)
    assert not {"retrieval_hit_rate", "retrieval_mrr", "document_recall"} & set(values)


def test_what_a_function_may_return():
    assert answer_from("30 days.").response == "30 days."
    full = answer_from({"response": "30 days.", "retrieved_context": ["Refunds: 30 days.",
                                                                      {"content": "c", "doc_uri": "kb://x"}]})
    assert full.retrieved_context == [{"content": "Refunds: 30 days."}, {"content": "c", "doc_uri": "kb://x"}]
    chat = {"choices": [{"message": {"role": "assistant", "content": "From a completion."}}]}
    assert answer_from({"response": chat}).response == "From a completion."
    trace = {"info": {"trace_id": "tr-1"}, "data": {"spans": []}}
    assert answer_from(trace).trace is trace

    class Traced:
        def to_json(self) -> str:
            return '{"info": {}, "data": {"spans": []}}'

    assert answer_from(Traced()).trace == '{"info": {}, "data": {"spans": []}}'
    for bad, says in ((None, "returned NoneType"), ({"answer": "x"}, "returned a dict with answer"),
                      ({"response": "x", "retrieved_context": "one"}, "must be a list"), ({}, "neither")):
        with pytest.raises(AppError, match=says) as err:
            answer_from(bad)
        assert err.value.reason == "invalid_answer"


def test_messages_sent_and_the_endpoint_url():
    assert app_messages("Hi?") == [{"role": "user", "content": "Hi?"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert app_messages({"messages": chat}) == chat and app_messages(chat) == chat
    assert app_messages({"question": "Hi?"}) == [{"role": "user", "content": "Hi?"}]
    assert split_url("http://h:1/v1/") == ("http://h:1/v1", "/chat/completions")
    assert split_url("http://h:1/v1/chat/completions") == ("http://h:1/v1", "/chat/completions")


def test_the_flipped_questions_are_two():
    # The noise case of test_eval_baseline.py relies on it: 2 of 12 rows change.
    assert len(FLIPPED) == 2 and {q for q, _, _ in KNOWLEDGE} >= FLIPPED


def test_a_collected_rows_session_is_dropped_the_app_answers_each_row_on_its_own(files):
    # Rows collected from one production conversation: the app is called once per row, without the
    # turns before it, so the answers are not that conversation and no session judge may run on them.
    rows = [{**r, "session_id": "conv-1", "user_id": "u-7"} for r in DATASET]
    files["dataset"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = eval_app(files, "--app", f"{APPS}:good_app")
    assert proc.returncode == 0, proc.stderr
    out = results(files["out"])
    assert len(out) == len(rows)
    assert all(r["session_id"] is None and r["user_id"] is None for r in out)
    assert verdicts(out) == ["passed"] * len(KNOWLEDGE)
