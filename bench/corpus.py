"""A corpus of realistic MLflow 3 traces, made by the real `mlflow` package.

Seeded RAG/agent apps: a chat-history request, one to three top-level retrievers (one of them
sometimes wrapping a dense retriever and a reranker) returning `Document`s with paragraph-sized chunks, one to
twelve tool calls with structured inputs and outputs, one to three CHAT_MODEL calls whose inputs carry
the retrieved context in their messages and whose outputs are full chat completions with usage,
chain spans for planning steps, and a share of failures. Traces have 5–37 spans; 300 of them
measure 7–45 KB of JSON.

    python bench/corpus.py --traces 200 --out /tmp/corpus.jsonl    # writes Trace.to_json() lines
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
from contextlib import suppress
from typing import Any

import mlflow
from mlflow.entities import Document, SpanType

# The capture helper lives with the tests; the corpus reuses it so both see MLflow's own traces.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from support.mlflow_apps import capture

WORDS = ("consumer", "group", "partition", "offset", "broker", "topic", "replica", "leader", "lag", "commit",
         "rebalance", "retention", "segment", "compaction", "producer", "batch", "linger", "acknowledgement",
         "idempotent", "transaction", "schema", "registry", "serializer", "trace", "span", "latency",
         "token", "retrieval", "context", "answer", "question", "model", "evaluation", "judge", "threshold",
         "metric", "histogram", "gauge", "counter", "alert", "dashboard")
TOOLS = ("search_tickets", "get_order", "lookup_customer", "create_refund", "check_inventory", "get_weather")


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _paragraph(rng: random.Random, low: int, high: int) -> str:
    return " ".join(_sentence(rng, rng.randint(6, 14)) for _ in range(rng.randint(low, high)))


def _retrieve(rng: random.Random, name: str, query: str, k: int, nested: bool) -> list[Document]:
    with mlflow.start_span(name, span_type=SpanType.RETRIEVER) as span:
        span.set_inputs({"query": query, "k": k})
        if nested:
            inner = _retrieve(rng, f"{name}_dense", query, k + 2, nested=False)
            with mlflow.start_span("rerank", span_type=SpanType.RERANKER) as rerank:
                rerank.set_inputs({"n": len(inner)})
                rerank.set_outputs({"kept": k})
            docs = inner[:k]
        else:
            docs = [Document(page_content=_paragraph(rng, 1, 3),
                             metadata={"doc_uri": f"https://kb.example/{name}/{rng.randrange(10**6)}",
                                       "chunk_id": f"c{i}", "score": round(rng.random(), 3)},
                             id=f"d{rng.randrange(10**9)}")
                    for i in range(k)]
        span.set_outputs(docs)
        return docs


def _tool(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(TOOLS)
    with mlflow.start_span(name, span_type=SpanType.TOOL) as span:
        args = {"id": f"{rng.randrange(10**6)}", "verbose": rng.random() < 0.5,
                "filters": {"status": rng.choice(["open", "closed"]), "limit": rng.randint(1, 20)}}
        span.set_inputs(args)
        result = {"items": [{"id": i, "text": _sentence(rng, 8)} for i in range(rng.randint(1, 4))]}
        span.set_outputs(result)
        return result


def _chat(rng: random.Random, messages: list[dict[str, str]], name: str) -> str:
    with mlflow.start_span(name, span_type=SpanType.CHAT_MODEL) as span:
        span.set_inputs({"messages": messages, "model": "gpt-4o-mini", "temperature": 0.2})
        answer = _paragraph(rng, 1, 3)
        prompt_tokens = sum(len(m["content"]) for m in messages) // 4
        completion_tokens = len(answer) // 4
        span.set_outputs({"id": f"chatcmpl-{rng.randrange(10**9)}", "object": "chat.completion",
                          "model": "gpt-4o-mini",
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": answer}}],
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                    "total_tokens": prompt_tokens + completion_tokens}})
        span.set_attribute("mlflow.chat.tokenUsage", {"input_tokens": prompt_tokens,
                                                      "output_tokens": completion_tokens,
                                                      "total_tokens": prompt_tokens + completion_tokens})
        span.set_attribute("mlflow.llm.model", "gpt-4o-mini")
        return answer


def agent(rng: random.Random) -> None:
    history = []
    for _ in range(rng.randint(0, 3)):
        history += [{"role": "user", "content": _sentence(rng, 10)},
                    {"role": "assistant", "content": _paragraph(rng, 1, 2)}]
    question = _sentence(rng, 12).rstrip(".") + "?"
    messages = [*history, {"role": "user", "content": question}]
    with mlflow.start_span("agent", span_type=SpanType.AGENT) as root:
        root.set_inputs({"messages": messages})
        docs: list[Document] = []
        for r in range(rng.randint(1, 3)):
            docs += _retrieve(rng, f"retriever_{r}", question, rng.randint(2, 6), nested=rng.random() < 0.3)
        for _ in range(rng.randint(1, 12)):
            with mlflow.start_span("plan_step", span_type=SpanType.CHAIN) as step:
                step.set_inputs({"thought": _sentence(rng, 8)})
                step.set_outputs(_tool(rng))
        context = "\n\n".join(d.page_content for d in docs)
        answer = ""
        for call in range(rng.randint(1, 3)):
            answer = _chat(rng, [{"role": "system", "content": f"Answer from the context.\n\n{context}"},
                                 *messages], f"llm_{call}")
        if rng.random() < 0.1:
            raise RuntimeError("upstream model timed out")
        root.set_outputs({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]})


def build(count: int, seed: int = 7) -> list[str]:
    """`count` traces as `Trace.to_json()` text."""
    rng = random.Random(seed)
    with capture() as traces:
        for _ in range(count):
            with suppress(RuntimeError):
                agent(rng)
    return list(traces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    traces = build(args.traces, args.seed)
    args.out.write_text("\n".join(traces) + "\n")
    sizes = sorted(len(t) for t in traces)
    print(f"wrote {len(traces)} traces, {sizes[0]}–{sizes[-1]} bytes, to {args.out}")


if __name__ == "__main__":
    main()
