"""Redaction before egress (tracejudge.metrics.judges.redaction): the detectors and their checks, one
placeholder map per judgement, and the judge endpoint's request log holding none of the personal data
a corpus was seeded with, while a control set without personal data is sent byte for byte as before."""

from __future__ import annotations

import logging
import re
import subprocess
from collections import Counter
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.deploy_files import tool
from support.openai_stub import OpenAIStub, Reply, StubRequest, bag_of_words_vector

from tracejudge.metrics.judges.config import JudgeConfigError, load_judges_config
from tracejudge.metrics.judges.redaction import KINDS, Redactor, iban_ok, luhn_ok
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sessions import Conversation, SessionJudgeRunner
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.session import Turn

# ------------------------------------------------------------------------------------------ seeds
EMAIL_A = "maria.lopez@example.org"
EMAIL_B = "j.smith+orders@shop-mail.co.uk"
PHONE_INTL = "+44 20 7946 0958"
PHONE_US = "(415) 555-2671"
CARD = "4111 1111 1111 1111"
CARD_DASHED = "5500-0000-0000-0004"
IBAN = "DE89 3704 0044 0532 0130 00"
IBAN_COMPACT = "GB82WEST12345698765432"
SSN = "123-45-6789"
IPV4 = "203.0.113.42"
IPV6 = "2001:db8::8a2e:370:7334"
OPENAI_KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
ANTHROPIC_KEY = "sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0F"
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
GITHUB_TOKEN = "ghp_aB1cD2eF3gH4iJ5kL6mN7oP8qR9sT0uV1wX2"
SLACK_TOKEN = "xoxb-123456789012-abcdefghijklmnop"
BEARER = "Tk9UQVJFQUxUT0tFTi1qdXN0LWEtdGVzdA"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
EMPLOYEE = "EMP-204518"
TICKET = "TCK/77-alpha"

SEEDED = [
    EMAIL_A, EMAIL_B, PHONE_INTL, PHONE_US, CARD, CARD_DASHED, IBAN, IBAN_COMPACT, SSN, IPV4, IPV6,
    OPENAI_KEY, ANTHROPIC_KEY, AWS_KEY, GITHUB_TOKEN, SLACK_TOKEN, BEARER, JWT, "MIIEvQIBADANBgkqhkiG9w0",
    EMPLOYEE, TICKET,
]
# The same values as they may appear once separators are dropped or case changes.
NORMALISED = ["4111111111111111", "5500000000000004", "DE89370400440532013000", "442079460958", "4155552671"]


def ticket_spans(text: str) -> list[tuple[int, int, str]]:
    """The pluggable callable of the tests (`judges.redaction.callable: test_redaction:ticket_spans`)."""
    return [(m.start(), m.end(), "ticket") for m in re.finditer(r"TCK/\d+-[a-z]+", text)]


def broken_finder(text: str) -> list[Any]:
    raise RuntimeError(f"boom on {text}")


PII_RECORDS = [
    EvalRecord(
        trace_id=f"{1:032x}",
        app="shop",
        failed=False,
        request=f"I am {EMAIL_A}, card {CARD}. Where is my refund? Call me on {PHONE_INTL}.",
        response=f"Thanks, I sent the refund confirmation to {EMAIL_A} and will call {PHONE_INTL}.",
        expected_response=f"The refund to card {CARD} is on its way; confirmation sent to {EMAIL_A}.",
        retrieved_context=[
            Document(f"Customer {EMAIL_A}, phone {PHONE_INTL}, SSN {SSN}, IBAN {IBAN}."),
            Document(f"Second account holder {EMAIL_B}; US line {PHONE_US}; card {CARD_DASHED}."),
            Document(f"Wire to {IBAN_COMPACT}. Login from {IPV4} and {IPV6}. Staff {EMPLOYEE}, {TICKET}."),
            Document(f"Contact {EMAIL_B} again."),
        ],
    ),
    EvalRecord(
        trace_id=f"{2:032x}",
        app="shop",
        failed=False,
        request=f"My keys leaked: {OPENAI_KEY} {ANTHROPIC_KEY} {AWS_KEY}",
        response=f"Revoke {GITHUB_TOKEN} and {SLACK_TOKEN}; the header was Authorization: Bearer {BEARER}",
        expected_response=f"Rotate the JWT {JWT} and the key\n{PEM}",
        retrieved_context=[Document(f"Keys must never be pasted: {OPENAI_KEY}, {JWT}.")],
    ),
]

