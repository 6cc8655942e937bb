"""A small synthetic RAG agent, traced with real MLflow tracing, for the demo and the tests.

Two apps answer questions about Tideline, a fictional team task tracker: `support-bot` (plans, billing,
accounts) and `docs-qa` (its REST API). Each request retrieves documents from an in-memory corpus
(`tracejudge.consumer.demo.corpus`; a RETRIEVER span returning `mlflow.entities.Document`s), calls
its topic's tool when it has one (`TOOL_CALL_SHARE` of the time; a TOOL span), then
"calls a model" (a CHAT_MODEL span with `mlflow.chat.tokenUsage`). A configurable share of answers is
ungrounded (built from invented facts that no retrieved document states) and a configurable share of
requests fails with a raised exception recorded on the span that raised it and on the root.

Traces are captured in-process, with no tracking server and nothing written to disk: MLflow's own span
processor (`MlflowV3SpanProcessor`) builds the trace exactly as it would for a tracking server - trace
info, previews, token-usage roll-up - and hands the finished root span to `_CapturingExporter`, which
pops the trace from MLflow's in-memory buffer, the same hand-off MLflow's inference-table exporter
uses. The payload is `Trace.to_json()`, MLflow 3's shape.

Latencies are simulated (span timestamps are set, nothing sleeps), so one process can produce hundreds
of traces per second with realistic-looking p50/p95. With a seed the content, the choices and the
trace/span ids are reproducible; only the wall-clock timestamps differ between runs.

Conversations: every request is a turn of a conversation (MLflow trace metadata `mlflow.trace.session`
and `mlflow.trace.user`, and `session.id`/`user.id` on the root span, which MLflow's OTLP ingest reads).
Up to `concurrent_conversations` are open at once and their turns interleave; each has 1 to `max_turns`
turns about one app's topics. A `frustrated_share` of conversations is a user who is not helped: they
ask a question, ask it again (once or twice), and give up ("Forget it, ..."); `AgentTrace.frustrated`
and `conversation_ended` say what the agent made, so a session judge's verdicts can be compared with it.
No conversation goes `2 * concurrent_conversations` turns without a turn of its own, which bounds the
gap between its turns (the demo's session stage closes a session after a few seconds of silence).

With `mlflow_tracking_uri` the spans are also exported (OTLP/HTTP, `<uri>/v1/traces`, experiment
`mlflow_experiment_id`) to that MLflow tracking server, so its traces exist there under the same
`tr-<hex>` ids and tags (app, topic, version; root attributes `mlflow.traceTag.<key>` then) and a sink
can write verdicts onto them; an unreachable server costs the export (logged by the OpenTelemetry SDK),
never the demo.

Planted causes (`AgentSettings.stale_doc_after`, `failing_tool_after`, `ungrounded_release_after`: off
when None, else on from the trace after that many): the page a monitor should raise, with one cause a
findings analysis can name. A stale document (`STALE_DOC_URI`): its RETRIEVER output carries an
outdated page and every answer of a request that retrieved it is ungrounded. A failing tool
(`FAILING_TOOL`): its span ends in error, the agent answers without it, ungrounded. An ungrounded
release: traces state `RELEASE_VERSION` instead of `version` (tag and metadata `VERSION_TAG`, root
attribute `gen_ai.agent.version`) and `release_ungrounded_share` of the answers are ungrounded. Every
trace states its version. A plant changes only what it causes: the requests - apps, topics,
questions, retrieved documents, tool calls, failures, conversations - are drawn in the same order from
the same random stream whatever is planted (the answers' wording has a stream of its own), so a seed
gives the same requests with and without a plant.

Healthy defaults: 4% ungrounded, 2% failing requests (the demo's 4% of frustrated conversations are
the command's): every alert of deploy/prometheus/rules stays quiet until a cause is planted.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tracejudge.consumer.demo.corpus import GIVE_UPS, REPEATS, TOPICS, Index, Topic, terms

if TYPE_CHECKING:  # mlflow is the `demo` extra; imported when an agent starts
    from mlflow.entities import LiveSpan

# The trace tag naming the app; the MLflow parser reads it for the `app` label (Pipeline(app_tag=...)).
APP_TAG = "app"
APPS: tuple[str, ...] = ("support-bot", "docs-qa")
# One MLflow experiment per app, as separate deployments would log to.
EXPERIMENT_IDS: dict[str, str] = {"support-bot": "1", "docs-qa": "2"}
MODEL = "gpt-4o-mini"
TOP_K = 3
# A request whose topic has a tool calls it this often (the decision is drawn for every request).
TOOL_CALL_SHARE = 0.8

# -- the planted causes: stable strings a findings analysis is expected to name ------------------
# The stale page: retrieved for the plan questions and one about SSO, and no other document is
# retrieved only with it, so its traces are not any other document's (nor any topic's) traces.
STALE_DOC_URI = "https://docs.tideline.example/billing/plans#p1"
STALE_DOC_TEXT = ("Tideline offers two plans, Basic and Pro, both billed yearly. "
                  "(Last reviewed March 2021.)")
# The failing tool: support-bot looks up the asker's account on most account and export questions.
FAILING_TOOL = "get_account"
FAILING_TOOL_ERROR = "account service returned 503 Service Unavailable"
DEGRADED_PREFIX = "I could not look up your account just now. "
# The trace tag and metadata key stating the app's version (`stream.version_tag` names it).
VERSION_TAG = "app_version"
AGENT_VERSION_ATTRIBUTE = "gen_ai.agent.version"
DEFAULT_VERSION = "1.4.0"
RELEASE_VERSION = "1.5.0"
RELEASE_UNGROUNDED_SHARE = 0.35
# What `AgentTrace.planted` names, per plant.
STALE_DOC, FAILING_TOOL_PLANT, UNGROUNDED_RELEASE = "stale-doc", "failing-tool", "ungrounded-release"
PLANTS: tuple[str, ...] = (STALE_DOC, FAILING_TOOL_PLANT, UNGROUNDED_RELEASE)


def _tokens(text: str) -> int:
    # ~0.75 words per token for English prose: close enough for a demo's token counts.
    return max(1, round(len(text.split()) * 4 / 3))


class ToolTimeout(TimeoutError):
    pass


class RateLimited(RuntimeError):
    pass


class IndexUnavailable(ConnectionError):
    pass


class ToolUnavailable(ConnectionError):
    pass


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """`ungrounded_share` applies to the answered requests, `failure_share` to all of them. The
    defaults are the demo's healthy baseline (every alert quiet); a `*_after` plants a cause from
    the trace after that many (None: never)."""

    ungrounded_share: float = 0.04
    failure_share: float = 0.02
    apps: tuple[str, ...] = APPS
    seed: int | None = None
    # Conversations: the share whose user repeats the question and gives up (of conversations),
    # the most turns of a conversation, and how many are open (interleaved) at once.
    frustrated_share: float = 0.0
    max_turns: int = 4
    concurrent_conversations: int = 8
    # Also export the spans to this MLflow tracking server's OTLP endpoint (None: capture only).
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_id: str = "0"
    # The version every trace states until an ungrounded release is planted.
    version: str = DEFAULT_VERSION
    # The planted causes (see the module's docstring).
    stale_doc_after: int | None = None
    failing_tool_after: int | None = None
    ungrounded_release_after: int | None = None
    release_version: str = RELEASE_VERSION
    release_ungrounded_share: float = RELEASE_UNGROUNDED_SHARE

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.concurrent_conversations < 1:
            raise ValueError(f"max_turns and concurrent_conversations must be at least 1, got "
                             f"{self.max_turns} and {self.concurrent_conversations}")
        for name in ("ungrounded_share", "failure_share", "frustrated_share", "release_ungrounded_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        unknown = set(self.apps) - set(APPS)
        if not self.apps or unknown:
            raise ValueError(f"apps must be a non-empty subset of {list(APPS)}, got {list(self.apps)}")
        for name in ("stale_doc_after", "failing_tool_after", "ungrounded_release_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a number of traces (0 or more), got {value}")
        if not self.version.strip() or not self.release_version.strip():
            raise ValueError("version and release_version must not be blank")
        if self.ungrounded_release_after is not None and self.release_version == self.version:
            raise ValueError(f"release_version must differ from version ({self.version!r}): the release "
                             "is told apart by its version")

    def planted_after(self) -> dict[str, int]:
        """The planted causes and the traces served before each takes effect."""
        afters = zip(PLANTS, (self.stale_doc_after, self.failing_tool_after, self.ungrounded_release_after),
                     strict=True)
        return {plant: after for plant, after in afters if after is not None}

    def describe(self, plant: str) -> str:
        """What `plant` does, naming what a findings analysis should name (a doc_uri, a tool, a version)."""
        if plant == STALE_DOC:
            return (f"stale document {STALE_DOC_URI}: answers of requests that retrieve it are "
                    "ungrounded")
        if plant == FAILING_TOOL_PLANT:
            return f"failing tool {FAILING_TOOL}: its span errors and the answer is made up without it"
        if plant == UNGROUNDED_RELEASE:
            return (f"release {self.release_version} replacing {self.version}: "
                    f"{self.release_ungrounded_share:.0%} of its answers ungrounded "
                    f"(instead of {self.ungrounded_share:.0%})")
        raise ValueError(f"unknown plant {plant!r}; one of {', '.join(PLANTS)}")


@dataclass(frozen=True, slots=True)
class AgentTrace:
    """One finished request: the MLflow trace JSON and what the agent meant it to be."""

    trace_id: str
    app: str
    payload: bytes
    failed: bool
    # None when the request failed before answering.
    grounded: bool | None
    tools: tuple[str, ...]
    session_id: str = ""
    user_id: str = ""
    # The conversation's user was made frustrated (repeats, then gives up), and this turn was the
    # conversation's last (`turn` is its 1-based number).
    frustrated: bool = False
    conversation_ended: bool = True
    turn: int = 1
    # The version the trace states, and the planted causes that changed this request (a stale
    # document it retrieved, the failing tool it called, the release that served it).
    version: str = DEFAULT_VERSION
    planted: tuple[str, ...] = ()


@dataclass(slots=True)
class _Conversation:
    session_id: str
    user_id: str
    app: str
    frustrated: bool
    planned: int
    question: str = ""
    asked: list[str] = field(default_factory=list)
    turns: int = 0
    last_served: int = 0


_INSTALL_LOCK = threading.Lock()


class SyntheticRagAgent:
    """Produces MLflow traces of a RAG agent; use as a context manager (it owns MLflow's tracer).

    MLflow has one process-wide tracer provider, so one agent at a time may be open; closing it resets
    MLflow tracing to its defaults.
    """

    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = settings or AgentSettings()
        self._rng = random.Random(self.settings.seed)
        self._ids_rng = random.Random(self._rng.getrandbits(64))
        self._topics = [t for t in TOPICS if t.app in self.settings.apps]
        self._index = {app: Index([d for t in self._topics if t.app == app for d in t.docs])
                       for app in self.settings.apps}
        self._conv_rng = random.Random(self._rng.getrandbits(64))
        # The answers' wording: a stream of its own, so an answer a plant changes changes nothing else.
        self._answer_rng = random.Random(self._rng.getrandbits(64))
        self._captured: list[Any] = []
        self._open = False
        self._sequence = 0
        self._conversations: list[_Conversation] = []
        self._export: Any = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> SyntheticRagAgent:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        if not _INSTALL_LOCK.acquire(blocking=False):
            raise RuntimeError("another SyntheticRagAgent is open; MLflow tracing is process-wide")
        try:
            self._export = _install_capture(self._captured, self._ids_rng, self.settings)
        except BaseException:
            _INSTALL_LOCK.release()
            raise
        self._open = True

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            if self._export is not None:
                # Send what is still batched before MLflow's tracer goes away.
                self._export.shutdown()
                self._export = None
            import mlflow.tracing

            mlflow.tracing.reset()
        finally:
            _INSTALL_LOCK.release()

    # -- producing traces ------------------------------------------------------------------------

    def traces(self, count: int | None = None) -> Iterator[AgentTrace]:
        produced = 0
        while count is None or produced < count:
            yield self.run_once()
            produced += 1

    @property
    def open_conversations(self) -> int:
        return len(self._conversations)

    def finish_conversations(self) -> Iterator[AgentTrace]:
        """The remaining turns of every open conversation, starting no new one (a clean stop: every
        conversation the agent began ends as it planned)."""
        while self._conversations:
            yield self.run_once(start_new=False)

    def run_once(self, *, start_new: bool = True) -> AgentTrace:
        """Serve one synthetic request (the next turn of one of the open conversations) and return its
        finished trace."""
        if not self._open:
            raise RuntimeError("open the agent first (use it as a context manager)")
        rng = self._rng
        self._sequence += 1
        conv = self._pick_conversation(start_new)
        conv.turns += 1
        conv.last_served = self._sequence
        topic, question, query = self._next_question(conv)
        failure = rng.choice(("retriever", "tool", "model")) if rng.random() < self.settings.failure_share \
            else None
        # Drawn for every request, whatever its topic and whatever is planted: the stream of requests
        # stays the same when a plant changes what a request does.
        calls_tool = rng.random() < TOOL_CALL_SHARE and topic.tool is not None
        if failure == "tool" and not calls_tool:
            failure = "model"
        grounded_draw = rng.random()
        active = self._active_plants()
        release = UNGROUNDED_RELEASE in active
        share = self.settings.release_ungrounded_share if release else self.settings.ungrounded_share
        request = _Request(topic=topic, question=question, failure=failure, grounded=grounded_draw >= share,
                           number=self._sequence, session_id=conv.session_id, user_id=conv.user_id,
                           query=query, calls_tool=calls_tool, plants=active,
                           version=self.settings.release_version if release else self.settings.version)
        self._captured.clear()
        served = self._serve(request)
        if len(self._captured) != 1:
            raise RuntimeError(f"expected one captured trace, got {len(self._captured)}")
        trace = self._captured.pop()
        ended = conv.turns >= conv.planned
        if ended:
            self._conversations.remove(conv)
        planted = tuple(p for p in PLANTS if p in served.planted or (p == UNGROUNDED_RELEASE and release))
        return AgentTrace(trace_id=trace.info.trace_id, app=topic.app, payload=trace.to_json().encode(),
                          failed=failure is not None, grounded=None if failure else served.grounded,
                          tools=tuple(served.tools), session_id=conv.session_id, user_id=conv.user_id,
                          frustrated=conv.frustrated, conversation_ended=ended, turn=conv.turns,
                          version=request.version, planted=planted)

    def _active_plants(self) -> frozenset[str]:
        """The plants in effect for the current request: each from the trace after its `after`."""
        return frozenset(p for p, after in self.settings.planted_after().items() if self._sequence > after)

    def _pick_conversation(self, start_new: bool) -> _Conversation:
        rng, open_ = self._conv_rng, self._conversations
        while start_new and len(open_) < self.settings.concurrent_conversations:
            frustrated = rng.random() < self.settings.frustrated_share
            # A frustrated user asks, asks again once or twice, then gives up: 3 or 4 turns.
            planned = rng.choice((3, 4)) if frustrated else rng.randint(1, self.settings.max_turns)
            open_.append(_Conversation(
                session_id=f"conv-{rng.getrandbits(64):016x}", user_id=f"user-{rng.randrange(1, 150)}",
                app=rng.choice(self.settings.apps), frustrated=frustrated, planned=planned,
                last_served=self._sequence))
        if not open_:
            raise RuntimeError("no open conversation (finish_conversations ended them all)")
        # The one kept waiting longest goes next once it has waited two rounds; else any of them.
        oldest = min(open_, key=lambda c: c.last_served)
        if self._sequence - oldest.last_served >= 2 * len(open_):
            return oldest
        return rng.choice(open_)

    def _next_question(self, conv: _Conversation) -> tuple[Topic, str, str]:
        """The user's next message and what the agent searches for: a new question about the app, or,
        for a frustrated user, the first question again and at the end giving up (the agent still
        answers the first question)."""
        rng = self._rng
        topics = [t for t in self._topics if t.app == conv.app]
        if conv.frustrated and conv.turns > 1:
            topic = next(t for t in topics if conv.question in t.questions)
            if conv.turns >= conv.planned:
                return topic, rng.choice(GIVE_UPS), conv.question
            return topic, rng.choice(REPEATS).format(question=conv.question), conv.question
        fresh = [(t, q) for t in topics for q in t.questions if q not in conv.asked]
        topic, question = rng.choice(fresh or [(t, q) for t in topics for q in t.questions])
        conv.asked.append(question)
        if not conv.question:
            conv.question = question
        return topic, question, question

    def _serve(self, req: _Request) -> _Served:
        import mlflow
        from mlflow.entities import SpanType

        rng = self._rng
        clock = _VirtualClock(rng)
        # The version as MLflow's version tracking has an app state it: a trace tag and metadata.
        tags = {APP_TAG: req.topic.app, "topic": req.topic.name, VERSION_TAG: req.version}
        root = mlflow.start_span_no_context(
            "rag_agent", span_type=SpanType.AGENT,
            inputs={"messages": [{"role": "user", "content": req.question}]},
            tags=tags,
            metadata={"mlflow.trace.session": req.session_id, "mlflow.trace.user": req.user_id,
                      VERSION_TAG: req.version},
            experiment_id=EXPERIMENT_IDS[req.topic.app], start_time_ns=clock.start_ns,
        )
        # What MLflow's OTLP ingest reads for the session and the user (trace metadata is not sent
        # over OTLP); the OpenTelemetry semantic conventions' names, the agent's version included.
        root.set_attributes({"session.id": req.session_id, "user.id": req.user_id,
                             AGENT_VERSION_ATTRIBUTE: req.version})
        if self.settings.mlflow_tracking_uri:
            # Trace tags are not sent over OTLP either: MLflow's ingest reads them from the root's
            # `mlflow.traceTag.<key>` attributes (what its own OtelSpanProcessor writes), and an
            # alert's traces link filters MLflow's traces view on the app's tag.
            root.set_attributes({f"{TRACE_TAG_ATTRIBUTE_PREFIX}{k}": v for k, v in tags.items()})
        served = _Served(grounded=req.grounded)
        try:
            docs = self._retrieve(root, req, clock, served)
            if req.calls_tool:
                self._call_tool(root, req, clock, served)
            answer = self._chat(root, req, docs, clock, served)
        except Exception as exc:
            _end_with_exception(root, exc, clock.advance(1, 3))
        else:
            root.end(outputs=answer, end_time_ns=clock.advance(1, 5))
        return served

    def _retrieve(self, root: LiveSpan, req: _Request, clock: _VirtualClock, served: _Served) -> list[Any]:
        import mlflow
        from mlflow.entities import Document, SpanType

        start = clock.advance(1, 4)
        span = mlflow.start_span_no_context("retrieve_docs", span_type=SpanType.RETRIEVER, parent_span=root,
                                            inputs={"query": req.query, "top_k": TOP_K},
                                            start_time_ns=start)
        end = clock.advance(15, 120)
        if req.failure == "retriever":
            _raise_into(span, IndexUnavailable("vector index tideline-docs is unavailable (503)"), end)
        found = self._index[req.topic.app].search(req.query, TOP_K)
        stale = STALE_DOC in req.plants and any(d.uri == STALE_DOC_URI for d in found)
        if stale:
            # The index serves an outdated copy of the page; handed it, the model makes things up.
            served.plant(STALE_DOC)
            served.grounded = False
        docs = [Document(page_content=STALE_DOC_TEXT if stale and d.uri == STALE_DOC_URI else d.text,
                         metadata={"doc_uri": d.uri, "chunk_id": d.doc_id}, id=d.doc_id) for d in found]
        span.end(outputs=docs, end_time_ns=end)
        return docs

    def _call_tool(self, root: LiveSpan, req: _Request, clock: _VirtualClock, served: _Served) -> None:
        import mlflow
        from mlflow.entities import SpanType

        assert req.topic.tool is not None
        name, arg, values = req.topic.tool
        rng = self._rng
        # Every draw made whatever the outcome, so an outcome changes nothing after it.
        value, status = rng.choice(values), rng.choice(("ok", "active", "paid", "operational"))
        start, ok_ms, timeout_ms = clock.advance(1, 5), rng.uniform(40, 400), rng.uniform(5000, 5010)
        served.tools.append(name)
        span = mlflow.start_span_no_context(name, span_type=SpanType.TOOL, parent_span=root,
                                            inputs={arg: value}, start_time_ns=start)
        if req.failure == "tool":
            _raise_into(span, ToolTimeout(f"{name} did not answer within 5.0s"), clock.advance_ms(timeout_ms))
        if FAILING_TOOL_PLANT in req.plants and name == FAILING_TOOL:
            # The agent carries on without the lookup: the span is in error, the trace is not.
            try:
                raise ToolUnavailable(f"{name}: {FAILING_TOOL_ERROR}")
            except ToolUnavailable as exc:
                _end_with_exception(span, exc, clock.advance_ms(ok_ms))
            served.plant(FAILING_TOOL_PLANT)
            served.grounded = False
            served.degraded = True
            return
        span.end(outputs={arg: value, "status": status}, end_time_ns=clock.advance_ms(ok_ms))

    def _chat(self, root: LiveSpan, req: _Request, docs: Sequence[Any], clock: _VirtualClock,
              served: _Served) -> str:
        import mlflow
        from mlflow.entities import SpanType
        from mlflow.tracing.constant import SpanAttributeKey

        rng, words = self._rng, self._answer_rng
        context = "\n".join(f"[{d.id}] {d.page_content}" for d in docs)
        messages = [
            {"role": "system", "content": "Answer the question using only the context below.\n\n"
                                          f"Context:\n{context}"},
            {"role": "user", "content": req.question},
        ]
        if served.grounded:
            # The documents that share the most words with the question carry the answer.
            q = terms(req.query)
            ranked = sorted(docs, key=lambda d: -len(q & terms(d.page_content)))
            answer = " ".join(d.page_content for d in ranked[:words.choice((1, 2))])
        else:
            answer = " ".join(words.sample(req.topic.invented, k=words.choice((1, 2))))
        if served.degraded:
            answer = DEGRADED_PREFIX + answer
        usage = {"input_tokens": sum(_tokens(m["content"]) for m in messages) + 7,
                 "output_tokens": _tokens(answer)}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        start = clock.advance(1, 5)
        span = mlflow.start_span_no_context("chat_completion", span_type=SpanType.CHAT_MODEL,
                                            parent_span=root, start_time_ns=start,
                                            inputs={"messages": messages, "model": MODEL, "temperature": 0})
        span.set_attribute(SpanAttributeKey.MODEL, MODEL)
        span.set_attribute(SpanAttributeKey.MESSAGE_FORMAT, "openai")
        # Time-to-answer grows with the output, as it does for a real model.
        duration = rng.lognormvariate(6.3, 0.45) + 12 * usage["output_tokens"]
        if req.failure == "model":
            _raise_into(span, RateLimited(f"{MODEL}: 429 Too Many Requests"), clock.advance(80, 300))
        span.set_attribute(SpanAttributeKey.CHAT_USAGE, usage)
        span.end(outputs={
            "id": f"chatcmpl-{req.number}", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
                      "total_tokens": usage["total_tokens"]},
        }, end_time_ns=clock.advance_ms(duration))
        return answer


@dataclass(frozen=True, slots=True)
class _Request:
    topic: Topic
    question: str
    failure: str | None
    grounded: bool
    number: int
    session_id: str
    user_id: str
    # What the agent retrieves and answers for: the question, or for a repeat or a give-up the
    # question the conversation is about.
    query: str
    calls_tool: bool = False
    # The plants in effect, and the version serving the request.
    plants: frozenset[str] = frozenset()
    version: str = DEFAULT_VERSION


@dataclass(slots=True)
class _Served:
    """What serving a request did: the tools it called, whether its answer is grounded (a plant can
    make it ungrounded, or degraded: said without a failed lookup), and the plants that changed it."""

    grounded: bool
    tools: list[str] = field(default_factory=list)
    degraded: bool = False
    planted: set[str] = field(default_factory=set)

    def plant(self, name: str) -> None:
        self.planted.add(name)


class _VirtualClock:
    """Simulated span timing: spans are laid out back to back starting a little in the past.

    The root starts ~2 s before now so the trace has (mostly) ended by the time it is produced.
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.start_ns = time.time_ns() - 2_000_000_000
        self.now_ns = self.start_ns

    def advance(self, low_ms: float, high_ms: float) -> int:
        return self.advance_ms(self._rng.uniform(low_ms, high_ms))

    def advance_ms(self, ms: float) -> int:
        self.now_ns += int(ms * 1_000_000)
        return self.now_ns


def _raise_into(span: LiveSpan, exc: Exception, end_ns: int) -> None:
    """Raise `exc` for real (so it carries a traceback), record it on `span` and re-raise."""
    try:
        raise exc
    except Exception as raised:
        _end_with_exception(span, raised, end_ns)
        raise


def _end_with_exception(span: LiveSpan, exc: Exception, end_ns: int) -> None:
    """What `LiveSpan.record_exception` does, with the event inside the span's simulated time."""
    from mlflow.entities import SpanEvent, SpanStatus, SpanStatusCode

    # MLflow stamps the event with the wall clock, which lies outside the simulated span.
    span.add_event(dataclasses.replace(SpanEvent.from_exception(exc), timestamp=end_ns))
    span.set_status(SpanStatus(SpanStatusCode.ERROR, description=f"{type(exc).__name__}: {exc}"))
    span.end(end_time_ns=end_ns)


def _install_capture(sink: list[Any], ids_rng: random.Random, settings: AgentSettings) -> Any:
    """Route MLflow tracing into `sink` through MLflow's own span processor, with no tracking store;
    with `settings.mlflow_tracking_uri` also export every span to that server's OTLP endpoint.
    Returns the exporting span processor (None without one), to be shut down when the agent closes."""
    try:
        from mlflow.tracing.processor.mlflow_v3 import MlflowV3SpanProcessor
        from mlflow.tracing.provider import provider
        from mlflow.tracing.trace_manager import InMemoryTraceManager
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.id_generator import IdGenerator
    except ImportError as exc:
        raise ImportError("the synthetic agent needs mlflow-tracing: pip install 'tracejudge[demo]'") from exc

    class _CapturingExporter(SpanExporter):
        def __init__(self) -> None:
            self._traces = InMemoryTraceManager.get_instance()

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            for span in spans:
                if span.parent is None and (finished := self._traces.pop_trace(span.context.trace_id)):
                    sink.append(finished.trace)
            return SpanExportResult.SUCCESS

    class _SeededIds(IdGenerator):
        """Ids from the agent's RNG, so a seed fixes trace and span ids too."""

        def generate_span_id(self) -> int:
            return ids_rng.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return ids_rng.getrandbits(128) or 1

    tracer_provider = TracerProvider(id_generator=_SeededIds())
    tracer_provider.add_span_processor(MlflowV3SpanProcessor(_CapturingExporter(), export_metrics=False))
    export = None
    if settings.mlflow_tracking_uri:
        export = mlflow_otlp_processor(settings.mlflow_tracking_uri, settings.mlflow_experiment_id)
        tracer_provider.add_span_processor(export)
    # Mark MLflow's lazy initialisation as done so it keeps our provider instead of building its
    # default one, which would log to a tracking store (./mlflow.db by default).
    provider.once.do_once(lambda: None)
    provider.set(tracer_provider)
    return export


# MLflow's OTLP ingest makes a root span attribute `mlflow.traceTag.<key>` the trace tag <key>
# (`mlflow.tracing.constant.SpanAttributeKey.TRACE_TAG_PREFIX`).
TRACE_TAG_ATTRIBUTE_PREFIX = "mlflow.traceTag."

# The export to MLflow must not hold the demo up: a short timeout per batch.
OTLP_EXPORT_TIMEOUT_SECONDS = 5.0


def mlflow_otlp_processor(tracking_uri: str, experiment_id: str = "0") -> Any:
    """A batching span processor exporting OTLP/HTTP protobuf to MLflow's `<tracking_uri>/v1/traces`
    with the `x-mlflow-experiment-id` header: MLflow stores each trace as `tr-<32 hex>`, the id the
    agent's captured trace has too."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = OTLPSpanExporter(endpoint=tracking_uri.rstrip("/") + "/v1/traces",
                                headers={"x-mlflow-experiment-id": experiment_id},
                                timeout=OTLP_EXPORT_TIMEOUT_SECONDS)
    return BatchSpanProcessor(exporter, schedule_delay_millis=500)
