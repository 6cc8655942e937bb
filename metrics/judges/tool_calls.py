"""Tool-call judges with MLflow's names, modes and values: `tool_call_correctness`, `tool_call_efficiency`.

Both judge the record's trajectory (`EvalRecord.trajectory`, the tool calls a trace recorded, in start
order, as MLflow's `extract_tools_called_from_trace` lists them) and answer "yes"/"no" (score 1/0),
as MLflow's `ToolCallCorrectness` and `ToolCallEfficiency` scorers do, so their assessments line up
with MLflow's own scoring of the same traces.

`tool_call_correctness` compares the calls with the expected ones (`EvalRecord.reference_trajectory`,
filled from `expected_tool_calls` `[{name, arguments?}]`, MLflow's expectation, or the Databricks
`reference_trajectory`). Settings (`ToolCallCorrectnessSettings`):
- `mode: exact` is code, no model (MLflow's `should_exact_match=True`; `source: "heuristic"`, the
  repository's mark for a model-free verdict, written back to MLflow as `CODE`). `ordered: true`
  compares position by position (MLflow's `should_consider_ordering`), else the calls are compared as a
  multiset. Arguments are compared as JSON values (key order ignored, no arguments = `{}`, 1 = 1.0) for
  the expected calls that give them, when `compare_arguments` is true (the default); a call without
  expected arguments matches any call of that name. The rationale names the first mismatch.
- `mode: llm` asks the endpoint with MLflow's prompts: with expectations, whether the calls match them
  semantically (MLflow's default "fuzzy" mode); without, whether the calls were reasonable for the
  request ("ground-truth free").
- No mode (the default): exact when the record has expectations, llm when it has none and an endpoint
  is configured; without an endpoint a record without expectations is skipped (`missing_inputs`).
Where tracejudge differs from MLflow, on purpose: the default with expectations is exact (MLflow's is
the LLM); unordered comparison counts repeats (MLflow compares sets, so [a, a, b] matched [a, b, b]);
arguments are compared per expected call that gives them (MLflow ignores all arguments when one
expected call lacks them).

`tool_call_efficiency` (MLflow's is LLM-only) looks for redundant calls. Code finds exact repeats (the
same tool with JSON-equal arguments as an earlier call) and answers "no" without a model; otherwise,
with an endpoint, MLflow's efficiency prompt asks the model about calls that were unnecessary or could
have been consolidated; without one the verdict is code's "yes" (no exact repeat). A trajectory
without calls is efficient. Limit: a trajectory records no tool errors, so a retry after a failed call
with the same arguments counts as a repeat (MLflow's model is told to forgive such retries).

Neither prompt lists the available tools (MLflow reads them from the trace's model spans; the record
does not keep them). The judges' versions cover their prompts, `TOOL_CALL_CODE_VERSION` and their
settings (mode, ordered, compare_arguments), as every judge's does.

The request, tool names and arguments are trace text: the prompts place them through
`tracejudge.metrics.judges.prompt_safety.embed`, so a tool argument cannot close `</actual_tool_calls>` or add
a line that reads as another call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tracejudge.metrics.judges.base import (
    SYSTEM,
    VERDICT_SCHEMA,
    VERDICT_SHAPE,
    Job,
    Judge,
    JudgeContext,
    clip_text,
    render,
)
from tracejudge.metrics.judges.budget import Cost
from tracejudge.metrics.judges.config import ToolCallCorrectnessSettings
from tracejudge.metrics.judges.custom import format_trajectory
from tracejudge.metrics.judges.heuristic import HeuristicJudge
from tracejudge.metrics.judges.prompt_safety import Fragment, embed, join, trusted
from tracejudge.schemas.record import EvalRecord, ToolCall
from tracejudge.schemas.result import Assessment

__all__ = [
    "TOOL_CALL_CODE_VERSION",
    "CodeToolCallCorrectness",
    "CodeToolCallEfficiency",
    "ToolCallCorrectness",
    "ToolCallEfficiency",
    "Verdict",
    "arguments_key",
    "compare_exact",
    "find_repeats",
]

# Part of the judges' versions: bump it when the comparison or the repeat detection changes.
TOOL_CALL_CODE_VERSION = 1
CODE_SOURCE = "heuristic"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rationale: str


# ---------------------------------------------------------------------------------------------------
# Code: exact comparison and repeats


def _plain(value: Any) -> Any:
    """A JSON value with integral floats as ints, so 1 and 1.0 compare equal (bools stay bools)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def arguments_key(arguments: Any) -> bytes:
    """Canonical JSON of a call's arguments: key order ignored, None the same as {} (MLflow's
    `normalize_tool_call_arguments`)."""
    value = {} if arguments is None else _plain(arguments)
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return repr(value).encode()


