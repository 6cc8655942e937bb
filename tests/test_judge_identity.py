"""Who gave a verdict and what it cost: each assessment's `judge` (endpoint, model, version), `span_id`
and `input_tokens`/`output_tokens`, from heuristic judges and from LLM judges answered by the loopback
OpenAI stub over real HTTP. The version is a fingerprint: the same for the same configuration in
every runner and process, different when a prompt, the model, the endpoint or a verdict setting
changes, and not moved by sampling or filters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from prometheus_client import CollectorRegistry
from support.openai_stub import OpenAIStub, Reply, StubRequest, bag_of_words_vector

from tracejudge.consumer.pipeline import Pipeline, with_judgements
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import JudgeIdentity, SourceRef

VERSION = re.compile(r"^[0-9a-f]{12}$")

RECORD = EvalRecord(
    trace_id="0af7651916cd43dd8448eb211c80319c",
    source_format="otlp_json",
    app="shop",
    failed=False,
    request="How long is the return window?",
    response="Items can be returned within 30 days.",
    retrieved_context=[Document("Items can be returned within 30 days of delivery.", "kb://returns"),
                       Document("Shipping is free above 50 euros.", "kb://shipping")],
)

CUSTOM = {
    "prompt": "Is this answer polite?\n<response>{response}</response>",
    "criteria": "Polite means no insults.",
}


def config(base_url: str = "http://127.0.0.1:9/v1", *, model: str = "judge-model", endpoint: str = "default",
           builtin: dict[str, Any] | None = None, custom: dict[str, Any] | None = None,
           **top: Any) -> dict[str, Any]:
    return {
        "endpoints": {endpoint: {"base_url": base_url, "model": model, "embedding_model": "embed-model",
                                 "backoff_initial_seconds": 0.01, "max_retries": 0}},
        "default_endpoint": endpoint,
        "sample_rate": 1.0,
        "builtin": builtin if builtin is not None else {"relevance_to_query": {}},
        "custom": custom if custom is not None else {},
        **top,
    }


def identities(cfg: dict[str, Any]) -> dict[str, JudgeIdentity]:
    runner = JudgeRunner(cfg, registry=CollectorRegistry())
    try:
        return {c.name: c.judge.identity for c in runner._judges}
    finally:
        runner.close()


def test_heuristic_judges_name_themselves_and_report_no_tokens():
    runner = JudgeRunner({"builtin": {"groundedness": {"provider": "heuristic"},
                                      "relevance_to_query": {"provider": "heuristic"}}},
                         registry=CollectorRegistry())
    grounded, relevant = runner.judge_sync(RECORD)
    no_context = runner.judge_sync(EvalRecord(request="q?", response="An answer.", failed=False))
    runner.close()
    for a in (grounded, relevant):
        assert a.error is None and a.skipped is None and a.source == "heuristic"
        assert a.judge is not None and a.judge.endpoint is None and a.judge.model is None
        assert VERSION.match(a.judge.version)
        assert a.span_id is None and a.input_tokens is None and a.output_tokens is None
        assert a.sample_rate == 1.0
    assert grounded.judge != relevant.judge
    # A skipped judgement says which judge skipped it, too.
    skipped = next(a for a in no_context if a.name == "groundedness")
    assert skipped.skipped == "missing_inputs" and skipped.judge == grounded.judge
    assert skipped.sample_rate == 1.0


def test_each_assessment_carries_its_judges_sample_rate(stub: OpenAIStub):
    runner = JudgeRunner(config(stub.base_url, builtin={"relevance_to_query": {"sample_rate": 0.999999},
                                                        "safety": {"sample_rate": 0.0}}),
                         registry=CollectorRegistry())
    by_name = {a.name: a for a in runner.judge_sync(RECORD)}
    runner.close()
    relevant = by_name["relevance_to_query"]
    assert relevant.value == "yes" and relevant.sample_rate == 0.999999  # this trace is in the sample
    assert by_name["safety"].skipped == "not_sampled" and by_name["safety"].sample_rate == 0.0


def test_llm_judges_carry_endpoint_model_version_and_the_reported_usage(stub: OpenAIStub):
    def answer(req: StubRequest) -> Reply:
        if req.path.endswith("/embeddings"):
            return Reply.embeddings([bag_of_words_vector(str(t)) for t in req.body["input"]], prompt_tokens=9)
        if "numbered item" in req.prompt:  # groundedness: one statement
            return Reply.verdicts({1: "yes"}, prompt_tokens=300, completion_tokens=25)
        if '"questions"' in req.prompt:  # answer_relevancy's question generation
            return Reply.chat({"questions": ["How long is the return window?"] * 2, "noncommittal": False},
                              prompt_tokens=120, completion_tokens=30)
        if "<document>" in req.prompt:  # chunk_relevance: one call per chunk
            return Reply.verdict("yes", prompt_tokens=100, completion_tokens=7)
        return Reply.verdict("yes", prompt_tokens=50, completion_tokens=12)

    stub.responder = answer
    runner = JudgeRunner(
        config(stub.base_url, builtin={"relevance_to_query": {}, "groundedness": {}, "chunk_relevance": {},
                                       "answer_relevancy": {"questions": 2}},
               custom={"polite": CUSTOM}),
        registry=CollectorRegistry(),
    )
    by_name = {a.name: a for a in runner.judge_sync(RECORD)}
    runner.close()
    assert all(a.error is None and a.skipped is None for a in by_name.values()), by_name
    for a in by_name.values():
        assert a.judge is not None and a.judge.endpoint == "default" and a.judge.model == "judge-model"
        assert VERSION.match(a.judge.version)
        assert a.span_id is None  # every configured judge judged the trace as a whole
    assert len({a.judge.version for a in by_name.values()}) == len(by_name)
    usage = {name: (a.input_tokens, a.output_tokens) for name, a in by_name.items()}
    assert usage == {
        "relevance_to_query": (50, 12),
        "polite": (50, 12),
        "groundedness": (300, 25),
        "chunk_relevance": (200, 14),  # two chunks, two calls, summed
        "answer_relevancy": (120 + 9, 30),  # the chat call and the embeddings call
    }


def test_usage_is_null_when_the_endpoint_does_not_report_it_and_kept_on_a_bad_answer(stub: OpenAIStub):
    runner = JudgeRunner(config(stub.base_url), registry=CollectorRegistry())
    stub.enqueue(Reply.verdict("no", prompt_tokens=None),  # no `usage` in the answer
                 Reply.chat("I think yes.", prompt_tokens=33, completion_tokens=4),  # unparseable
                 Reply.error(503, "overloaded"))
    unreported, unparseable, failed = (runner.judge_sync(RECORD)[0] for _ in range(3))
    runner.close()
    assert unreported.value == "no" and (unreported.input_tokens, unreported.output_tokens) == (None, None)
    # The endpoint answered and billed: the judgement's usage stands even though it gave no verdict.
    assert unparseable.error.startswith("unparseable")
    assert (unparseable.input_tokens, unparseable.output_tokens) == (33, 4)
    # No answer, no usage to report.
    assert failed.error.startswith("http_5xx") and failed.input_tokens is None
    for a in (unreported, unparseable, failed):
        assert a.judge == JudgeIdentity("default", "judge-model", unreported.judge.version)


def test_the_version_is_stable_across_runners_pipelines_and_processes(stub: OpenAIStub):
    cfg = config(stub.base_url, builtin={"relevance_to_query": {}, "groundedness": {"provider": "heuristic"}},
                 custom={"polite": CUSTOM})
    first, second = identities(cfg), identities(cfg)
    assert first == second
    # Two pipelines, each with its own runner, write the same judge identity on their results.
    lines = []
    for _ in range(2):
        runner = JudgeRunner(cfg, registry=CollectorRegistry())
        pipeline = Pipeline()
        results = list(with_judgements([pipeline.evaluate(RECORD, SourceRef(format="otlp_json"))], runner))
        runner.close()
        lines.append({a["name"]: a["judge"] for a in json.loads(results[0].to_json())["assessments"]})
    assert lines[0] == lines[1] == {
        "relevance_to_query": {"endpoint": "default", "model": "judge-model",
                               "version": first["relevance_to_query"].version},
        "groundedness": {"endpoint": None, "model": None, "version": first["groundedness"].version},
        "polite": {"endpoint": "default", "model": "judge-model", "version": first["polite"].version},
    }
    # Another interpreter (its own hash seed) computes the same versions.
    script = (
        "import json, sys\n"
        "from prometheus_client import CollectorRegistry\n"
        "from tracejudge.metrics.judges.runner import JudgeRunner\n"
        "r = JudgeRunner(json.loads(sys.argv[1]), registry=CollectorRegistry())\n"
        "print(json.dumps({c.name: c.judge.identity.version for c in r._judges}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, timeout=60,
                          check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(proc.stdout) == {name: ident.version for name, ident in first.items()}


def test_the_version_changes_with_prompt_model_endpoint_and_verdict_settings_only():
    base = identities(config(custom={"polite": CUSTOM}))

    def changed(**kw: Any) -> dict[str, JudgeIdentity]:
        return identities(config(**{"custom": {"polite": CUSTOM}, **kw}))

    # The prompt, the criteria (system message), the model, the endpoint name: a new version.
    for other in (
        changed(custom={"polite": {**CUSTOM, "prompt": CUSTOM["prompt"] + "\nBe strict."}}),
        changed(custom={"polite": {**CUSTOM, "criteria": "Polite means courteous."}}),
        changed(model="judge-model-2"),
        changed(endpoint="other"),
    ):
        assert other["polite"].version != base["polite"].version
    assert changed(model="judge-model-2")["relevance_to_query"].model == "judge-model-2"
    assert changed(endpoint="other")["relevance_to_query"].endpoint == "other"
    # A built-in judge's own settings that change its verdicts: a new version.
    strict = changed(builtin={"relevance_to_query": {"threshold": 0.9}})
    assert strict["relevance_to_query"].version != base["relevance_to_query"].version
    # Which records are judged (sampling, filters) or endpoint plumbing: the same judge.
    same = changed(builtin={"relevance_to_query": {"sample_rate": 0.25, "filters": {"apps": ["shop"]}}},
                   sample_rate=0.5)
    assert same == base
    # A heuristic judge and the LLM judge of the same name are different judges.
    heuristic = changed(builtin={"relevance_to_query": {"provider": "heuristic"}})
    assert heuristic["relevance_to_query"].version != base["relevance_to_query"].version