CONTROL_RECORDS = [
    EvalRecord(
        trace_id=f"{100 + i:032x}",
        app="shop",
        failed=False,
        request=q,
        response=a,
        expected_response=a,
        retrieved_context=[Document(d)],
    )
    for i, (q, a, d) in enumerate(
        [
            (
                "How long is the return window for order 4532015112830367 placed in 2024?",
                "Items bought in 2024 can be returned within 30 days; order 4532015112830367 qualifies.",
                "Orders from 2019-2024 may be returned within 30 days. Prices: $1,299.99 or 24.50 EUR.",
            ),
            (
                "Is version 3.12.1 supported and what does the 16 GB model cost?",
                "Yes, 3.12.1 is supported; the 16 GB model costs $849 (SKU 20240512-0042).",
                "Supported releases: 3.11, 3.12.1. Meeting at 12:30:45 in room 101. Batch 1234 5678 9012.",
            ),
            (
                "Where is parcel 987654321?",
                "Parcel 987654321 left the depot on 2024-11-25 at 14:05 and arrives within 2-3 days.",
                "Parcels ship within 1-2 days; 95% arrive within 72 hours. Ref 1234567812345678.",
            ),
        ]
    )
]

JUDGES = {
    "groundedness": {},
    "relevance_to_query": {},
    "correctness": {},
    "chunk_relevance": {},
    "answer_relevancy": {},
}
CUSTOM = {"echo_all": {"prompt": "Request: {request}\nContext: {context}\nResponse: {response}\nOK?"}}


def schema_name(req: StubRequest) -> str:
    rf = req.body.get("response_format") or {}
    return (rf.get("json_schema") or {}).get("name", "?")


def responder(req: StubRequest) -> Reply:
    if req.path.endswith("/embeddings"):
        texts = req.body["input"]
        return Reply.embeddings([bag_of_words_vector(t) for t in texts])
    if schema_name(req) == "generated_questions":
        return Reply.chat({"questions": ["Where is my refund?"], "noncommittal": False})
    if "verdicts" in schema_name(req):
        listed = req.prompt.rsplit("<statements>", 1)[-1].split("</statements>", 1)[0]
        indices = [int(i) for i in re.findall(r"^\[(\d+)\] ", listed, re.M)]
        return Reply.chat({"verdicts": [{"index": i, "rationale": "ok", "result": "yes"} for i in indices]})
    return Reply.verdict("yes")


def make_runner(stub: OpenAIStub, **redaction: Any) -> JudgeRunner:
    config = {
        "endpoints": {
            "default": {
                "base_url": stub.base_url,
                "model": "judge-model",
                "embedding_model": "embed-model",
                "backoff_initial_seconds": 0.01,
            }
        },
        "sample_rate": 1.0,
        "builtin": JUDGES,
        "custom": CUSTOM,
        "redaction": {
            "patterns": {"employee_id": r"EMP-\d{6}"},
            "callable": "test_redaction:ticket_spans",
            **redaction,
        },
    }
    return JudgeRunner(config, registry=CollectorRegistry())


def bodies(stub: OpenAIStub) -> list[bytes]:
    return [orjson.dumps(r.body, option=orjson.OPT_SORT_KEYS) for r in stub.requests]