def _show(call: ToolCall, with_arguments: bool = True) -> str:
    if not with_arguments:
        return call.tool_name
    return clip_text(f"{call.tool_name}({arguments_key(call.tool_input).decode()})", 120)


def _matches(actual: ToolCall, expected: ToolCall, compare_arguments: bool) -> bool:
    if actual.tool_name != expected.tool_name:
        return False
    if not compare_arguments or expected.tool_input is None:
        return True
    return arguments_key(actual.tool_input) == arguments_key(expected.tool_input)


def _more(n: int, what: str) -> str:
    return f" (and {n} more {what})" if n else ""


def compare_exact(
    actual: Sequence[ToolCall], expected: Sequence[ToolCall], *, ordered: bool, compare_arguments: bool
) -> Verdict:
    """MLflow's exact match (`should_exact_match=True`): the same number of calls, each expected call
    matched by its own actual call, in order when `ordered`."""
    shown = [compare_arguments and e.tool_input is not None for e in expected]
    count = (
        f"Expected {len(expected)} tool call(s), but got {len(actual)} tool call(s); "
        if len(actual) != len(expected)
        else ""
    )
    if ordered:
        bad = [
            i for i in range(max(len(actual), len(expected)))
            if i >= min(len(actual), len(expected))
            or not _matches(actual[i], expected[i], compare_arguments)
        ]
        if not bad:
            return Verdict(True, "All tool calls match expected sequence exactly.")
        i = bad[0]
        want = _show(expected[i], shown[i]) if i < len(expected) else "no call"
        got = _show(actual[i], shown[i] if i < len(expected) else True) if i < len(actual) else "no call"
        return Verdict(
            False, f"{count}Tool calls do not match in order: position {i + 1}: expected {want}, got {got}"
            + _more(len(bad) - 1, "mismatched positions"),
        )
    # Unordered: a multiset match. Expected calls with arguments take their exact counterparts first,
    # so a call expected by name only never uses up the one a specific expectation needs.
    free = list(range(len(actual)))
    missing: list[int] = []
    for j in sorted(range(len(expected)), key=lambda j: not shown[j]):
        i = next((i for i in free if _matches(actual[i], expected[j], compare_arguments)), None)
        if i is None:
            missing.append(j)
        else:
            free.remove(i)
    if not missing and not free:
        return Verdict(True, "All expected tool calls present (order ignored).")
    parts = []
    if missing:
        missing.sort()
        parts.append(f"Missing: {_show(expected[missing[0]], shown[missing[0]])}"
                     + _more(len(missing) - 1, "missing"))
    if free:
        parts.append(f"Unexpected: {_show(actual[free[0]])}" + _more(len(free) - 1, "unexpected"))
    return Verdict(False, count + "; ".join(parts))


def find_repeats(calls: Sequence[ToolCall]) -> list[tuple[int, int]]:
    """(index of the repeat, index of the first such call), 0-based: calls of the same tool with
    JSON-equal arguments as an earlier call."""
    first: dict[tuple[str, bytes], int] = {}
    out = []
    for i, call in enumerate(calls):
        key = (call.tool_name, arguments_key(call.tool_input))
        if key in first:
            out.append((i, first[key]))
        else:
            first[key] = i
    return out


