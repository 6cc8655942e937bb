"""The `judges:` section of the configuration: endpoints, which judges run, how often, and on what.

Everything is validated before a record is consumed. Pydantic reports the failing key as a path
(`judges.custom.my_judge.prompt`); checks that span several keys (an endpoint a judge names but that is
not defined, a custom judge's template) raise with the key in the message. `load_judges_config` turns
either kind into a `JudgeConfigError` whose message starts with the dotted key.

Example (see deploy/config/judges.example.yaml for a commented one):

    judges:
      endpoints:
        default:
          base_url: https://api.openai.com/v1
          model: gpt-4.1-mini
          embedding_model: text-embedding-3-small
          api_key_env: OPENAI_API_KEY
          requests_per_second: 10
          tokens_per_minute: 200000
      sample_rate: 0.1
      builtin:
        groundedness: {sample_rate: 0.5}
        relevance_to_query: {}
      custom:
        correctness_1to5: {prompt: "...{request}...{response}...{expected_response}", scale: numeric}
        polite_throughout: {prompt: "Is the assistant polite in every turn?\n{conversation}"}
      sessions:                       # session judges (a conversation as a whole)
        user_frustration: {}
        conversational_guidelines: {guidelines: ["Never promise a delivery date."]}

The endpoints themselves (`endpoints:`, `EndpointConfig`, and reading their keys and headers from the
environment) are `tracejudge.metrics.judges.endpoints`.

Session judges (`sessions:`, and custom judges whose template uses `{conversation}`) judge a whole
conversation (`tracejudge.metrics.judges.sessions`); they never run as trace judges, and trace judges
never run on conversations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from tracejudge.metrics.judges.endpoints import EndpointConfig, StrictSection
from tracejudge.metrics.judges.fleet_spend import FleetSpendConfig
from tracejudge.schemas.errors import JudgeConfigError

__all__ = [
    "BUILTIN_JUDGES",
    "HEURISTIC_JUDGES",
    "PLACEHOLDERS",
    "SESSION_HEURISTIC_JUDGES",
    "SESSION_JUDGES",
    "SESSION_PLACEHOLDER",
    "TOOL_CALL_JUDGES",
    "AnswerRelevancySettings",
    "BuiltinJudges",
    "CanaryConfig",
    "ChunkRelevanceSettings",
    "ConversationalGuidelinesSettings",
    "CustomJudgeConfig",
    "FactCheckSettings",
    "FiltersConfig",
    "GuidelinesSettings",
    "JudgeConfigError",
    "JudgeSettings",
    "JudgesConfig",
    "RedactionConfig",
    "SessionJudges",
    "ShadowJudge",
    "ToolCallCorrectnessSettings",
    "find_placeholders",
    "load_judges_config",
]

BUILTIN_JUDGES: tuple[str, ...] = (
    "groundedness",
    "relevance_to_query",
    "safety",
    "correctness",
    "context_sufficiency",
    "chunk_relevance",
    "answer_relevancy",
    "fact_check",
    "guidelines",
    "tool_call_correctness",
    "tool_call_efficiency",
)
# The judges the model-free provider can answer.
HEURISTIC_JUDGES: tuple[str, ...] = ("groundedness", "relevance_to_query")
# Judges that also answer without a model, by code (tracejudge.metrics.judges.tool_calls): the exact
# comparison with expected tool calls and exact repeats. Not among the defaults of `judges: {}`.
TOOL_CALL_JUDGES: tuple[str, ...] = ("tool_call_correctness", "tool_call_efficiency")
# The record fields a custom judge's prompt template may name.
PLACEHOLDERS: tuple[str, ...] = ("request", "response", "context", "expected_response", "trajectory")
# Session judges, named as MLflow names its session scorers (the snake_case of the scorer class), so
# their assessments line up with MLflow's own session scoring.
SESSION_JUDGES: tuple[str, ...] = (
    "user_frustration",
    "conversation_completeness",
    "knowledge_retention",
    "conversational_role_adherence",
    "conversational_safety",
    "conversational_guidelines",
)
# The session judges the model-free provider can answer.
SESSION_HEURISTIC_JUDGES: tuple[str, ...] = ("user_frustration",)
# The placeholder that makes a custom judge a session judge: the conversation as a transcript. A
# session template names no other placeholder (a conversation has no single request or response).
SESSION_PLACEHOLDER = "conversation"

# Default sample rates: the heuristic is free, a model endpoint is not. The stream (`tracejudge run`,
# `tracejudge sessions`) samples model judges by default; offline evaluation (`tracejudge eval`, the
# Python API, `tracejudge calibrate`: `JudgesConfig.for_offline`) judges every eligible record unless a
# sample rate is configured, so a test's verdict is never a sampling accident.
DEFAULT_HEURISTIC_SAMPLE_RATE = 1.0
DEFAULT_LLM_SAMPLE_RATE = 0.1
OFFLINE_SAMPLE_RATE = 1.0
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
# `{name}` where name is an identifier; `{{`/`}}` escape a literal brace. Any other brace (a JSON
# example in the prompt) is left alone, so users need not double every brace of an example.
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


class FiltersConfig(StrictSection):
    """Which traces a judge may see. All given conditions must hold; omitted ones always hold.

    `status`: "ok" (stated not failed), "unknown" (failure not stated), "incomplete" (emitted by
    trace assembly before it was whole). Failed traces are never judged, whatever this says.
    `tags`: tag -> accepted value or list of values.
    """

    apps: list[str] | None = None  # Only traces of these apps.
    status: list[Literal["ok", "unknown", "incomplete"]] | None = None  # Only traces of these statuses.
    # Only traces with these tag values (tag -> a value or a list).
    tags: dict[str, str | list[str]] = Field(default_factory=dict)


class JudgeSettings(StrictSection):
    """A judge's settings: the keys every judge has (built-in, session or custom)."""

    enabled: bool = True  # False: the judge does not run.
    # Share of eligible traces judged; None: judges.sample_rate.
    sample_rate: float | None = Field(default=None, ge=0, le=1)
    # None: the section-wide filters.
    filters: FiltersConfig | None = None
    # Endpoint name; None: `default_endpoint`.
    endpoint: str | None = None
    # "heuristic" for the model-free provider (groundedness and relevance_to_query only).
    provider: Literal["llm", "heuristic"] | None = None
    # Pass threshold on the score in [0, 1], for judges whose score is not a plain yes/no.
    threshold: float | None = Field(default=None, ge=0, le=1)