# ------------------------------------------------------------------------------------------ end to end
def test_seeded_personal_data_never_reaches_the_judge_endpoint(
    stub: OpenAIStub, caplog: pytest.LogCaptureFixture
) -> None:
    stub.responder = responder
    caplog.set_level(logging.DEBUG)
    with make_runner(stub) as r:
        results = list(r.judge_many(PII_RECORDS, window=1))
        metrics_text = generate_latest(r.metrics.registry)
    sent = [b.decode() for b in bodies(stub)]
    assert len(sent) >= 2 * (len(JUDGES) + len(CUSTOM))
    assert any(s.count('"input"') for s in sent), "the embeddings endpoint was called"
    for value in SEEDED + NORMALISED:
        leaked = [s for s in sent if value in s or orjson.dumps(value).decode()[1:-1] in s]
        assert not leaked, f"{value!r} reached the endpoint"
        assert value not in caplog.text
    # Every judge gave its verdict on redacted text, and says so.
    for assessments in results:
        assert {a.name for a in assessments} == {*JUDGES, *CUSTOM}
        for a in assessments:
            assert a.error is None and a.skipped is None, (a.name, a.error, a.skipped)
            assert a.redacted is True
    # Every kind was found and counted; the exposition passes promtool's lint.
    counts = {
        k: r.metrics.registry.get_sample_value("tracejudge_redactions_total", {"kind": k}) for k in KINDS
    }
    assert all(v and v > 0 for v in counts.values()), counts
    proc = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=metrics_text,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_one_judgement_shares_one_placeholder_map_across_request_context_and_response(
    stub: OpenAIStub,
) -> None:
    stub.responder = responder
    with make_runner(stub) as r:
        r.judge_sync(PII_RECORDS[0])
    by_judge: dict[str, list[StubRequest]] = {}
    for req in stub.chat_requests():
        by_judge.setdefault(schema_name(req), []).append(req)
    # The custom judge's one prompt names request, context and response: the customer's address is
    # <EMAIL_1> in all three, the second holder's is <EMAIL_2>, and the card is one placeholder.
    [echo] = by_judge["echo_all_judgement"]
    request, rest = echo.prompt.split("Context:", 1)
    context, response = rest.split("Response:", 1)
    for part in (request, context, response):
        assert "<EMAIL_1>" in part
    assert "<EMAIL_2>" in context and "<EMAIL_2>" not in request + response
    assert "<PHONE_1>" in request and "<PHONE_1>" in response and "<PHONE_1>" in context
    assert re.findall(r"<CARD_\d+>", request) == ["<CARD_1>"]
    assert "<EMPLOYEE_ID_1>" in context and "<TICKET_1>" in context
    # chunk_relevance asks once per chunk, and the numbering runs on across the judgement's calls: the
    # IBAN of chunk 1 is <IBAN_1>, so chunk 3's other IBAN is <IBAN_2> (a fresh map per call would say 1),
    # and the second holder is <EMAIL_2> in chunk 2 and again in chunk 4.
    chunks = [req.prompt for req in by_judge["chunk_relevance_verdict"]]
    assert len(chunks) == 4
    [chunk_3] = [c for c in chunks if "Wire to" in c]
    assert "<IBAN_2>" in chunk_3 and "<IBAN_1>" not in chunk_3
    [chunk_2] = [c for c in chunks if "Second account holder" in c]
    [chunk_4] = [c for c in chunks if "again" in c]
    assert "<EMAIL_2>" in chunk_2 and "Contact <EMAIL_2> again" in chunk_4
    # The embeddings input of answer_relevancy went through the same judgement's map.
    [emb] = [req for req in stub.requests if req.path.endswith("/embeddings")]
    assert "<EMAIL_1>" in emb.body["input"][0] and "<CARD_1>" in emb.body["input"][0]


def test_a_control_set_without_personal_data_is_sent_byte_for_byte_and_judged_the_same(
    stub: OpenAIStub,
) -> None:
    stub.responder = responder
    with make_runner(stub) as r:
        with_redaction = [[(a.name, a.value, a.redacted) for a in x] for x in r.judge_many(CONTROL_RECORDS)]
    sent_redacting = Counter(bodies(stub))
    stub.requests.clear()
    with make_runner(stub, enabled=False) as r:
        without = [[(a.name, a.value, a.redacted) for a in x] for x in r.judge_many(CONTROL_RECORDS)]
    assert Counter(bodies(stub)) == sent_redacting
    assert with_redaction == without
    assert all(redacted is None for x in with_redaction for _, _, redacted in x)
    assert all(value is not None for x in with_redaction for _, value, _ in x)