def efficiency_by_code(calls: Sequence[ToolCall]) -> Verdict | None:
    """"no" when some call repeats an earlier one exactly; "yes" with no calls; None otherwise (code
    cannot tell whether distinct calls were needed)."""
    repeats = find_repeats(calls)
    if repeats:
        i, j = repeats[0]
        return Verdict(
            False,
            f"Call {i + 1} {_show(calls[i])} repeats call {j + 1} with the same arguments"
            + _more(len(repeats) - 1, "repeated calls"),
        )
    if not calls:
        return Verdict(True, "No tool calls were made, so none were redundant.")
    return None


# ---------------------------------------------------------------------------------------------------
# Prompts (MLflow's `judges/prompts/tool_call_correctness.py` and `tool_call_efficiency.py`, answered in
# tracejudge's strict JSON verdict shape)

ORDERING_CHECK = "3) Ordering\n- Consider whether the order of tool calls matches the expected order."
ORDERING_IGNORE = (
    "Note: The order of tool calls does not need to match. You should not penalize the agent for "
    "calling tools in a different order than the expected order."
)
GROUND_TRUTH_FREE_PREAMBLE = """\
Consider whether the agent selected appropriate tools and called with the correct arguments for the
task.

Given the user's request and the sequence of tool calls made by the agent, evaluate if the agent chose
suitable tools and used them in a reasonable way."""
GROUND_TRUTH_FREE_CRITERIA = """\
1) Need for tools
- Was using any tool necessary or helpful for this request?
- Did the agent fail to use an obviously appropriate tool?

2) Tool selection
- For each step, is the chosen tool a good match for the subtask?
- Did the agent avoid tools that are clearly irrelevant, overpowered, or disallowed for the request?

3) Arguments and intent alignment
- Are the arguments clearly grounded in the user's request and the tool's apparent purpose?
- Across calls, are key parameters provided in ways that logically follow from prior tool outputs
or user messages, rather than arbitrary changes?

4) Tool flow and combinations
- When multiple tools are used, is the overall sequence of tool choices logically sound?
- Are follow-up tool calls justified by what the agent appears to be trying to achieve with respect
to the user's request?"""
FULL_EXPECTATIONS_PREAMBLE = """\
Compare the actual tool calls against the expected tool calls to determine if they are correct.

Given the user's request, the expected tool calls (ground truth), and the actual tool calls made
by the agent, evaluate whether the actual tool calls semantically match the expected ones."""
FULL_EXPECTATIONS_CRITERIA = """\
1) Tool selection match
- Are the same tools being called (or semantically equivalent alternatives)?
- Are there any missing or extra tool calls compared to expectations?

2) Argument match
- Do the actual arguments convey the same intent as the expected arguments, even if phrased
differently?
- Are there any significant differences in argument values that would change the outcome?"""
PARTIAL_EXPECTATIONS_PREAMBLE = """\
Evaluate tool call correctness by comparing tool selection against expected tool names, and
evaluating whether arguments are reasonable.

Given the user's request, the expected tool names (ground truth), and the actual tool calls made by
the agent, evaluate whether the agent selected the correct tools and used reasonable arguments."""
PARTIAL_EXPECTATIONS_CRITERIA = """\
1) Tool selection match
- Do the actual tool calls match the expected tool names?
- Are there any missing or extra tools compared to expectations?

2) Argument reasonableness
- Are the arguments provided reasonable given the user request and the tools' apparent purpose?"""

CORRECTNESS_PROMPT = (
    """{preamble}

Focus only on the choice of tools and the arguments passed to them. Do NOT judge whether the tools'
outputs or implementations are correct.

Evaluate:

{criteria}

{ordering}

<request>
{request}
</request>

{expected}<actual_tool_calls>
{tools_called}
</actual_tool_calls>

Answer "yes" if the tool calls and arguments are correct and reasonable, and "no" otherwise; if they \
are not, name the problematic calls or arguments in the rationale. """
    + VERDICT_SHAPE
)

