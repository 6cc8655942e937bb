"""The format-neutral trace every input parser produces.

MLflow JSON (3.x and 2.x), OTLP spans under the GenAI / OpenInference / Traceloop conventions and
inference-table rows all end up as a `Trace` of `Span`s before anything is derived from them, so
derivation (`tracejudge.schemas.formats.derive`) is written once and cannot drift between formats.

These are msgspec structs rather than pydantic models or dataclasses on purpose: a trace is built on
the hot path of the stream (tens of thousands of spans per second) and a struct's `__init__` runs in
C, ~3x cheaper than a slotted dataclass's. They are never validated: the parsers raise the errors,
knowing the field and the position that was wrong.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class SpanKind(StrEnum):
    """What a span does, in MLflow's vocabulary (`mlflow.spanType`); other conventions map onto it."""

    AGENT = "AGENT"
    CHAIN = "CHAIN"
    LLM = "LLM"
    CHAT_MODEL = "CHAT_MODEL"
    RETRIEVER = "RETRIEVER"
    TOOL = "TOOL"
    EMBEDDING = "EMBEDDING"
    RERANKER = "RERANKER"
    PARSER = "PARSER"
    UNKNOWN = "UNKNOWN"

    @property
    def is_model_call(self) -> bool:
        return self in (SpanKind.LLM, SpanKind.CHAT_MODEL)


class SpanStatus(StrEnum):
    OK = "OK"
    ERROR = "ERROR"
    UNSET = "UNSET"


class TokenUsage(msgspec.Struct, gc=False):
    """Token counts; any of them may be unknown (None), never guessed."""

    input: int | None = None
    output: int | None = None
    total: int | None = None
    # Input tokens read from the provider's prompt cache, part of `input` (OTel
    # `gen_ai.usage.cache_read.input_tokens`, OpenAI `prompt_tokens_details.cached_tokens`, MLflow
    # `cache_read_input_tokens`); None when the trace does not say. Schema 6.
    cached_input: int | None = None

    def with_total(self) -> TokenUsage:
        """Fill `total` from input + output when only the parts were stated."""
        if self.total is None and self.input is not None and self.output is not None:
            return TokenUsage(self.input, self.output, self.input + self.output, self.cached_input)
        return self


class Document(msgspec.Struct, gc=False):
    """One retrieved chunk: MLflow's `{content, doc_uri}` shape."""

    content: str | None
    doc_uri: str | None = None


class Span(msgspec.Struct, gc=False):
    """One span, ids as lowercase hex whatever the wire encoding was.

    `inputs`/`outputs` are the decoded payloads (`mlflow.spanInputs`, `input.value`, …) or None when
    the span did not record them. `documents` is set by parsers whose convention states retrieved
    documents separately from the outputs (OpenInference `retrieval.documents.N.*`); otherwise the
    documents of a RETRIEVER span are read from its outputs during derivation.
    """

    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int | None
    kind: SpanKind = SpanKind.UNKNOWN
    status: SpanStatus = SpanStatus.UNSET
    status_message: str = ""
    inputs: Any = None
    outputs: Any = None
    token_usage: TokenUsage | None = None
    # "ValueError: tool exploded" when the span carries an `exception` event.
    exception: str | None = None
    documents: list[Document] | None = None
    tool_name: str | None = None
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    # A TOOL span's result as stated, its length in characters (the text of `mlflow.spanOutputs`,
    # `output.value`, `gen_ai.tool.call.result`, `traceloop.entity.output`); None when not text.
    output_chars: int | None = None


class Trace(msgspec.Struct, gc=False):
    """A whole trace as one source stated it. Fields a source does not state stay None."""

    trace_id: str
    spans: list[Span]
    source_format: str
    app: str | None = None
    client_request_id: str | None = None
    # "OK" / "ERROR" / "IN_PROGRESS" when the source states a trace-level state.
    state: str | None = None
    request_time_ms: int | None = None
    duration_ms: float | None = None
    # Trace-level usage (`mlflow.trace.tokenUsage`) wins over the sum of span usage.
    token_usage: TokenUsage | None = None
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    # Expectations logged on the trace as MLflow assessments (`expected_response`, `expected_facts`, …).
    expectations: dict[str, Any] = msgspec.field(default_factory=dict)
    # False when trace assembly had to emit the trace before its root span or quiet period arrived.
    complete: bool = True
    # The conversation the request belongs to and who made it, as the source states them (MLflow
    # metadata, span attributes, or the tag `stream.session_tag` names): `EvalRecord.session_id`.
    session_id: str | None = None
    user_id: str | None = None
    # The app's release as the source states it (`release_version`): `EvalRecord.version`.
    version: str | None = None
    # People's verdicts on the trace (MLflow HUMAN feedback): `HumanLabel`s (`EvalRecord.human_labels`).
    human_labels: list[Any] | None = None