def test_session_judges_send_the_conversation_redacted_and_share_the_registry_counter(
    stub: OpenAIStub,
) -> None:
    """A session stage may run the trace and the session judges on one registry: one counter."""
    turns = [
        Turn(trace_id=f"{i:032x}", request_id=None, mlflow_trace_id=None, root_span_id=None,
             timestamp=1_750_000_000.0 + i, placed_by_arrival=False, request=q, response=a, failed=False,
             error=None, input_tokens=None, output_tokens=None, tool_calls=0, latency_seconds=None)
        for i, (q, a) in enumerate(
            [(f"I am {EMAIL_A}, my card is {CARD}.", "Thanks, noted."), ("Still there?", f"Yes, {EMAIL_A}.")]
        )
    ]
    registry = CollectorRegistry()
    endpoint = {"base_url": stub.base_url, "model": "judge-model"}
    stub.responder = lambda req: Reply.chat({"rationale": "fine", "result": "yes"})
    session_config = {
        "endpoints": {"default": endpoint},
        "sample_rate": 1.0,
        "sessions": {"conversation_completeness": {}},
    }
    trace_judges = JudgeRunner({"endpoints": {"default": endpoint}, "builtin": {}}, registry=registry)
    with SessionJudgeRunner(session_config, registry) as sessions, trace_judges:
        [a] = sessions.judge_sync(Conversation("sess-1", "shop", turns))
    [req] = stub.chat_requests()
    assert EMAIL_A not in req.prompt and CARD not in req.prompt
    assert req.prompt.count("<EMAIL_1>") == 2 and "<CARD_1>" in req.prompt
    assert a.redacted is True
    assert registry.get_sample_value("tracejudge_redactions_total", {"kind": "email"}) == 2


def test_a_failing_callable_fails_the_judgement_closed(stub: OpenAIStub) -> None:
    stub.responder = responder
    with make_runner(stub, callable="test_redaction:broken_finder") as r:
        assessments = r.judge_sync(PII_RECORDS[0])
    assert stub.total == 0
    assert all(a.error == "internal: redaction callable failed: RuntimeError" for a in assessments)


# ------------------------------------------------------------------------------------------ detectors
def redact(text: str, **kw: Any) -> str:
    return Redactor(**kw).session().text(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"mail {EMAIL_A} or {EMAIL_A.upper()}", "mail <EMAIL_1> or <EMAIL_1>"),
        (f"call {PHONE_INTL} / {PHONE_US} / 415-555-2671 / 1-800-555-0199", None),
        (f"pay {CARD} or {CARD_DASHED} or 4111111111111111", "pay <CARD_1> or <CARD_2> or <CARD_1>"),
        (f"to {IBAN} AND {IBAN_COMPACT}", "to <IBAN_1> AND <IBAN_2>"),
        (f"ssn {SSN}", "ssn <SSN_1>"),
        (f"from {IPV4} and {IPV6} and ::1", "from <IP_1> and <IP_2> and <IP_3>"),
        (f"Authorization: Bearer {BEARER}", "Authorization: Bearer <SECRET_1>"),
        (f"{OPENAI_KEY} {ANTHROPIC_KEY} {AWS_KEY} {GITHUB_TOKEN} {SLACK_TOKEN} {JWT}", None),
        (f"key:\n{PEM}\nend", "key:\n<SECRET_1>\nend"),
        (
            "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            "aws_secret_access_key = <SECRET_1>",
        ),
    ],
)
def test_each_kind_is_replaced_by_a_typed_numbered_placeholder(text: str, expected: str | None) -> None:
    out = redact(text)
    if expected is not None:
        assert out == expected
    else:
        assert not re.search(r"\d{3}|sk-|AKIA|ghp_|xox|eyJ", out), out
        assert re.fullmatch(r"[^<>]*(<[A-Z]+_\d>[^<>]*)+", out), out