EFFICIENCY_PROMPT = (
    """Consider the agent's tool usage for redundancy and inefficiency.

Given the user's request and the sequence of tools called by the agent, determine whether any tool \
calls were unnecessary or could have been made more efficient. In your analysis, treat retries caused by \
temporary tool failures (e.g., timeouts, transient errors) as efficient and not redundant.

Consider in particular:

Calls to the same tool with identical or very similar arguments

Repeated calls to the same tool with the same parameters

Multiple calls that could reasonably have been consolidated into a single call

<request>
{request}
</request>

<tools_called>
{tools_called}
</tools_called>

Answer "yes" if the tool usage is efficient and free of redundancy, and "no" otherwise; if it is not, \
name the redundant calls in the rationale. """
    + VERDICT_SHAPE
)


def _expected_block(expected: Sequence[ToolCall], include_arguments: bool) -> Fragment:
    lines = []
    for i, call in enumerate(expected, 1):
        if include_arguments:
            lines.append(Fragment(f"Expected Tool Call {i}: {embed(call.tool_name)}"))
            args = call.tool_input
            shown = embed(orjson.dumps(args, default=str).decode()) if args else "empty"
            lines.append(Fragment(f"  Arguments: {shown}"))
        else:
            lines.append(Fragment(f"Expected Tool {i}: {embed(call.tool_name)}"))
    return Fragment("<expected_tool_calls>\n" + join(lines) + "\n</expected_tool_calls>\n\n")


def _calls_text(calls: Sequence[ToolCall]) -> Fragment:
    return format_trajectory(list(calls)) or trusted("(no tool calls)")


# ---------------------------------------------------------------------------------------------------
# The judges


def _has_trajectory(record: EvalRecord) -> bool:
    # An empty list is an answer (no calls were made); None means the record does not say.
    return record.trajectory is not None


def _has_expectations(record: EvalRecord) -> bool:
    return bool(record.reference_trajectory)


def _has_request(record: EvalRecord) -> bool:
    return bool(record.request and record.request.strip())


def _settings(judge: Judge) -> ToolCallCorrectnessSettings:
    s = judge.settings
    return s if isinstance(s, ToolCallCorrectnessSettings) else ToolCallCorrectnessSettings()


def _code_assessment(judge: Judge, verdict: Verdict) -> Assessment:
    a = judge.assessment(
        value="yes" if verdict.ok else "no",
        score=1.0 if verdict.ok else 0.0,
        passed=verdict.ok,
        rationale=verdict.rationale,
    )
    a.source = CODE_SOURCE
    return a


def _exact(judge: Judge, record: EvalRecord) -> Verdict:
    s = _settings(judge)
    return compare_exact(
        record.trajectory or [],
        record.reference_trajectory or [],
        ordered=s.ordered,
        compare_arguments=s.compare_arguments,
    )


def _code_job(judge: Judge, verdict: Verdict) -> Job:
    async def run(ctx: JudgeContext) -> Assessment:
        return _code_assessment(judge, verdict)

    return Job(Cost(0, 0), run)


class CodeToolCallCorrectness(HeuristicJudge):
    """Exact mode only: the judge when no endpoint is configured (or `provider: heuristic`)."""

    name = "tool_call_correctness"

    def prompt_material(self) -> tuple[Any, ...]:
        return (TOOL_CALL_CODE_VERSION,)

    def missing_inputs(self, record: EvalRecord) -> list[str]:
        return [n for n, ok in (("trajectory", _has_trajectory(record)),
                                ("expected_tool_calls", _has_expectations(record))) if not ok]

    def judge_now(self, record: EvalRecord) -> Assessment:
        return _code_assessment(self, _exact(self, record))


