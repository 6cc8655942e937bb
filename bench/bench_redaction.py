"""What redaction before egress costs: CPU per judged record with and without it, in one run.

The endpoint is the OpenAI-compatible stub of the tests (tests/support/openai_stub.py) in its own
process, answering at once (`--delay 0`), so the judge side's CPU is all this process measures. Each
record is judged by four model judges (relevance_to_query, safety, correctness and a custom judge whose
prompt holds request, context and response): four Chat Completions calls, prompts of ~2-3 KB. Half the
records carry personal data (an e-mail address, a phone number, a card number, an IBAN, an API key),
half only ordinary numbers (years, prices, order ids), as production traffic mixes both.

Two measures, in the same run, on two runners alive side by side, one with `redaction: {enabled:
true}` (the default) and one with `{enabled: false}`:

  A/B       the records in batches of 50, each batch judged by both runners one after the other
            (which goes first alternates), over several rounds, as bench_derive.py interleaves its
            two sides: drift in the machine's speed falls on both alike. A side's CPU per record is
            the sum over batches of each batch's median round (`time.process_time()`, all threads).
            The figure: how much more CPU per record the redacting runner spends.
  in-line   the CPU spent inside the redactor (`time.thread_time()` around every `Redaction.text`
            call, on the runner's loop thread where it runs) during the same batches, against the
            rest of the redacting runner's CPU: the cross-check, the part of the difference that is
            the redactor itself (the rest: per-judgement sessions, copied messages, the counter).

Target: redaction adds under 10% to the record's judging CPU.

    python bench/bench_redaction.py                      # 400 records x 15 rounds (~40 s)
    python bench/bench_redaction.py --records 1000 --rounds 9
    python bench/bench_redaction.py --aa                 # both runners without redaction: the noise
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.metrics.judges.redaction import Redaction, Redactor
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.record import Document, EvalRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stub_endpoint import start_endpoint, stop_endpoint

POLICY = (
    "Items bought in 2024 can be returned within 30 days of delivery for a full refund of the price "
    "paid (for example $1,299.99 or 24.50 EUR), provided they are unused and in their original box. "
    "Refunds are issued to the original payment method within 5-7 business days; 95% arrive within "
    "72 hours. Order 20240512-0042 and similar ids can be looked up in the portal, version 3.12.1. "
)


def records(n: int) -> list[EvalRecord]:
    out = []
    for i in range(n):
        pii = i % 2 == 0
        who = f"Customer maria.lopez{i}@example.org, +44 20 7946 {i % 10000:04d}, " if pii else ""
        pay = "card 4111 1111 1111 1111, IBAN DE89 3704 0044 0532 0130 00, " if pii else ""
        key = " My key sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z leaked." if pii else ""
        out.append(
            EvalRecord(
                trace_id=f"{i:032x}",
                app="shop",
                failed=False,
                request=f"{who}question {i}: can I return order 4532015112830367 bought in 2024?{key}",
                response=f"{who}yes: {POLICY}",
                expected_response="Yes, within 30 days of delivery.",
                retrieved_context=[
                    Document(POLICY * 2, "kb://returns"),
                    Document(f"{who}{pay}account history: orders {i}, {i + 1}, {i + 2}. " + POLICY, "crm://1"),
                ],
            )
        )
    return out


def config(url: str, enabled: bool) -> dict[str, Any]:
    return {
        "endpoints": {"default": {"base_url": url, "model": "judge-model", "max_concurrency": 16}},
        "sample_rate": 1.0,
        "builtin": {"relevance_to_query": {}, "safety": {}, "correctness": {}},
        "custom": {"echo": {"prompt": "Request: {request}\nContext: {context}\nResponse: {response}"}},
        "redaction": {"enabled": enabled},
    }


class InlineMeter:
    """CPU of `Redaction.text` calls, measured on the thread that makes them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.texts = 0
        self._orig = Redaction.text
        meter = self

        def timed(session: Redaction, text: str) -> str:
            t0 = time.thread_time()
            try:
                return meter._orig(session, text)
            finally:
                meter.seconds += time.thread_time() - t0
                meter.texts += 1

        Redaction.text = timed  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds, self.texts = 0.0, 0


BATCH = 50