@pytest.mark.parametrize(
    "text",
    [
        "order 4111111111111112 (a 16-digit id that fails the Luhn check)",
        "ids 1234567812345678 and 1234 5678 9012 3456",
        "IBAN-like DE89370400440532013001 (wrong check digits) and GB00WEST12345698765432",
        "In 2024 we sold 1,250 units at $1,299.99 (or 24.50 EUR); 95% within 72 hours.",
        "version 3.12.1, build 20240512-0042, at 12:30:45 on 2024-11-25, room 101, 2-3 days",
        "SSN-like 000-12-3456 and 666-12-3456 and 123-00-4567; 999.999.1.1 is no address",
        "parcel 987654321, ticket #4821, sk-short, Bearer short",
    ],
)
def test_ordinary_numbers_and_failed_checks_are_left_alone(text: str) -> None:
    assert redact(text) == text


def test_luhn_and_iban_checks() -> None:
    assert luhn_ok("4111111111111111") and luhn_ok("5500000000000004") and luhn_ok("378282246310005")
    assert not luhn_ok("4111111111111112") and not luhn_ok("1234567812345678")
    assert iban_ok("DE89 3704 0044 0532 0130 00") and iban_ok("GB82WEST12345698765432")
    assert iban_ok("FR1420041010050500013M02606")
    assert not iban_ok("DE89370400440532013001") and not iban_ok("GB82WEST1234569876543")
    assert not iban_ok("1289370400440532013000") and not iban_ok("DE8937040044")


def test_kinds_select_the_detectors_and_unchanged_text_is_the_same_object() -> None:
    text = f"{EMAIL_A} {CARD}"
    assert redact(text, kinds=["card"]) == f"{EMAIL_A} <CARD_1>"
    session = Redactor().session()
    plain = "nothing personal here, order 42 in 2024"
    assert session.text(plain) is plain and session.replaced == 0
    msgs = [{"role": "user", "content": plain}]
    assert session.messages(msgs)[0] is msgs[0]


def test_one_session_numbers_per_type_and_sessions_do_not_share() -> None:
    redactor = Redactor(patterns={"employee_id": r"EMP-\d{6}"})
    s = redactor.session()
    assert s.text(f"{EMAIL_A} {EMAIL_B}") == "<EMAIL_1> <EMAIL_2>"
    assert s.text(f"{EMAIL_B} {EMPLOYEE} {EMAIL_A}") == "<EMAIL_2> <EMPLOYEE_ID_1> <EMAIL_1>"
    assert s.counts == {"email": 4, "custom": 1}
    assert redactor.session().text(EMAIL_B) == "<EMAIL_1>"


def test_numbers_in_other_scripts_are_checked_by_their_digit_values() -> None:
    # Arabic-Indic digits: \d matches them, and the Luhn check reads their values (a valid card is
    # replaced, one that fails the check is not).
    arabic = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
    assert redact(f"card {CARD.translate(arabic)} paid") == "card <CARD_1> paid"
    bad = "4111 1111 1111 1112".translate(arabic)
    assert redact(f"ref {bad} here") == f"ref {bad} here"
    assert redact(f"call {PHONE_INTL.translate(arabic)} now") == "call <PHONE_1> now"


_LABELS = {"EMAIL", "PHONE", "CARD", "IBAN", "SSN", "IP", "SECRET"}


def test_the_line_memo_is_one_judgements_and_the_redactor_keeps_no_state_of_records() -> None:
    redactor = Redactor()
    state = dict(vars(redactor))
    text = f"{EMAIL_A} {CARD} {PHONE_INTL}\nplain line"
    session = redactor.session()
    assert session.text(text) == "<EMAIL_1> <CARD_1> <PHONE_1>\nplain line"
    # The judgement's memo: each line's offsets and the kinds' and placeholders' names.
    assert len(session._lines) == 2
    for found in session._lines.values():
        for start, end, kind, label in found:
            assert type(start) is int and type(end) is int and kind in KINDS and label in _LABELS
    assert session.text(text) == "<EMAIL_1> <CARD_1> <PHONE_1>\nplain line"  # from the memo
    assert len(session._lines) == 2
    # The next judgement (the next record) starts with nothing of this one's; the redactor is unchanged.
    other = redactor.session()
    assert not other._lines
    assert other.text(text) == "<EMAIL_1> <CARD_1> <PHONE_1>\nplain line"
    assert vars(redactor) == state


