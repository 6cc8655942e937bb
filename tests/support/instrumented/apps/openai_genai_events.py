"""A tool-calling agent loop written directly on the `openai` SDK, traced by the OpenTelemetry GenAI
instrumentor with message content in log records (events), not on spans.

Framework: none — `openai` (chat.completions with `tools=`; the app runs the tools and sends their
results back until the model answers). Instrumentor: `opentelemetry-instrumentation-openai-v2`
(`OpenAIInstrumentor`), with `OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` and
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=EVENT_ONLY`: one `chat {model}` CLIENT span per
chat call with model and token usage but no content; the conversation goes, per chat call, into one
log record `gen_ai.client.inference.operation.details` (trace and span ids of the chat span,
`gen_ai.input.messages` / `gen_ai.output.messages` as structured attributes). The app's own span is
`opentelemetry-util-genai`'s `invoke_agent {name}` (agent name and model only, no messages) and the
tools run without spans: which tools ran is only in the model's tool calls in those log records.
"""

from __future__ import annotations

import openai_genai as _app
from _openai_cases import run_cases

# The same app as openai_genai.py, with the content in log records and tools run without spans.
_app.CAPTURE = "EVENT_ONLY"
_app.TOOL_SPANS = False

SERVICE = "openai-genai-events"
PACKAGES = _app.PACKAGES
instrument = _app.instrument


def run(h) -> None:
    run_cases(h, _app.agent, _app._ran,
              tool_error_note="the tool raised (no span records it); "
                              "the agent sent the error back and answered",
              model_error_note="the first chat call got HTTP 500 (max_retries=0); "
                               "the invoke_agent span failed")
