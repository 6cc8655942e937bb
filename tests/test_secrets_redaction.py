"""Redaction catches what its documentation page (docs/pages/guides/redaction.md) says it catches, the
same way in a trace judge's prompt, in an embeddings input and in a session judge's transcript; the
page's list of what it does NOT detect is true; and the page's example of adding a detector
(`judges.redaction.callable`) works as shown, run from the page itself against a real judge endpoint
(the loopback stub)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from support.openai_stub import OpenAIStub, Reply, StubRequest, bag_of_words_vector

from tracejudge.metrics.judges.redaction import Redactor
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sessions import Conversation, SessionJudgeRunner
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.session import Turn

PAGE = Path(__file__).resolve().parents[1] / "docs" / "pages" / "guides" / "redaction.md"
TITLE = "# What leaves the process: redaction"

# One example of every form the page's table claims, and what it must become (label only: numbers
# are checked by comparing the three channels).
CLAIMED: list[tuple[str, str]] = [
    ("maria.lopez@example.org", "EMAIL"),
    ("j.smith+orders@shop-mail.co.uk", "EMAIL"),
    ("+44 20 7946 0958", "PHONE"),
    ("(415) 555-2671", "PHONE"),
    ("415-555-2671", "PHONE"),
    ("1-800-555-0199", "PHONE"),
    ("030 1234567", "PHONE"),
    ("4111 1111 1111 1111", "CARD"),
    ("5500-0000-0000-0004", "CARD"),
    ("4012888888881881", "CARD"),
    ("DE89 3704 0044 0532 0130 00", "IBAN"),
    ("GB82WEST12345698765432", "IBAN"),
    ("123-45-6789", "SSN"),
    ("203.0.113.42", "IP"),
    ("2001:db8::8a2e:370:7334", "IP"),
    ("sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "SECRET"),
    ("sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0F", "SECRET"),
    ("AKIAIOSFODNN7EXAMPLE", "SECRET"),
    ("ghp_aB1cD2eF3gH4iJ5kL6mN7oP8qR9sT0uV1wX2", "SECRET"),
    ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMN", "SECRET"),
    ("xoxb-123456789012-abcdefghijklmnop", "SECRET"),
    ("https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXX", "SECRET"),
    ("AIzaSyA1234567890abcdefghijklmnopqrstuv", "SECRET"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
     "SECRET"),
]
# Claimed forms whose name stays and whose value goes: (text, the value that must go).
LABELLED = [("Bearer Tk9UQVJFQUxUT0tFTi1qdXN0LWEtdGVzdA", "Tk9UQVJFQUxUT0tFTi1qdXN0LWEtdGVzdA"),
            ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
             "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")]
# The page's "What it does not detect" examples: sent as they are.
NOT_DETECTED = ["221B Baker Street", "SW1A 1AA", "94103", "born 1985-03-14", "14/03/1985",
                "passport 123456789", "4111.1111.1111.1111", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                "maria dot lopez at example dot org"]
SEPARATOR = " ; "
LINE = SEPARATOR.join([v for v, _ in CLAIMED] + [t for t, _ in LABELLED])


def section() -> str:
    """The redaction page, which is the whole of the section (it starts with its title)."""
    text = PAGE.read_text(encoding="utf-8")
    assert text.startswith(TITLE + "\n"), f"{PAGE} no longer starts with {TITLE!r}"
    return text


def responder(req: StubRequest) -> Reply:
    if req.path.endswith("/embeddings"):
        return Reply.embeddings([bag_of_words_vector(t) for t in req.body["input"]])
    schema = ((req.body.get("response_format") or {}).get("json_schema") or {}).get("name", "")
    if schema == "generated_questions":
        return Reply.chat({"questions": ["Which details did I give?"], "noncommittal": False})
    return Reply.verdict("yes")


def endpoint(stub: OpenAIStub) -> dict[str, Any]:
    return {"base_url": stub.base_url, "model": "judge-model", "embedding_model": "embed-model"}


def between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_each_claimed_kind_is_replaced_the_same_in_a_prompt_an_embedding_and_a_transcript(
        stub: OpenAIStub) -> None:
    stub.responder = responder
    config = {"endpoints": {"default": endpoint(stub)}, "sample_rate": 1.0,
              "builtin": {"answer_relevancy": {}},
              "custom": {"echo": {"prompt": "BEGIN {request} END"}}}
    with JudgeRunner(config, registry=CollectorRegistry()) as runner:
        assessments = runner.judge_sync(EvalRecord(trace_id=f"{1:032x}", request=LINE, response="Noted."))
    assert all(a.error is None and a.redacted for a in assessments), assessments
    turn = Turn(trace_id=f"{2:032x}", request_id=None, mlflow_trace_id=None, root_span_id=None,
                timestamp=1_750_000_000.0, placed_by_arrival=False, request=LINE, response="Noted.",
                failed=False, error=None, input_tokens=None, output_tokens=None, tool_calls=0,
                latency_seconds=None)
    sessions = {"endpoints": {"default": endpoint(stub)}, "sample_rate": 1.0,
                "sessions": {"conversation_completeness": {}}}
    with SessionJudgeRunner(sessions, CollectorRegistry()) as runner:
        [session] = runner.judge_sync(Conversation("sess-1", "shop", [turn]))
    assert session.error is None and session.redacted

    [echo] = [r for r in stub.chat_requests() if "BEGIN " in r.prompt]
    prompt = between(echo.prompt, "BEGIN ", " END")
    [emb] = [r for r in stub.requests if r.path.endswith("/embeddings")]
    embedded = emb.body["input"][0]
    [transcript] = [between(r.prompt, "User: ", "\n") for r in stub.chat_requests() if "User: " in r.prompt]
    # One text, redacted the same way whichever way it leaves.
    assert prompt == embedded == transcript, (prompt, embedded, transcript)
    parts = prompt.split(SEPARATOR)
    assert len(parts) == len(CLAIMED) + len(LABELLED)
    for (value, label), part in zip(CLAIMED, parts, strict=False):
        assert re.fullmatch(rf"<{label}_\d+>", part), (value, part)
    for (text, secret), part in zip(LABELLED, parts[len(CLAIMED):], strict=True):
        assert re.fullmatch(rf"{re.escape(text.replace(secret, ''))}<SECRET_\d+>", part), (text, part)
    sent = [v for v, _ in CLAIMED] + [s for _, s in LABELLED]
    for req in stub.requests:
        assert not [v for v in sent if v in str(req.body)], req.path


def test_what_the_page_says_is_not_detected_is_sent_as_it_is() -> None:
    text = section()
    not_detected = text[text.index("**What it does not detect.**"):text.index("**Adding a detector.**")]
    redaction = Redactor().session()
    for example in NOT_DETECTED:
        assert example in not_detected, f"{example!r} is not among the page's examples"
        sentence = f"Customer note: {example}, thanks."
        assert redaction.text(sentence) is sentence, example


def test_the_page_example_of_adding_a_detector_works_as_shown(
        stub: OpenAIStub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = section()
    example = text[text.index("**Adding a detector.**"):text.index("**Configuration, logs and dead letters")]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", example, re.S))
    module_path = blocks["python"].splitlines()[0].removeprefix("# ").strip()
    assert module_path == "mycompany/pii.py"
    (tmp_path / "mycompany").mkdir()
    (tmp_path / module_path).write_text(blocks["python"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mycompany", raising=False)
    monkeypatch.delitem(sys.modules, "mycompany.pii", raising=False)
    judges = yaml.safe_load(blocks["yaml"])["judges"]
    before = between(blocks["text"], "before: ", "\n")
    after = between(blocks["text"], "after:  ", "\n")
    config = {**judges, "endpoints": {"default": endpoint(stub)}, "sample_rate": 1.0, "builtin": {},
              "custom": {"echo": {"prompt": "BEGIN {request} END"}}}
    with JudgeRunner(config, registry=CollectorRegistry()) as runner:
        [verdict] = runner.judge_sync(EvalRecord(trace_id=f"{3:032x}", request=before, response="ok"))
    assert verdict.error is None and verdict.redacted is True
    [req] = stub.chat_requests()
    assert between(req.prompt, "BEGIN ", " END") == after
    assert "SW1A 1AA" in before and "SW1A 1AA" not in req.prompt and "123456789" not in req.prompt