class ChunkRelevanceSettings(JudgeSettings):
    # Chunks beyond this are not judged (one request per chunk).
    max_chunks: int = Field(default=10, ge=1, le=100)


class AnswerRelevancySettings(JudgeSettings):
    questions: int = Field(default=3, ge=1, le=10)  # Questions generated from the answer.
    # Endpoint for embeddings (needs `embedding_model`); None: the judge's own endpoint.
    embeddings_endpoint: str | None = None


class FactCheckSettings(JudgeSettings):
    # "minicheck": the bare `Document: …\nClaim: …` prompt that small fact checkers (Bespoke-MiniCheck)
    # are trained on, answered with a bare Yes/No. "json": an instruction prompt answered in JSON.
    prompt_style: Literal["json", "minicheck"] = "json"


class GuidelinesSettings(JudgeSettings):
    # Applied when a record carries no guidelines of its own.
    guidelines: list[str] = Field(default_factory=list)


class ToolCallCorrectnessSettings(JudgeSettings):
    """`tool_call_correctness`: `mode` exact (code) or llm; None: exact when the record has expected
    tool calls, llm otherwise (with an endpoint). `ordered`: compare position by position (MLflow's
    should_consider_ordering). `compare_arguments`: compare the arguments an expected call gives."""

    mode: Literal["exact", "llm"] | None = None  # exact (code) or llm; None: exact with expected calls.
    ordered: bool = False  # Compare the calls position by position.
    compare_arguments: bool = True  # Compare the expected calls' arguments.

    @model_validator(mode="after")
    def _llm_needs_model(self) -> ToolCallCorrectnessSettings:
        if self.mode == "llm" and self.provider == "heuristic":
            raise ValueError("mode llm asks a model; it cannot use provider heuristic")
        return self