class ToolCallCorrectness(Judge):
    """With an endpoint: exact (code) or the model, per `mode` and the record's expectations."""

    templates = (SYSTEM, CORRECTNESS_PROMPT, GROUND_TRUTH_FREE_PREAMBLE, GROUND_TRUTH_FREE_CRITERIA,
                 FULL_EXPECTATIONS_PREAMBLE, FULL_EXPECTATIONS_CRITERIA, PARTIAL_EXPECTATIONS_PREAMBLE,
                 PARTIAL_EXPECTATIONS_CRITERIA, ORDERING_CHECK, ORDERING_IGNORE, VERDICT_SCHEMA,
                 TOOL_CALL_CODE_VERSION)

    name = "tool_call_correctness"

    def _uses_code(self, record: EvalRecord) -> bool:
        mode = _settings(self).mode
        return mode == "exact" or (mode is None and _has_expectations(record))

    def missing_inputs(self, record: EvalRecord) -> list[str]:
        missing = [] if _has_trajectory(record) else ["trajectory"]
        if _settings(self).mode == "exact":
            return missing + ([] if _has_expectations(record) else ["expected_tool_calls"])
        if not self._uses_code(record):
            missing += [] if _has_request(record) else ["request"]
        return missing

    def prepare(self, record: EvalRecord) -> Job:
        if self._uses_code(record):
            return _code_job(self, _exact(self, record))
        s = _settings(self)
        expected = record.reference_trajectory or []
        if not expected:
            preamble, criteria, block = GROUND_TRUTH_FREE_PREAMBLE, GROUND_TRUTH_FREE_CRITERIA, trusted("")
        else:
            include = s.compare_arguments and all(c.tool_input is not None for c in expected)
            preamble = FULL_EXPECTATIONS_PREAMBLE if include else PARTIAL_EXPECTATIONS_PREAMBLE
            criteria = FULL_EXPECTATIONS_CRITERIA if include else PARTIAL_EXPECTATIONS_CRITERIA
            block = _expected_block(expected, include)
        return self.single_call(render(
            CORRECTNESS_PROMPT,
            preamble=trusted(preamble),
            criteria=trusted(criteria),
            ordering=trusted(ORDERING_CHECK if s.ordered else ORDERING_IGNORE),
            request=embed(record.request or ""),
            expected=block,
            tools_called=_calls_text(record.trajectory or []),
        ))


class CodeToolCallEfficiency(HeuristicJudge):
    """Exact repeats only: the judge when no endpoint is configured (or `provider: heuristic`)."""

    name = "tool_call_efficiency"

    def prompt_material(self) -> tuple[Any, ...]:
        return (TOOL_CALL_CODE_VERSION,)

    def missing_inputs(self, record: EvalRecord) -> list[str]:
        return [] if _has_trajectory(record) else ["trajectory"]

    def judge_now(self, record: EvalRecord) -> Assessment:
        calls = record.trajectory or []
        verdict = efficiency_by_code(calls) or Verdict(
            True, f"No call repeats an earlier one with the same arguments ({len(calls)} call(s))."
        )
        return _code_assessment(self, verdict)


class ToolCallEfficiency(Judge):
    """With an endpoint: exact repeats by code, the rest by the model (MLflow's prompt)."""

    templates = (SYSTEM, EFFICIENCY_PROMPT, VERDICT_SCHEMA, TOOL_CALL_CODE_VERSION)

    name = "tool_call_efficiency"

    def missing_inputs(self, record: EvalRecord) -> list[str]:
        if not _has_trajectory(record):
            return ["trajectory"]
        # The request matters only when the model is asked (code decides repeats and no calls).
        needs_model = efficiency_by_code(record.trajectory or []) is None
        return ["request"] if needs_model and not _has_request(record) else []

    def prepare(self, record: EvalRecord) -> Job:
        calls = record.trajectory or []
        verdict = efficiency_by_code(calls)
        if verdict is not None:
            return _code_job(self, verdict)
        return self.single_call(
            render(EFFICIENCY_PROMPT, request=embed(record.request or ""), tools_called=_calls_text(calls))
        )
