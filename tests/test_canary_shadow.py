"""Canaries (labelled records judged by the live judges at a fixed rate, never app quality) and shadow
judges (a candidate judging exactly its live judge's sample, compared but not exported as quality),
against the loopback OpenAI stub."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from support.clock import FakeClock
from support.openai_stub import OpenAIStub, Reply, StubRequest, wait_until

from tracejudge.consumer.config import ConfigError
from tracejudge.consumer.stages.run import StreamRunner
from tracejudge.metrics.judges.config import JudgeConfigError, load_judges_config
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.trust.canaries import SHIPPED_CANARIES, CanaryRunner, build_canaries
from tracejudge.schemas.record import Document, EvalRecord

SHIPPED = Path(__file__).resolve().parents[1] / "metrics" / "judges" / "trust" / SHIPPED_CANARIES


def shipped_answers(judge: str) -> dict[str, str]:
    """response text -> the known answer ("yes"/"no") of `judge` on that shipped canary."""
    out = {}
    for line in SHIPPED.read_text().splitlines():
        row = orjson.loads(line)
        out[row["response"]] = "yes" if row["expected"][judge] == "pass" else "no"
    return out


def answering(judge: str, *, flipped: bool = False) -> Any:
    """A responder that gives the known answer to each canary (or the opposite one)."""
    answers = shipped_answers(judge)

    def respond(req: StubRequest) -> Reply:
        answer = next((a for text, a in answers.items() if text in req.prompt), "yes")
        if flipped:
            answer = "no" if answer == "yes" else "yes"
        return Reply.verdict(answer)

    return respond


def config(stub: OpenAIStub, **top: Any) -> dict[str, Any]:
    return {
        "endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model",
                                  "backoff_initial_seconds": 0.01, "max_retries": 0}},
        "builtin": {"relevance_to_query": {"sample_rate": 1.0}},
        **top,
    }


def value(r: JudgeRunner, name: str, **labels: str) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


def family_total(r: JudgeRunner, family: str) -> float:
    return sum(s.value for m in r.metrics.registry.collect() if m.name == family for s in m.samples
               if s.name == family + "_total" or s.name == family + "_count")


def canary_count(r: JudgeRunner, judge: str) -> float:
    return sum(value(r, "tracejudge_judge_canary_total", judge=judge, outcome=o)
               for o in ("agree", "disagree", "error"))


def tick_and_settle(canaries: CanaryRunner, r: JudgeRunner, now: float, judge: str) -> None:
    before = canary_count(r, judge)
    if canaries.tick(now):
        wait_until(lambda: canary_count(r, judge) > before, timeout=60)


def test_canaries_run_at_their_rate_and_a_flipped_judge_disagrees(stub: OpenAIStub) -> None:
    stub.responder = answering("relevance_to_query")
    clock = FakeClock(0.0)
    r = JudgeRunner(config(stub, canary={"rate_per_minute": 6}), registry=CollectorRegistry())
    canaries = build_canaries(r, clock=clock)
    assert canaries is not None and canaries.judges() == ["relevance_to_query"]
    assert len(canaries.canaries["relevance_to_query"]) == 12  # the shipped set
    try:
        # One canary every 10 s: ticks every 5 s over a minute start 7 (at 0, 10, ..., 60).
        for now in range(0, 61, 5):
            tick_and_settle(canaries, r, float(now), "relevance_to_query")
        assert stub.count("/chat/completions") == 7
        assert value(r, "tracejudge_judge_canary_total", judge="relevance_to_query", outcome="agree") == 7
        assert value(r, "tracejudge_judge_canary_total", judge="relevance_to_query", outcome="disagree") == 0
        # A provider swaps the model behind the name: every answer flips, disagree rises.
        stub.responder = answering("relevance_to_query", flipped=True)
        for now in range(70, 101, 10):
            tick_and_settle(canaries, r, float(now), "relevance_to_query")
        assert value(r, "tracejudge_judge_canary_total", judge="relevance_to_query", outcome="disagree") == 4
        assert value(r, "tracejudge_judge_canary_total", judge="relevance_to_query", outcome="agree") == 7
        # After a stall one canary runs, not a burst for the minutes missed.
        assert canaries.tick(1000.0) == 1
        wait_until(lambda: canary_count(r, "relevance_to_query") == 12, timeout=60)
        assert canaries.tick(1001.0) == 0
        # Never app quality: no verdict, score, eligible, sampled, skip, error or duration series.
        for family in ("tracejudge_judge_verdicts", "tracejudge_judge_score", "tracejudge_judge_eligible",
                       "tracejudge_judge_sampled", "tracejudge_judge_skipped", "tracejudge_judge_errors",
                       "tracejudge_judge_duration_seconds"):
            assert family_total(r, family) == 0, family
        # Real spend is counted with the judge.
        assert value(r, "tracejudge_judge_tokens_total", judge="relevance_to_query", direction="input") > 0
    finally:
        r.close()


def test_one_canary_in_flight_per_judge_and_none_when_overloaded(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("yes", delay=0.3)
    cfg = config(stub, canary={"rate_per_minute": 60}, max_in_flight=1)
    cfg["builtin"] = {"groundedness": {}, "relevance_to_query": {}}
    r = JudgeRunner(cfg, registry=CollectorRegistry())
    canaries = build_canaries(r, clock=FakeClock(0.0))
    assert canaries is not None and canaries.judges() == ["groundedness", "relevance_to_query"]
    try:
        # The first judge's canary takes the only slot: the second is skipped as overloaded.
        assert canaries.tick(0.0) == 2
        assert value(r, "tracejudge_judge_canary_skipped_total", judge="relevance_to_query",
                     reason="overloaded") == 1
        # A second later the first is still running: not started again.
        canaries.tick(1.0)
        assert value(r, "tracejudge_judge_canary_skipped_total", judge="groundedness",
                     reason="in_flight") == 1
        wait_until(lambda: canary_count(r, "groundedness") == 1, timeout=60)
        assert stub.count("/chat/completions") == 1
    finally:
        r.close()


def test_the_users_canary_file_bad_lines_are_counted_not_fatal(stub: OpenAIStub, tmp_path: Path) -> None:
    good = {"request": "Is the shop open on Sunday?", "response": "No, it is closed on Sundays.",
            "expected": {"relevance_to_query": "pass"}}
    lines = [orjson.dumps(good).decode(), "{not json", orjson.dumps({"request": "x"}).decode(),
             orjson.dumps({**good, "expected": {"relevance_to_query": "maybe"}}).decode(),
             orjson.dumps({**good, "expected": {"politeness": "pass"}}).decode(),
             orjson.dumps({"request": "q", "expected": {"relevance_to_query": "fail"}}).decode()]
    path = tmp_path / "canaries.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = JudgeRunner(config(stub, canary={"file": str(path), "shipped": False}), registry=CollectorRegistry())
    try:
        canaries = build_canaries(r)
        assert canaries is not None
        [only] = canaries.canaries["relevance_to_query"]
        assert only.where == f"{path}:1" and only.expected is True
        for reason, n in (("invalid_record", 2), ("invalid_label", 1), ("unknown_judge", 1),
                          ("missing_inputs", 1)):
            assert value(r, "tracejudge_judge_canary_invalid_total", reason=reason) == n, reason
        missing = JudgeRunner(config(stub, canary={"file": str(tmp_path / "nope.jsonl")}),
                              registry=CollectorRegistry())
        with pytest.raises(JudgeConfigError, match=r"^judges\.canary\.file: cannot read"):
            build_canaries(missing)
    finally:
        r.close()


def record(i: int) -> EvalRecord:
    return EvalRecord(trace_id=f"{i:032x}", app="shop", failed=False, request=f"Question {i}?",
                      response=f"Answer {i}.", retrieved_context=[Document(f"Answer {i}.")])


def test_a_shadow_judge_sees_exactly_its_judges_sample_and_is_not_quality(stub: OpenAIStub) -> None:
    def respond(req: StubRequest) -> Reply:
        # The candidate model says no on records whose number is divisible by 3; the live model says yes.
        if req.body.get("model") == "candidate-model":
            n = int(re.search(r"Answer (\d+)\.", req.prompt).group(1))  # type: ignore[union-attr]
            return Reply.verdict("no" if n % 3 == 0 else "yes")
        return Reply.verdict("yes")

    stub.responder = respond
    cfg = config(stub)
    cfg["builtin"] = {"relevance_to_query": {"sample_rate": 0.4}, "safety": {"sample_rate": 1.0}}
    cfg["shadow"] = {"relevance_v2": {"shadows": "relevance_to_query", "model": "candidate-model"}}
    # The candidate is a relevance_to_query judge (the kind it shadows) under its own name and model.
    r = JudgeRunner(cfg, registry=CollectorRegistry())
    try:
        assert r.judge_names() == ["relevance_to_query", "safety"]
        assert r.shadow_names() == {"relevance_v2": "relevance_to_query"}
        results = list(r.judge_many([record(i) for i in range(60)]))
        live, shadow = {}, {}
        for i, assessments in enumerate(results):
            by = {a.name: a for a in assessments}
            if by["relevance_to_query"].skipped is None:
                live[i] = by["relevance_to_query"].passed
            if "relevance_v2" in by:
                shadow[i] = by["relevance_v2"]
        assert 0 < len(live) < 60
        assert set(shadow) == set(live)  # exactly the records the live judge sampled
        assert all(a.shadow_of == "relevance_to_query" and a.judge.model == "candidate-model"
                   for a in shadow.values())
        assert {a.shadow_of for res in results for a in res if a.name != "relevance_v2"} == {None}
        disagree = sum(1 for i in shadow if i % 3 == 0)
        assert value(r, "tracejudge_judge_shadow_total", judge="relevance_to_query", shadow="relevance_v2",
                     outcome="disagree") == disagree > 0
        assert value(r, "tracejudge_judge_shadow_total", judge="relevance_to_query", shadow="relevance_v2",
                     outcome="agree") == len(shadow) - disagree
        # Quality series: the live judge's only.
        assert value(r, "tracejudge_judge_verdicts_total", app="shop", judge="relevance_to_query",
                     verdict="pass", version="") == len(live)
        for family in ("tracejudge_judge_verdicts_total", "tracejudge_judge_eligible_total",
                       "tracejudge_judge_sampled_total"):
            assert not [s for m in r.metrics.registry.collect() for s in m.samples
                        if s.name == family and s.labels.get("judge") == "relevance_v2"], family
        assert family_total(r, "tracejudge_judge_score") == len(live) + 60
        assert sum(1 for q in stub.chat_requests() if q.body["model"] == "candidate-model") == len(shadow)
    finally:
        r.close()


@pytest.mark.parametrize(
    ("shadow", "key"),
    [
        ({"g2": {"shadows": "safety"}}, "judges.shadow.g2.shadows"),
        ({"g2": {"shadows": "relevance_to_query", "sample_rate": 0.5}}, "judges.shadow.g2.sample_rate"),
        ({"g2": {"shadows": "relevance_to_query", "promt": "x"}}, "judges.shadow.g2.promt"),
        ({"g2": {"shadows": "relevance_to_query", "prompt": "no placeholder"}}, "judges.shadow.g2.prompt"),
        ({"g2": {"shadows": "relevance_to_query", "endpoint": "other"}}, "judges.shadow.g2.endpoint"),
        ({"relevance_to_query": {"shadows": "relevance_to_query"}}, "judges.shadow.relevance_to_query"),
    ],
)
def test_shadow_configuration_errors_name_their_key(stub: OpenAIStub, shadow: dict[str, Any],
                                                    key: str) -> None:
    with pytest.raises(JudgeConfigError) as err:
        load_judges_config(config(stub, shadow=shadow))
    assert err.value.key == key


def test_a_custom_candidate_and_the_canary_judges_key(stub: OpenAIStub) -> None:
    cfg = config(stub, shadow={"concise_v2": {"shadows": "relevance_to_query",
                                              "prompt": "Is this answer on topic? {request} {response}"}})
    parsed = load_judges_config(cfg).shadow_judges()["concise_v2"]
    assert parsed.kind is None and parsed.shadows == "relevance_to_query"
    with pytest.raises(JudgeConfigError) as err:
        load_judges_config(config(stub, canary={"judges": ["safety"]}))
    assert err.value.key == "judges.canary.judges[0]"


def test_tracejudge_run_starts_the_canaries_from_its_poll_loop(stub: OpenAIStub) -> None:
    from support.kafka import settings

    s = settings("127.0.0.1:9", ["traces"], judges=config(stub, canary={"rate_per_minute": 2}))
    runner = StreamRunner(s)  # nothing connects before run()
    try:
        stage = runner.stage
        assert stage.canaries is not None and stage.canaries.judges() == ["relevance_to_query"]
        assert stage.canaries.interval == 30.0
    finally:
        runner.judges.close()
    bad = settings("127.0.0.1:9", ["traces"], judges=config(stub, canary={"file": "/nonexistent.jsonl"}))
    with pytest.raises(ConfigError, match=r"judges\.canary\.file"):
        StreamRunner(bad)


def test_the_otlp_sink_writes_nothing_for_a_shadow_assessment() -> None:
    from collections import Counter

    from support.otlp_receiver import OtlpReceiver

    from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord
    from tracejudge.consumer.sinks.otlp import OtlpSink, OtlpSinkSettings

    def assessment(name: str, shadow_of: str | None) -> dict[str, Any]:
        return {"name": name, "value": "yes", "score": 1.0, "passed": True, "rationale": "ok",
                "error": None, "skipped": None, "source": "llm:m", "shadow_of": shadow_of}

    result = {"schema_version": 6, "trace_id": "ab" * 16, "app": "shop",
              "assessments": [assessment("relevance_to_query", None),
                              assessment("relevance_v2", "relevance_to_query")]}
    with OtlpReceiver() as rx:
        sink = OtlpSink(OtlpSinkSettings.from_mapping({"endpoint": rx.endpoint}, env={}), CollectorRegistry())
        try:
            report = sink.write(SinkBatch("results", 0, [SinkRecord("results", 0, 0, None, result)]))
        finally:
            sink.close()
        assert report.written == 1 and report.skipped == Counter({"shadow": 1})
        assert [e.attributes["gen_ai.evaluation.name"] for e in rx.events()] == ["relevance_to_query"]
