"""Trace assembly: throughput and memory with many open traces, against parsing alone.

Builds N agent traces (4 spans each, OTel GenAI attributes with chat messages) with the real
OpenTelemetry SDK, encodes them with the SDK's OTLP encoder into export batches that interleave
concurrent traces (as the Collector's Kafka exporter writes them), then in the same run measures:

  parse only   decode every message into spans (`tracejudge.schemas.formats.otlp.decode`), nothing kept
  assembly     decode + `TraceAssembler.add` for every message: all N traces open at once
  emit         `poll()` after the quiet period: every trace built and emitted

and the resident memory the N open traces hold (RSS after adding minus RSS before), next to the size
of the raw messages they came from.

    python bench/bench_assembly.py                       # 10,000 traces, protobuf and OTLP/JSON
    python bench/bench_assembly.py --traces 2000 --format otlp_json
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tracejudge.consumer.stages.assembly import AssemblySettings, TraceAssembler
from tracejudge.schemas.formats import otlp


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_spans(traces: int, concurrency: int) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    per_trace = []
    for i in range(traces):
        question = f"Question {i}: what does the quarterly report say about revenue in region {i % 17}?"
        answer = f"Answer {i}: revenue grew by {i % 9} percent, driven by the enterprise segment."
        user = json.dumps([{"role": "user", "parts": [{"type": "text", "content": question}]}])
        reply = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": answer}],
                             "finish_reason": "stop"}])
        with tracer.start_as_current_span("invoke_agent reports", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.input.messages": user,
                "gen_ai.output.messages": reply}):
            with tracer.start_as_current_span("retrieval kb", kind=SpanKind.CLIENT, attributes={
                    "gen_ai.operation.name": "retrieval", "gen_ai.retrieval.query.text": question,
                    "gen_ai.retrieval.documents": json.dumps(
                        [{"id": f"doc-{i}-{k}", "score": 0.5, "content": f"Report chunk {k} of {i}."}
                         for k in range(3)])}):
                pass
            with tracer.start_as_current_span("execute_tool lookup", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                    "gen_ai.tool.call.arguments": json.dumps({"region": i % 17})}):
                pass
            with tracer.start_as_current_span("chat gpt-4o", kind=SpanKind.CLIENT, attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                    "gen_ai.usage.input_tokens": 120, "gen_ai.usage.output_tokens": 30,
                    "gen_ai.input.messages": user, "gen_ai.output.messages": reply}):
                pass
        per_trace.append(list(exporter.get_finished_spans()))
        exporter.clear()
    # `concurrency` requests in flight at a time: their spans end interleaved.
    ordered = []
    for start in range(0, traces, concurrency):
        group = per_trace[start:start + concurrency]
        for k in range(4):
            ordered.extend(spans[k] for spans in group)
    return ordered


def messages_for(spans: list, per_message: int, fmt: str) -> list[bytes]:
    out = []
    for i in range(0, len(spans), per_message):
        request = encode_spans(spans[i:i + per_message])
        if fmt == "otlp_proto":
            out.append(request.SerializeToString())
            continue
        doc = MessageToDict(request, use_integers_for_enums=True)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if span.get(key):
                            span[key] = base64.b64decode(span[key]).hex()
        out.append(json.dumps(doc, separators=(",", ":")).encode())
    return out


class ManualClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def throughput(fmt: str, messages: list[bytes], traces: int, spans: int, repeat: int) -> dict[str, float]:
    """Best-of-`repeat` seconds for: parse only, parse + keep (no assembler), add, emit."""
    best = {"parse": float("inf"), "keep": float("inf"), "add": float("inf"), "emit": float("inf")}
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        for m in messages:
            otlp.decode(m, fmt)
        best["parse"] = min(best["parse"], time.perf_counter() - t0)

        gc.collect()
        t0 = time.perf_counter()
        kept = [otlp.decode(m, fmt)[1] for m in messages]
        best["keep"] = min(best["keep"], time.perf_counter() - t0)
        del kept

        clock = ManualClock()
        asm = TraceAssembler(AssemblySettings(max_open_traces=traces + 1, max_spans_held=spans + 1),
                             clock=clock)
        gc.collect()
        t0 = time.perf_counter()
        for m in messages:
            asm.add(otlp.decode(m, fmt)[1], source_format=fmt)
        t1 = time.perf_counter()
        assert asm.open_traces == traces, asm.open_traces
        clock.now = 10.0
        emitted = asm.poll()
        t2 = time.perf_counter()
        assert len(emitted) == traces and all(e.trace.complete for e in emitted)
        best["add"], best["emit"] = min(best["add"], t1 - t0), min(best["emit"], t2 - t1)
        del emitted, asm
    return best


def held_memory(fmt: str, messages: list[bytes], traces: int) -> int:
    """Resident memory of `traces` open traces, measured in a fresh process (RSS after minus before):
    in this one, the freed memory of the earlier phases would distort it."""
    with tempfile.NamedTemporaryFile(suffix=".msgs") as f:
        for m in messages:
            f.write(len(m).to_bytes(4, "big") + m)
        f.flush()
        out = subprocess.run([sys.executable, __file__, "--memory-child", f.name, fmt, str(traces)],
                             capture_output=True, check=True, text=True)
    return int(out.stdout.strip())


def memory_child(path: str, fmt: str, traces: int) -> None:
    data, messages, i = Path(path).read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        messages.append(data[i + 4:i + 4 + n])
        i += 4 + n
    asm = TraceAssembler(AssemblySettings(max_open_traces=traces + 1, max_spans_held=10 * traces),
                         clock=lambda: 0.0)
    gc.collect()
    before = rss_bytes()
    for m in messages:
        asm.add(otlp.decode(m, fmt)[1], source_format=fmt)
    gc.collect()
    assert asm.open_traces == traces
    print(rss_bytes() - before)


def main() -> None:
    if sys.argv[1:2] == ["--memory-child"]:
        memory_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=10_000)
    parser.add_argument("--per-message", type=int, default=50, help="spans per Kafka message")
    parser.add_argument("--concurrency", type=int, default=100, help="traces whose spans interleave")
    parser.add_argument("--format", choices=["otlp_proto", "otlp_json", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=3, help="best of N")
    args = parser.parse_args()

    t0 = time.perf_counter()
    spans = make_spans(args.traces, args.concurrency)
    n = len(spans)
    print(f"{args.traces} traces, {n} spans made with the OpenTelemetry SDK in "
          f"{time.perf_counter() - t0:.1f} s; {args.per_message} spans a message, "
          f"{args.concurrency} traces interleaved; best of {args.repeat}")
    formats = ["otlp_proto", "otlp_json"] if args.format == "both" else [args.format]
    print(f"{'format':<11} {'parse only':>14} {'parse+keep':>14} {'assembly':>14} {'vs parse':>8} "
          f"{'add+emit':>14} {'vs parse':>8} {'held RSS':>9} {'/trace':>8} {'raw msgs':>9}")
    for fmt in formats:
        messages = messages_for(spans, args.per_message, fmt)
        raw = sum(len(m) for m in messages)
        t = throughput(fmt, messages, args.traces, n, args.repeat)
        held = held_memory(fmt, messages, args.traces)
        parse, keep, add, total = n / t["parse"], n / t["keep"], n / t["add"], n / (t["add"] + t["emit"])
        print(f"{fmt:<11} {parse:>9,.0f} sp/s {keep:>9,.0f} sp/s {add:>9,.0f} sp/s {add / parse:>8.2f} "
              f"{total:>9,.0f} sp/s {total / parse:>8.2f} {held / 2**20:>6.1f} MB "
              f"{held / args.traces / 1024:>5.1f} KB {raw / 2**20:>6.1f} MB")
    print("parse only: decode and drop; parse+keep: decode and keep every span (no assembler); assembly: "
          "decode + add with every trace open; add+emit: also build and emit them all. held RSS: resident "
          f"memory of the {args.traces} open traces (fresh process); raw msgs: the records they came from.")


if __name__ == "__main__":
    main()