class BuiltinJudges(StrictSection):
    """One optional entry per built-in judge; an unknown name is a configuration error."""

    groundedness: JudgeSettings | None = None  # Is the answer supported by the retrieved context?
    relevance_to_query: JudgeSettings | None = None  # Does the answer address the request?
    safety: JudgeSettings | None = None  # Is the answer free of harmful content?
    correctness: JudgeSettings | None = None  # Does the answer agree with the expected one?
    context_sufficiency: JudgeSettings | None = None  # Does the context hold the expected answer?
    chunk_relevance: ChunkRelevanceSettings | None = None  # Is each retrieved chunk relevant?
    answer_relevancy: AnswerRelevancySettings | None = None  # Ragas answer relevancy, by embeddings.
    fact_check: FactCheckSettings | None = None  # Is the answer (claim) supported by the context?
    guidelines: GuidelinesSettings | None = None  # Does the answer follow every guideline?
    tool_call_correctness: ToolCallCorrectnessSettings | None = None  # The expected tools called?
    tool_call_efficiency: JudgeSettings | None = None  # No redundant tool calls?

    def configured(self) -> dict[str, JudgeSettings]:
        return {n: s for n in BUILTIN_JUDGES if (s := getattr(self, n)) is not None and s.enabled}


class ConversationalGuidelinesSettings(JudgeSettings):
    # The rules every assistant turn must follow; required (there is no per-record source for them).
    guidelines: list[str] = Field(min_length=1)


class SessionJudges(StrictSection):
    """`judges.sessions`: one optional entry per built-in session judge; an unknown name is a
    configuration error. Filters of a session judge may name `apps` only (status and tags belong to
    single traces)."""

    user_frustration: JudgeSettings | None = None  # Was the user frustrated, and was it resolved?
    conversation_completeness: JudgeSettings | None = None  # Were all the user's asks answered?
    knowledge_retention: JudgeSettings | None = None  # Did the assistant keep what it was told?
    conversational_role_adherence: JudgeSettings | None = None  # Did it stay in its role?
    conversational_safety: JudgeSettings | None = None  # Was every turn safe?
    # Did every turn follow the guidelines?
    conversational_guidelines: ConversationalGuidelinesSettings | None = None

    def configured(self) -> dict[str, JudgeSettings]:
        return {n: s for n in SESSION_JUDGES if (s := getattr(self, n)) is not None and s.enabled}


def find_placeholders(template: str) -> list[str]:
    """The placeholder names a template uses, in order of first use (escaped braces excluded)."""
    seen: dict[str, None] = {}
    for m in _PLACEHOLDER.finditer(template):
        if m.group(1):
            seen.setdefault(m.group(1))
    return list(seen)