def measure(
    runners: dict[bool, JudgeRunner], recs: list[EvalRecord], rounds: int, meter: InlineMeter
) -> tuple[dict[bool, float], float, int]:
    """CPU per record of each runner (sum of each batch's median round), the redactor's own CPU per
    record (same), and the judgements on redacted text in one pass."""
    batches = [recs[i : i + BATCH] for i in range(0, len(recs), BATCH)]
    cpu: dict[bool, list[list[float]]] = {True: [[] for _ in batches], False: [[] for _ in batches]}
    inline: list[list[float]] = [[] for _ in batches]
    redacted = 0
    for r in range(rounds):
        gc.collect()
        for i, batch in enumerate(batches):
            for enabled in (True, False) if (r + i) % 2 == 0 else (False, True):
                # Every round sees the batch's texts as new, as a stream sees each record once: a
                # judgement's memo of line findings is its own, nothing is remembered across them.
                meter.reset()
                t0 = time.process_time()
                n = sum(bool(a.redacted) for x in runners[enabled].judge_many(batch) for a in x)
                cpu[enabled][i].append(time.process_time() - t0)
                if enabled:
                    inline[i].append(meter.seconds)
                    redacted += n if r == 0 else 0
    per_record = {k: sum(statistics.median(b) for b in v) / len(recs) for k, v in cpu.items()}
    return per_record, sum(statistics.median(b) for b in inline) / len(recs), redacted


def redactor_alone(recs: list[EvalRecord]) -> float:
    """CPU of the redactor on the texts one record's four judgements send (no HTTP)."""
    redactor = Redactor()
    texts = []
    for r in recs:
        ctx = "\n".join(d.content for d in r.retrieved_context or [])
        texts.append([r.request or "", r.response or "", r.expected_response or "", ctx])
    t0 = time.process_time()
    for request, response, expected, ctx in texts:
        memo: dict = {}  # one record's judgements share the memo of its lines, as the runner's do
        for parts in ([request, response], [request, response], [request, response, expected]):
            redactor.session(memo).texts(parts)
        redactor.session(memo).texts([request, ctx, response])
    return (time.process_time() - t0) / len(recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--aa", action="store_true",
                    help="an A/A run: the first runner without redaction too, to show the method's noise")
    args = ap.parse_args()
    recs = records(args.records)
    proc, url = start_endpoint(0)
    meter = InlineMeter()
    try:
        with (JudgeRunner(config(url, not args.aa), registry=CollectorRegistry()) as on,
              JudgeRunner(config(url, False), registry=CollectorRegistry()) as off):
            runners = {True: on, False: off}
            for runner in runners.values():  # warm: connections, imports, the first-call paths
                list(runner.judge_many(recs[:20]))
            meter.reset()
            list(on.judge_many(recs[:1]))
            texts_per_record = meter.texts
            per_record, inline, redacted = measure(runners, recs, args.rounds, meter)
    finally:
        stop_endpoint(proc)
    with_ms, without_ms = per_record[True] * 1e3, per_record[False] * 1e3
    print(f"records: {args.records} in batches of {BATCH}, {args.rounds} rounds, 4 judge calls per record")
    if args.aa:
        print(f"CPU per record, first runner:  {with_ms:.3f} ms (no redaction)")
        print(f"CPU per record, second runner: {without_ms:.3f} ms (no redaction)")
        print(f"A/A difference: {(with_ms - without_ms) / without_ms:+.1%}")
        return
    print(f"judgements on redacted text per pass: {redacted} of {4 * args.records}")
    print(f"texts through the redactor per record: {texts_per_record}")
    print(f"CPU per record without redaction: {without_ms:.3f} ms")
    print(f"CPU per record with redaction:    {with_ms:.3f} ms")
    print(f"in-line redactor CPU per record:  {inline * 1e3:.3f} ms "
          f"({inline / (per_record[True] - inline):+.1%} of the rest of the record's judging CPU)")
    print(f"redactor alone on the record's texts, no HTTP: {redactor_alone(recs) * 1e3:.3f} ms per record")
    print(f"added by redaction (A/B): {(with_ms - without_ms) / without_ms:+.1%} (target: < +10%)")


if __name__ == "__main__":
    main()
