"""A small synthetic RAG agent, traced with real MLflow tracing, for the demo and the tests.

Two apps answer questions about Tideline, a fictional team task tracker: `support-bot` (plans, billing,
accounts) and `docs-qa` (its REST API). Each request retrieves documents from an in-memory corpus
(a RETRIEVER span returning `mlflow.entities.Document`s), sometimes calls a tool (a TOOL span), then
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
`tr-<hex>` ids and a sink can write verdicts onto them; an unreachable server costs the export (logged
by the OpenTelemetry SDK), never the demo.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mlflow is the `demo` extra; imported when an agent starts
    from mlflow.entities import LiveSpan

# The trace tag naming the app; the MLflow parser reads it for the `app` label (Pipeline(app_tag=...)).
APP_TAG = "app"
APPS: tuple[str, ...] = ("support-bot", "docs-qa")
# One MLflow experiment per app, as separate deployments would log to.
EXPERIMENT_IDS: dict[str, str] = {"support-bot": "1", "docs-qa": "2"}
MODEL = "gpt-4o-mini"
TOP_K = 3
# How a user who was not helped asks again, and how they give up (the last turn of a frustrated
# conversation). Repeating the question and giving up are what a frustration judge looks for.
REPEATS: tuple[str, ...] = ("{question}", "I asked: {question}", "Again: {question}",
                            "That does not answer it. {question}")
GIVE_UPS: tuple[str, ...] = ("Forget it, this is not helping. I will contact support.",
                             "Never mind, I give up.",
                             "This is useless, forget it.")


@dataclass(frozen=True, slots=True)
class CorpusDoc:
    doc_id: str
    uri: str
    text: str


@dataclass(frozen=True, slots=True)
class Topic:
    """Questions about one subject, the documents that answer them and facts nobody wrote down."""

    app: str
    name: str
    questions: tuple[str, ...]
    docs: tuple[CorpusDoc, ...]
    # Plausible, on-topic, and stated by no document: what an ungrounded answer says.
    invented: tuple[str, ...]
    # (tool name, argument name, argument values) when answering needs a lookup.
    tool: tuple[str, str, tuple[str, ...]] | None = None


def _docs(base: str, *texts: str) -> tuple[CorpusDoc, ...]:
    slug = base.rsplit("/", 1)[-1]
    return tuple(CorpusDoc(f"{slug}-{i}", f"https://docs.tideline.example/{base}#p{i}", t)
                 for i, t in enumerate(texts, 1))


TOPICS: tuple[Topic, ...] = (
    Topic("support-bot", "plans",
          ("Which plans does Tideline offer?", "What is included in the Tideline Team plan?",
           "How many members can a Free workspace have?"),
          _docs("billing/plans",
                "Tideline offers three plans: Free, Team and Enterprise.",
                "The Free plan allows up to 5 members and 3 active boards per workspace.",
                "The Team plan costs 8 dollars per member per month and includes unlimited boards."),
          ("Tideline has a Starter plan at 2 dollars that includes phone support around the clock.",
           "Every plan comes with a lifetime licence after 24 months of payments.")),
    Topic("support-bot", "refunds",
          ("Can I get a refund for my Tideline subscription?", "How long do refunds take?",
           "What is the refund policy for annual billing?"),
          _docs("billing/refunds",
                "Annual subscriptions can be refunded in full within 30 days of purchase.",
                "Monthly subscriptions are not refunded, but you can cancel at any time.",
                "Refunds are issued to the original payment method within 5 to 10 business days."),
          ("Refunds are paid out as store credit which expires after 90 days.",
           "A cancellation fee of 15 percent is deducted from every refund."),
          ("lookup_invoice", "invoice_id", ("INV-1042", "INV-2210", "INV-3377"))),
    Topic("support-bot", "sso",
          ("Does Tideline support single sign-on?", "How do I set up SAML SSO?",
           "Which identity providers work with Tideline SSO?"),
          _docs("security/sso",
                "Single sign-on with SAML 2.0 is available on the Enterprise plan.",
                "Tideline SSO has been tested with Okta, Azure AD and Google Workspace.",
                "An owner enables SSO under Settings, Security, then uploads the identity provider "
                "metadata."),
          ("SSO is included in the Free plan when a workspace verifies two domains.",
           "Tideline only supports LDAP bind authentication for single sign-on."),
          ("get_sso_config", "workspace_id", ("ws-12", "ws-480", "ws-733"))),
    Topic("support-bot", "export",
          ("How can I export my Tideline data?", "Can I export boards to CSV?",
           "Is there a full workspace backup?"),
          _docs("data/export",
                "Boards can be exported to CSV or JSON from the board menu.",
                "Workspace owners can request a full export, delivered as a ZIP archive by email.",
                "Full exports include attachments and are available for 7 days after they are ready."),
          ("Exports are mailed on a USB drive to the billing address within a month.",
           "Only PDF exports are supported, one task per page.")),
    Topic("support-bot", "account",
          ("Why was my Tideline account suspended?", "What plan is my workspace on?",
           "How do I transfer workspace ownership?"),
          _docs("account/suspension",
                "An account is suspended after three failed payment attempts on its workspace plan.",
                "Workspace ownership is transferred by the current owner under Settings, Members.",
                "Suspended accounts stay readable for 60 days before they are deleted."),
          ("Suspended workspaces are deleted immediately and cannot be recovered.",
           "Ownership can only be transferred by mailing a signed paper form."),
          ("get_account", "account_id", ("acct-77", "acct-301", "acct-958"))),
    Topic("support-bot", "mobile",
          ("Is there a Tideline mobile app?", "Does the mobile app work offline?",
           "Which phones support the Tideline app?"),
          _docs("apps/mobile",
                "Tideline has mobile apps for iOS 16 or later and Android 11 or later.",
                "The mobile app caches recent boards so they can be read offline.",
                "Changes made offline in the mobile app sync when the device reconnects."),
          ("The mobile app is a paid add-on that costs 4 dollars per device.",
           "Offline mode requires a smartwatch paired with the phone.")),
    Topic("docs-qa", "auth",
          ("How do I authenticate to the Tideline API?", "Where do I create an API token?",
           "Do Tideline API tokens expire?"),
          _docs("api/authentication",
                "API requests are authenticated with a bearer token in the Authorization header.",
                "Personal API tokens are created under Settings, Developer, API tokens.",
                "Tokens expire after 90 days unless they are rotated earlier."),
          ("The API authenticates requests with a signed cookie that lasts one hour.",
           "Tokens never expire and cannot be revoked once created.")),
    Topic("docs-qa", "rate-limits",
          ("What are the Tideline API rate limits?", "What happens when I exceed the rate limit?",
           "How many API requests can I make per minute?"),
          _docs("api/rate-limits",
                "The rate limit is 600 API requests per minute for each token.",
                "Requests that exceed the rate limit get HTTP 429 with a Retry-After header.",
                "Bulk endpoints count as one request per 100 items."),
          ("The API allows 10 requests per day on every plan.",
           "Requests over the limit are queued for an hour and answered by email.")),
    Topic("docs-qa", "pagination",
          ("How does pagination work in the Tideline API?", "How do I get the next page of tasks?",
           "What is the maximum page size?"),
          _docs("api/pagination",
                "Pagination in the API is cursor based: list endpoints return a next_cursor field when "
                "more results exist.",
                "Pass the cursor as the cursor query parameter to fetch the next page.",
                "The page size defaults to 50 and can be raised to at most 200 with the limit parameter."),
          ("Pages are numbered and the API returns all results when page is zero.",
           "The maximum page size is 10000 records for Enterprise tokens.")),
    Topic("docs-qa", "webhooks",
          ("How do Tideline webhooks work?", "How do I verify a webhook signature?",
           "Are failed webhook deliveries retried?"),
          _docs("api/webhooks",
                "Webhooks work by sending a POST request with a JSON body when a task changes.",
                "Each delivery is signed with HMAC SHA-256 in the X-Tideline-Signature header.",
                "Failed deliveries are retried up to 8 times with exponential backoff."),
          ("Webhooks are delivered over FTP once a night in a single batch.",
           "Signatures use MD5 and are sent in the query string."),
          ("list_webhook_deliveries", "webhook_id", ("wh-5", "wh-81", "wh-204"))),
    Topic("docs-qa", "status",
          ("Is Tideline down right now?", "Is there an outage in the EU region?",
           "Where can I check API availability?"),
          _docs("api/status",
                "Current API availability, outages and downtime are published on status.tideline.example.",
                "The API is served from the us-east and EU central regions, which fail over independently.",
                "Scheduled maintenance is announced 72 hours in advance."),
          ("The API shuts down every Sunday for a full day of maintenance.",
           "Outages are only announced through the mobile app."),
          ("check_api_status", "region", ("us-east", "eu-central"))),
    Topic("docs-qa", "sdks",
          ("Is there an official Tideline SDK?", "How do I install the Python SDK?",
           "Which languages have Tideline client libraries?"),
          _docs("api/sdks",
                "Official SDK client libraries exist for three languages: Python, TypeScript and Go.",
                "Install the Python SDK with pip install tideline.",
                "The SDKs retry HTTP 429 responses automatically."),
          ("The only SDK is written in COBOL and ships on request.",
           "The Python SDK must be compiled from source with a licence key.")),
)

_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(("a", "an", "the", "is", "are", "do", "does", "i", "my", "me", "can", "how", "what",
                        "which", "where", "when", "why", "to", "of", "in", "on", "for", "with", "be", "and",
                        "or", "there", "it", "at", "by", "from", "get"))


def _terms(text: str) -> set[str]:
    # A five-letter prefix is a crude stemmer ("refunds"/"refunded"), enough for a toy retriever.
    return {w[:5] for w in _WORD.findall(text.lower()) if w not in _STOPWORDS}


def _tokens(text: str) -> int:
    # ~0.75 words per token for English prose: close enough for a demo's token counts.
    return max(1, round(len(text.split()) * 4 / 3))


class _Index:
    """Keyword retrieval weighted by inverse document frequency: small, deterministic, mostly right."""

    def __init__(self, docs: Sequence[CorpusDoc]) -> None:
        self._docs = [(d, _terms(d.text)) for d in docs]
        df: dict[str, int] = {}
        for _, terms in self._docs:
            for term in terms:
                df[term] = df.get(term, 0) + 1
        self._idf = {term: math.log(len(docs) / n) for term, n in df.items()}

    def search(self, query: str, k: int) -> list[CorpusDoc]:
        q = _terms(query)
        scored = sorted(self._docs, key=lambda dt: (-sum(self._idf[t] for t in q & dt[1]), dt[0].doc_id))
        return [d for d, _ in scored[:k]]


class ToolTimeout(TimeoutError):
    pass


class RateLimited(RuntimeError):
    pass


class IndexUnavailable(ConnectionError):
    pass


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """`ungrounded_share` applies to the answered requests, `failure_share` to all of them."""

    ungrounded_share: float = 0.3
    failure_share: float = 0.05
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

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.concurrent_conversations < 1:
            raise ValueError(f"max_turns and concurrent_conversations must be at least 1, got "
                             f"{self.max_turns} and {self.concurrent_conversations}")
        for name in ("ungrounded_share", "failure_share", "frustrated_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        unknown = set(self.apps) - set(APPS)
        if not self.apps or unknown:
            raise ValueError(f"apps must be a non-empty subset of {list(APPS)}, got {list(self.apps)}")


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
        self._index = {app: _Index([d for t in self._topics if t.app == app for d in t.docs])
                       for app in self.settings.apps}
        self._conv_rng = random.Random(self._rng.getrandbits(64))
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
        if failure == "tool" and topic.tool is None:
            failure = "model"
        grounded = rng.random() >= self.settings.ungrounded_share
        request = _Request(topic=topic, question=question, failure=failure, grounded=grounded,
                           number=self._sequence, session_id=conv.session_id, user_id=conv.user_id,
                           query=query)
        self._captured.clear()
        tools = self._serve(request)
        if len(self._captured) != 1:
            raise RuntimeError(f"expected one captured trace, got {len(self._captured)}")
        trace = self._captured.pop()
        ended = conv.turns >= conv.planned
        if ended:
            self._conversations.remove(conv)
        return AgentTrace(trace_id=trace.info.trace_id, app=topic.app, payload=trace.to_json().encode(),
                          failed=failure is not None, grounded=None if failure else grounded,
                          tools=tools, session_id=conv.session_id, user_id=conv.user_id,
                          frustrated=conv.frustrated, conversation_ended=ended, turn=conv.turns)

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

    def _serve(self, req: _Request) -> tuple[str, ...]:
        import mlflow
        from mlflow.entities import SpanType

        rng = self._rng
        clock = _VirtualClock(rng)
        root = mlflow.start_span_no_context(
            "rag_agent", span_type=SpanType.AGENT,
            inputs={"messages": [{"role": "user", "content": req.question}]},
            tags={APP_TAG: req.topic.app, "topic": req.topic.name},
            metadata={"mlflow.trace.session": req.session_id, "mlflow.trace.user": req.user_id},
            experiment_id=EXPERIMENT_IDS[req.topic.app], start_time_ns=clock.start_ns,
        )
        # What MLflow's OTLP ingest reads for the session and the user (trace metadata is not sent
        # over OTLP); the OpenTelemetry semantic conventions' names.
        root.set_attributes({"session.id": req.session_id, "user.id": req.user_id})
        tools: list[str] = []
        try:
            docs = self._retrieve(root, req, clock)
            if req.topic.tool is not None:
                tools.append(self._call_tool(root, req, clock))
            answer = self._chat(root, req, docs, clock)
        except Exception as exc:
            _end_with_exception(root, exc, clock.advance(1, 3))
        else:
            root.end(outputs=answer, end_time_ns=clock.advance(1, 5))
        return tuple(tools)

    def _retrieve(self, root: LiveSpan, req: _Request, clock: _VirtualClock) -> list[Any]:
        import mlflow
        from mlflow.entities import Document, SpanType

        start = clock.advance(1, 4)
        span = mlflow.start_span_no_context("retrieve_docs", span_type=SpanType.RETRIEVER, parent_span=root,
                                            inputs={"query": req.query, "top_k": TOP_K},
                                            start_time_ns=start)
        end = clock.advance(15, 120)
        if req.failure == "retriever":
            _raise_into(span, IndexUnavailable("vector index tideline-docs is unavailable (503)"), end)
        docs = [Document(page_content=d.text, metadata={"doc_uri": d.uri, "chunk_id": d.doc_id}, id=d.doc_id)
                for d in self._index[req.topic.app].search(req.query, TOP_K)]
        span.end(outputs=docs, end_time_ns=end)
        return docs

    def _call_tool(self, root: LiveSpan, req: _Request, clock: _VirtualClock) -> str:
        import mlflow
        from mlflow.entities import SpanType

        assert req.topic.tool is not None
        name, arg, values = req.topic.tool
        value = self._rng.choice(values)
        start = clock.advance(1, 5)
        span = mlflow.start_span_no_context(name, span_type=SpanType.TOOL, parent_span=root,
                                            inputs={arg: value}, start_time_ns=start)
        if req.failure == "tool":
            _raise_into(span, ToolTimeout(f"{name} did not answer within 5.0s"), clock.advance(5000, 5010))
        span.end(outputs={arg: value, "status": self._rng.choice(("ok", "active", "paid", "operational"))},
                 end_time_ns=clock.advance(40, 400))
        return name

    def _chat(self, root: LiveSpan, req: _Request, docs: Sequence[Any], clock: _VirtualClock) -> str:
        import mlflow
        from mlflow.entities import SpanType
        from mlflow.tracing.constant import SpanAttributeKey

        rng = self._rng
        context = "\n".join(f"[{d.id}] {d.page_content}" for d in docs)
        messages = [
            {"role": "system", "content": "Answer the question using only the context below.\n\n"
                                          f"Context:\n{context}"},
            {"role": "user", "content": req.question},
        ]
        if req.grounded:
            # The documents that share the most words with the question carry the answer.
            q = _terms(req.query)
            ranked = sorted(docs, key=lambda d: -len(q & _terms(d.page_content)))
            answer = " ".join(d.page_content for d in ranked[:rng.choice((1, 2))])
        else:
            answer = " ".join(rng.sample(req.topic.invented, k=rng.choice((1, 2))))
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