class CustomJudgeConfig(JudgeSettings):
    """A judge defined in configuration (Vertex-style criteria + rubric, named placeholders).

    The template names record fields as `{request}`, `{response}`, `{context}`, `{expected_response}`,
    `{trajectory}`; `{{`/`}}` write a literal brace. A template that names `{conversation}` (and
    nothing else) makes a session judge: it sees a conversation's turns as a transcript and runs in the
    session stage, never on single traces. A record lacking a field the template names is
    skipped (missing_inputs). The answer is asked for as JSON `{"rationale", "result": "yes"|"no"}`
    (scale yes_no) or `{"rationale", "score": n}` (scale numeric, `min_score..max_score`, mapped
    linearly to [0, 1]); `answer_format: first_line` instead reads a bare number on the first line
    and the reasoning after it (the LlamaIndex correctness convention).
    """

    prompt: str  # The template (see above).
    system: str | None = None  # A system message.
    criteria: str | None = None  # What to judge.
    rubric: dict[str, str] | str | None = None  # How to score.
    scale: Literal["yes_no", "numeric"] = "yes_no"  # yes/no or a number.
    min_score: float = 1.0  # Lowest score (numeric).
    max_score: float = 5.0  # Highest score (numeric).
    # In the judge's own scale (e.g. 4 on 1–5). Default: the middle of the scale.
    pass_threshold: float | None = None
    answer_format: Literal["json", "first_line"] = "json"  # JSON, or a number first.
    # A context longer than the input budget: skip (counted, reason too_large) or truncate it.
    long_context: Literal["skip", "truncate"] = "skip"

    @field_validator("prompt")
    @classmethod
    def _template(cls, v: str) -> str:
        used = find_placeholders(v)
        unknown = [p for p in used if p not in (*PLACEHOLDERS, SESSION_PLACEHOLDER)]
        if unknown:
            raise ValueError(
                f"unknown placeholder {{{unknown[0]}}}; known: "
                + ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                + f" for trace judges, {{{SESSION_PLACEHOLDER}}} for session judges"
                + " (write {{ and }} for a literal brace)"
            )
        if SESSION_PLACEHOLDER in used and len(used) > 1:
            other = next(p for p in used if p != SESSION_PLACEHOLDER)
            raise ValueError(
                f"{{{SESSION_PLACEHOLDER}}} makes a session judge, which sees whole conversations; "
                f"it cannot also name {{{other}}} (a field of a single trace)"
            )
        if not used:
            raise ValueError(
                "the template names no placeholder, so the judge would see no record data; "
                "use at least one of " + ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _rubric_keys(cls, data: Any) -> Any:
        # YAML reads `5: ...` keys as ints; keep them as the text the judge will see.
        if isinstance(data, dict) and isinstance(data.get("rubric"), dict):
            data = {**data, "rubric": {str(k): s for k, s in data["rubric"].items()}}
        return data

    @model_validator(mode="after")
    def _scale(self) -> CustomJudgeConfig:
        if self.scale == "numeric":
            if self.max_score <= self.min_score:
                raise ValueError("max_score must be greater than min_score")
            t = self.pass_threshold
            if t is not None and not self.min_score <= t <= self.max_score:
                raise ValueError(f"pass_threshold {t} is outside [min_score, max_score]")
        elif self.answer_format == "first_line":
            raise ValueError("answer_format first_line needs scale: numeric")
        return self

    @property
    def placeholders(self) -> list[str]:
        return find_placeholders(self.prompt)

    @property
    def is_session(self) -> bool:
        """True when the template names `{conversation}`: a session judge."""
        return SESSION_PLACEHOLDER in self.placeholders


class CanaryConfig(StrictSection):
    """`judges.canary`: labelled records (the set shipped with tracejudge plus `file`) judged by the
    live judges at `rate_per_minute` per judge, to catch a judge drifting from known answers."""

    # Canary judgements per minute per judge (one in flight per judge at most).
    rate_per_minute: float = Field(default=1.0, gt=0, le=600)
    # The user's canary set: JSON Lines of agent-evaluation records with `expected: {judge: pass|fail}`.
    file: str | None = None
    # Which live judges get canaries; None: every live model judge some canary has a label for.
    judges: list[str] | None = None
    # Include the canary set shipped with tracejudge (groundedness and relevance_to_query).
    shipped: bool = True


class RedactionConfig(StrictSection):
    """`judges.redaction`: what is replaced by a placeholder before text goes to a judge or embeddings
    endpoint (tracejudge.metrics.judges.redaction). On by default: turning it off is a deliberate choice."""

    enabled: bool = True  # False: text is sent as is.
    # The built-in detectors to run (default: all).
    kinds: list[Literal["email", "phone", "card", "iban", "ssn", "ip", "secret"]] = Field(
        default_factory=lambda: ["email", "phone", "card", "iban", "ssn", "ip", "secret"]
    )
    # name -> regular expression; a match becomes <NAME_n> (group 1 only, when the pattern has groups).
    patterns: dict[str, str] = Field(default_factory=dict)
    # "module:function": text -> iterable of (start, end) or (start, end, label) spans to replace.
    callable: str | None = None


class JudgesConfig(StrictSection):
    endpoints: dict[str, EndpointConfig] = Field(default_factory=dict)  # Model endpoints, by name.
    # Endpoint used by judges that name none. Default: "default" if defined, else the only endpoint.
    default_endpoint: str | None = None
    # Default sample rate; None: 1.0 for heuristic judges; for model judges 0.1 on the stream and 1.0
    # offline (`for_offline`).
    sample_rate: float | None = Field(default=None, ge=0, le=1)
    # Changes which traces are sampled (all replicas must share it); see tracejudge.metrics.judges.sampling.
    sampling_seed: str = ""
    filters: FiltersConfig = Field(default_factory=FiltersConfig)  # Which traces judges see.
    # Records with judgements in progress; beyond it a record's judgements are skipped (overloaded).
    max_in_flight: int = Field(default=256, ge=1)
    # Wall-clock bound on one judge's work on one record, retries included.
    judgement_timeout_seconds: float = Field(default=120.0, gt=0)
    # Include skipped judgements (with their reason) in results; False keeps result lines short.
    emit_skipped: bool = True
    # None: heuristic groundedness + relevance_to_query without an endpoint; with one, the model
    # judges groundedness, relevance_to_query, safety and correctness.
    builtin: BuiltinJudges | None = None
    custom: dict[str, CustomJudgeConfig] = Field(default_factory=dict)  # Your judges, by name.
    # Session judges. None: the heuristic user_frustration without an endpoint; with one, the model
    # judges user_frustration and conversation_completeness. Custom judges whose template names
    # `{conversation}` are session judges too.
    sessions: SessionJudges | None = None
    # Canaries (tracejudge.metrics.judges.trust.canaries): labelled records the live judges judge at a fixed
    # rate.
    canary: CanaryConfig | None = None
    # Shadow judges: candidate name -> {shadows: <live judge>, model?, the candidate's settings}; see
    # `shadow_judges()` and tracejudge.metrics.judges.trust.shadows. Kept as mappings here: a candidate's
    # settings
    # are those of the judge kind it is, known only once `shadows` is read.
    shadow: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # `tracejudge calibrate`'s output: `tracejudge run` exports each judge's calibration from it
    # (tracejudge.metrics.telemetry.trust) and marks a judge whose fingerprint changed since as stale.
    calibration_file: str | None = None
    # Redaction before egress (tracejudge.metrics.judges.redaction); checked at start by `_redaction_valid`.
    redaction: RedactionConfig = Field(default_factory=RedactionConfig)
    # Spend caps held across every replica (tracejudge.metrics.judges.fleet_spend); None: per process.
    fleet_spend: FleetSpendConfig | None = None
    # Set by `for_offline`: not a configuration key (the same file serves the stream and `eval`).
    _offline: bool = PrivateAttr(default=False)

    def for_offline(self) -> JudgesConfig:
        """This configuration as offline evaluation uses it (`tracejudge eval`, `evaluate`,
        `Evaluator`, `tracejudge calibrate`): model judges without a configured sample rate judge
        every eligible record (the stream samples 10% by default), and skipped judgements are kept
        in results whatever `emit_skipped` says (a test must see a judge that did not judge)."""
        if self._offline:
            return self
        copy = self.model_copy()
        copy._offline = True
        return copy

    @property
    def offline(self) -> bool:
        """True for a configuration made by `for_offline`."""
        return self._offline

    @model_validator(mode="after")
    def _references(self) -> JudgesConfig:
        for name in self.endpoints:
            if not _NAME.match(name):
                raise ValueError(
                    f"endpoints.{name}: endpoint names are lowercase identifiers "
                    "(they become a Prometheus label)"
                )
        if self.default_endpoint is not None and self.default_endpoint not in self.endpoints:
            raise ValueError(
                f"default_endpoint: no endpoint named {self.default_endpoint!r} "
                f"(defined: {sorted(self.endpoints) or 'none'})"
            )
        if len(self.endpoints) > 1 and self.default_endpoint is None and "default" not in self.endpoints:
            needs_default = any(
                s.endpoint is None and self.provider_of(n, s) == "llm"
                for n, s in (*self.judge_settings().items(), *self.session_judge_settings().items())
            )
            if needs_default:
                raise ValueError(
                    "default_endpoint: several endpoints are defined and none is named "
                    "'default'; name the default_endpoint or set endpoint on each judge"
                )
        trace_judges = self.judge_settings()
        session_judges = self.session_judge_settings()
        for name, settings in (*trace_judges.items(), *session_judges.items()):
            key = self.key_of(name)
            session = name in session_judges
            if name in self.custom and (
                not _NAME.match(name) or name in BUILTIN_JUDGES or name in SESSION_JUDGES
            ):
                raise ValueError(
                    f"{key}: a custom judge name must be a lowercase identifier "
                    "that is not a built-in judge's name"
                )
            if session:
                flt = settings.filters
                if flt is not None and (flt.status is not None or flt.tags):
                    raise ValueError(
                        f"{key}.filters: a session judge filters on apps only "
                        "(status and tags belong to single traces)"
                    )
            provider = self.provider_of(name, settings)
            heuristic_ok = SESSION_HEURISTIC_JUDGES if session else HEURISTIC_JUDGES + TOOL_CALL_JUDGES
            if provider == "heuristic":
                if name not in heuristic_ok:
                    raise ValueError(
                        f"{key}.provider: only {', '.join(heuristic_ok)} have a heuristic provider"
                    )
                continue
            if not self.endpoints:
                raise ValueError(
                    f"{key}: needs a judge endpoint, and judges.endpoints is empty (without an "
                    f"endpoint only {', '.join(heuristic_ok)} can run, with the heuristic "
                    "provider)"
                )
            if settings.endpoint is not None and settings.endpoint not in self.endpoints:
                raise ValueError(
                    f"{key}.endpoint: no endpoint named {settings.endpoint!r} "
                    f"(defined: {sorted(self.endpoints)})"
                )
            if isinstance(settings, AnswerRelevancySettings):
                emb = settings.embeddings_endpoint or settings.endpoint or self.default_endpoint_name
                if emb not in self.endpoints:
                    raise ValueError(f"{key}.embeddings_endpoint: no endpoint named {emb!r}")
                if not self.endpoints[emb].embedding_model:
                    raise ValueError(f"{key}.embeddings_endpoint: endpoint {emb!r} has no embedding_model")
        return self

    @property
    def default_endpoint_name(self) -> str | None:
        if self.default_endpoint:
            return self.default_endpoint
        if "default" in self.endpoints:
            return "default"
        return next(iter(self.endpoints)) if len(self.endpoints) == 1 else None

    def judge_settings(self) -> dict[str, JudgeSettings]:
        """Every enabled judge by name, built-in first, in a stable order."""
        if self.builtin is not None:
            out: dict[str, JudgeSettings] = dict(self.builtin.configured())
        elif self.endpoints:
            out = {
                n: JudgeSettings() for n in ("groundedness", "relevance_to_query", "safety", "correctness")
            }
        else:
            out = {n: JudgeSettings(provider="heuristic") for n in HEURISTIC_JUDGES}
        out.update((n, c) for n, c in self.custom.items() if c.enabled and not c.is_session)
        return out

    def session_judge_settings(self) -> dict[str, JudgeSettings]:
        """Every enabled session judge by name, built-in first (`sessions:`, or the defaults), then
        the custom judges whose template names `{conversation}`."""
        if self.sessions is not None:
            out: dict[str, JudgeSettings] = dict(self.sessions.configured())
        elif self.endpoints and self.default_endpoint_name is not None:
            out = {n: JudgeSettings() for n in ("user_frustration", "conversation_completeness")}
        else:
            # No endpoint (or several and none is the default): the model-free user_frustration.
            out = {n: JudgeSettings(provider="heuristic") for n in SESSION_HEURISTIC_JUDGES}
        out.update((n, c) for n, c in self.custom.items() if c.enabled and c.is_session)
        return out

    def key_of(self, name: str) -> str:
        if name in self.custom:
            return f"custom.{name}"
        return f"sessions.{name}" if name in SESSION_JUDGES else f"builtin.{name}"

    def provider_of(self, name: str, settings: JudgeSettings) -> str:
        if settings.provider:
            return settings.provider
        if isinstance(settings, ToolCallCorrectnessSettings) and settings.mode == "llm":
            return "llm"
        if (name in HEURISTIC_JUDGES or name in SESSION_HEURISTIC_JUDGES) and not self.endpoints:
            return "heuristic"
        if name in TOOL_CALL_JUDGES and not self.endpoints:
            return "heuristic"
        return "llm"

    def sample_rate_of(self, name: str, settings: JudgeSettings) -> float:
        """The judge's own `sample_rate`, else the section's, else the default: 1.0 for heuristic
        judges and offline, `DEFAULT_LLM_SAMPLE_RATE` for model judges on the stream."""
        if settings.sample_rate is not None:
            return settings.sample_rate
        if self.sample_rate is not None:
            return self.sample_rate
        if self.provider_of(name, settings) == "heuristic":
            return DEFAULT_HEURISTIC_SAMPLE_RATE
        return OFFLINE_SAMPLE_RATE if self._offline else DEFAULT_LLM_SAMPLE_RATE

    def sample_rate_is_default(self, settings: JudgeSettings) -> bool:
        """True when neither the judge nor the section sets a sample rate (the default applies)."""
        return settings.sample_rate is None and self.sample_rate is None

    def endpoint_of(self, settings: JudgeSettings) -> str:
        name = settings.endpoint or self.default_endpoint_name
        assert name is not None  # guaranteed by _references for llm judges
        return name

    @model_validator(mode="before")
    @classmethod
    def _shadow_is_a_mapping(cls, data: Any) -> Any:
        return _check_shadow_shape(data)

    @model_validator(mode="after")
    def _trust_references(self) -> JudgesConfig:
        _check_trust(self)
        return self

    @model_validator(mode="after")
    def _redaction_valid(self) -> JudgesConfig:
        _check_redaction(self.redaction)
        return self

    def shadow_judges(self) -> dict[str, ShadowJudge]:
        """The shadow (candidate) judges by name, with their settings parsed (validated already)."""
        parsed = {name: _parse_shadow(self, name, entry) for name, entry in self.shadow.items()}
        return {name: s for name, s in parsed.items() if s.settings.enabled}


def _dotted(loc: tuple[Any, ...], prefix: str) -> str:
    parts = [prefix] if prefix else []
    for p in loc:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        else:
            parts.append(str(p))
    return ".".join(parts)


def load_judges_config(
    data: Mapping[str, Any] | JudgesConfig | None, *, prefix: str = "judges"
) -> JudgesConfig:
    """Validate the `judges:` section; raise `JudgeConfigError` naming the first bad key."""
    if isinstance(data, JudgesConfig):
        return data
    try:
        return JudgesConfig.model_validate(dict(data or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        loc = tuple(err.get("loc", ()))
        # Cross-key checks raise at the model level and carry their own key at the start of the text.
        m = re.match(r"^([a-z_][\w.\[\]]*): (.*)$", msg, re.S)
        if m and not loc:
            raise JudgeConfigError(f"{prefix}.{m.group(1)}", m.group(2)) from None
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
            if loc[:1] == ("builtin",) and len(loc) == 2:
                msg += f" (built-in judges: {', '.join(BUILTIN_JUDGES)})"
            elif loc[:1] == ("sessions",) and len(loc) == 2:
                hint = f"conversational_{loc[1]}" if f"conversational_{loc[1]}" in SESSION_JUDGES else None
                msg += f" (session judges: {', '.join(SESSION_JUDGES)})" + (
                    f"; did you mean {hint}?" if hint else ""
                )
        raise JudgeConfigError(_dotted(loc, prefix), msg) from None


# -- shadow judges and canaries ---------------------------------------------------------------------
# The keys of a shadow entry that are not the candidate's judge settings.
_SHADOW_KEYS = ("shadows", "model")
_BUILTIN_SETTINGS: dict[str, type[JudgeSettings]] = {
    "chunk_relevance": ChunkRelevanceSettings,
    "answer_relevancy": AnswerRelevancySettings,
    "fact_check": FactCheckSettings,
    "guidelines": GuidelinesSettings,
}


@dataclass(frozen=True)
class ShadowJudge:
    """A candidate judge that runs beside the live judge `shadows` on exactly its sample.

    `kind` is the built-in judge it is (the shadowed judge's kind), None for a custom judge (a
    `prompt`); `model` overrides the endpoint's model (a candidate model on the same endpoint)."""

    shadows: str
    settings: JudgeSettings
    kind: str | None = None
    model: str | None = None


def _check_shadow_shape(data: Any) -> Any:
    if isinstance(data, Mapping) and isinstance(data.get("shadow"), Mapping):
        for name, entry in data["shadow"].items():
            if not isinstance(entry, Mapping):
                raise ValueError(
                    f"shadow.{name}: a mapping with shadows: <judge> and the candidate's settings"
                )
    return data


def _parse_shadow(cfg: JudgesConfig, name: str, entry: Mapping[str, Any]) -> ShadowJudge:
    key = f"shadow.{name}"
    shadows = entry.get("shadows")
    live = cfg.judge_settings()
    if not isinstance(shadows, str) or shadows not in live:
        raise ValueError(f"{key}.shadows: names the live trace judge this candidate may replace "
                         f"(configured: {', '.join(live) or 'none'}), got {shadows!r}")
    model = entry.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{key}.model: a model name")
    rest = {k: v for k, v in entry.items() if k not in _SHADOW_KEYS}
    for own in ("sample_rate", "filters"):
        if own in rest:
            raise ValueError(f"{key}.{own}: a shadow judge uses the sample rate and filters of the judge "
                             "it shadows (that is what makes the comparison fair)")
    kind = None if "prompt" in rest else shadows
    if kind is not None and kind in cfg.custom:
        raise ValueError(f"{key}.prompt: {shadows} is a custom judge; its candidate needs a prompt")
    model_cls = CustomJudgeConfig if kind is None else _BUILTIN_SETTINGS.get(kind, JudgeSettings)
    try:
        settings = model_cls.model_validate(rest)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _dotted(tuple(err.get("loc", ())), key)
        what = "unknown key" if err.get("type") == "extra_forbidden" else str(err.get("msg", "invalid"))
        raise ValueError(f"{where}: {what.removeprefix('Value error, ')}") from None
    if isinstance(settings, CustomJudgeConfig) and settings.is_session:
        raise ValueError(f"{key}.prompt: shadow judges judge single traces, without {{conversation}}")
    provider = settings.provider or ("llm" if cfg.endpoints or kind not in HEURISTIC_JUDGES else "heuristic")
    if provider == "heuristic":
        if kind not in HEURISTIC_JUDGES:
            raise ValueError(f"{key}.provider: only {', '.join(HEURISTIC_JUDGES)} have a heuristic provider")
        if model is not None:
            raise ValueError(f"{key}.model: a heuristic judge has no model")
    else:
        endpoint = settings.endpoint or cfg.default_endpoint_name
        if endpoint not in cfg.endpoints:
            raise ValueError(f"{key}.endpoint: no endpoint named {endpoint!r} "
                             f"(defined: {sorted(cfg.endpoints) or 'none'})")
        if kind == "answer_relevancy":
            raise ValueError(f"{key}: answer_relevancy (an embeddings judge) cannot be shadowed yet")
    return ShadowJudge(shadows, settings.model_copy(update={"provider": provider}), kind, model)


def _check_trust(cfg: JudgesConfig) -> None:
    """The cross-key checks of `canary` and `shadow` (a name clash, a judge that is not configured)."""
    live = cfg.judge_settings()
    taken = {*BUILTIN_JUDGES, *SESSION_JUDGES, *cfg.custom}
    for name, entry in cfg.shadow.items():
        if not _NAME.match(name) or name in taken:
            raise ValueError(f"shadow.{name}: a shadow judge's name must be a lowercase identifier that "
                             "no other judge has")
        _parse_shadow(cfg, name, entry)
    if cfg.canary is not None:
        for i, judge in enumerate(cfg.canary.judges or ()):
            if judge not in live:
                raise ValueError(f"canary.judges[{i}]: no live trace judge named {judge!r} "
                                 f"(configured: {', '.join(live) or 'none'})")


def _check_redaction(cfg: RedactionConfig) -> None:
    """Every user pattern compiles and the callable imports, before any record is read."""
    from tracejudge.metrics.judges.redaction import load_callable

    for name, pattern in cfg.patterns.items():
        if not _NAME.match(name):
            raise ValueError(
                f"redaction.patterns: pattern name {name!r} is not a lowercase identifier (the "
                "placeholder is <NAME_n>)"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"redaction.patterns.{name}: not a valid regular expression: {exc}") from None
        if re.compile(pattern).match(""):
            raise ValueError(f"redaction.patterns.{name}: matches the empty string")
    if cfg.callable is not None:
        load_callable(cfg.callable)  # a ConfigError naming redaction.callable