def test_a_labelled_line_reuses_its_value_and_a_secret_named_by_the_label_is_found() -> None:
    redactor = Redactor()
    value = f"{EMAIL_A} paid with {CARD} from {IPV4}"
    session = redactor.session()
    assert session.text(value) == "<EMAIL_1> paid with <CARD_1> from <IP_1>"
    remembered = len(session._lines)
    # A custom judge's "Request: {request}": the value's findings are reused, shifted past the label.
    assert session.text(f"Request: {value}") == "Request: <EMAIL_1> paid with <CARD_1> from <IP_1>"
    assert len(session._lines) == remembered + 1  # the labelled line; its value was remembered
    assert redact(f"Request: Bearer {BEARER}") == "Request: Bearer <SECRET_1>"
    # An AWS secret's name can be the label: that line is scanned whole.
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    assert redact(f"aws_secret_access_key: {secret}") == "aws_secret_access_key: <SECRET_1>"
    assert redact(f"Secret_Access_Key: {secret}\n{secret}") == f"Secret_Access_Key: <SECRET_1>\n{secret}"
    # Only the first label is split off: a line of thousands of "key: " is read without recursing.
    assert redact("k: " * 5000 + EMAIL_A) == "k: " * 5000 + "<EMAIL_1>"


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    ("redaction", "key", "why"),
    [
        ({"patterns": {"employee_id": "EMP-[0-9"}}, "judges.redaction.patterns.employee_id", "regular"),
        ({"patterns": {"Bad Name": "x"}}, "judges.redaction.patterns", "'Bad Name' is not a lowercase"),
        ({"patterns": {"anything": ".*"}}, "judges.redaction.patterns.anything", "empty string"),
        ({"callable": "no_such_module_xyz:find"}, "judges.redaction.callable", "cannot import"),
        ({"callable": "test_redaction:no_such_function"}, "judges.redaction.callable", "no attribute"),
        ({"callable": "test_redaction"}, "judges.redaction.callable", "module:function"),
        ({"kinds": ["email", "dna"]}, "judges.redaction.kinds[1]", "email"),
        ({"enable": True}, "judges.redaction.enable", "unknown key"),
    ],
)
def test_configuration_errors_name_the_key(redaction: dict[str, Any], key: str, why: str) -> None:
    with pytest.raises(JudgeConfigError) as err:
        load_judges_config({"redaction": redaction})
    assert err.value.key == key and why in err.value.detail


def test_redaction_is_on_by_default() -> None:
    cfg = load_judges_config({})
    assert cfg.redaction.enabled and set(cfg.redaction.kinds) == set(KINDS) - {"custom"}


def test_a_system_message_is_the_judges_own_text_and_passes_as_written_while_user_text_is_redacted():
    """System messages hold the judge's instructions (built-in, or a custom judge's configured criteria),
    never trace text: they are sent as written; the user message, where every prompt puts the trace's
    text, is redacted."""
    session = Redactor().session()
    system = {"role": "system", "content": "Reply to ops@example.com with JSON."}
    user = {"role": "user", "content": "<request>\nmail me at jane.doe@example.com\n</request>"}
    out_system, out_user = session.messages([system, user])
    assert out_system is system
    assert "jane.doe@example.com" not in out_user["content"] and "<EMAIL_1>" in out_user["content"]


def test_one_records_judgements_share_a_line_memo_and_the_next_record_starts_afresh():
    """The runner gives each record's judgements one memo (Plan.redaction_memo): a line seen by one
    judge of the record is not scanned again by the next, and nothing is carried to another record."""
    redactor = Redactor()
    memo: dict = {}
    first, second = redactor.session(memo), redactor.session(memo)
    text = "call 555-0100 or mail a@example.com"
    assert first.text(text) == second.text(text)
    assert memo and redactor.session()._lines == {}
