"""`JudgeRunner`: sampling, filters, budgets, the circuit breaker and metrics around the judges.

For each record and each configured judge, in this order:

    failed trace            -> skipped "failed_trace"
    filters (app/status/tags) do not match -> skipped "filtered"
    required inputs missing -> skipped "missing_inputs"
    ── eligible (tracejudge_judge_eligible_total) ──
    hash(trace id) >= rate  -> skipped "not_sampled"
    ── sampled (tracejudge_judge_sampled_total) ──
    too many records in flight -> skipped "overloaded"
    endpoint circuit open   -> skipped "circuit_open"
    inputs too large even in chunks / nothing to judge -> skipped "too_large" / "not_applicable"
    endpoint budget spent   -> skipped "budget"
    run -> a verdict (tracejudge_judge_verdicts_total, _score) or an error (tracejudge_judge_errors_total)

Every skip is counted in tracejudge_judge_skipped_total{reason} and, unless `emit_skipped: false`,
returned as an `Assessment` with `skipped` set, so a result line says why a judge is absent. Nothing
waits for capacity: a judgement that cannot run now is skipped, so memory stays bounded and the
computed metrics and offset commits keep flowing during a judge outage.

Concurrency model. Judge calls are asyncio coroutines on one event loop per runner (the httpx clients
are bound to it). Two ways in:
- `await runner.judge(record)` from your own event loop (the first loop that calls it owns the runner);
- `runner.submit(record)` from any thread: returns a `concurrent.futures.Future` at once, running the
  judgement on the runner's own background loop thread. Heuristic-only plans complete inline.
At most `max_in_flight` records are judged at a time either way; beyond that the record's judgements
are skipped as "overloaded" rather than queued. `judge_sync` / `judge_many` are the blocking forms for
tests and offline evaluation (`judge_many` keeps at most `max_in_flight` records in flight and never
thins for lack of capacity).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.metrics.budget import EndpointBudget
from tracejudge.metrics.custom_judges import CustomJudge
from tracejudge.metrics.heuristic import HEURISTIC_FACTORIES, HeuristicJudge
from tracejudge.metrics.judge_client import JudgeCallError, JudgeClient
from tracejudge.metrics.judge_config import (
    AnswerRelevancySettings,
    CustomJudgeConfig,
    JudgesConfig,
    load_judges_config,
    resolve_api_key,
    resolve_headers,
)
from tracejudge.metrics.judge_metrics import JudgeMetrics, default_app_label
from tracejudge.metrics.judges import (
    BUILTIN_FACTORIES,
    Judge,
    JudgeAnswerError,
    JudgeContext,
    NotApplicable,
    TooLarge,
)
from tracejudge.metrics.sampling import TraceFilter, sample_point, sampling_key, trace_status
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment

__all__ = ["JudgeRunner"]

log = logging.getLogger(__name__)


@dataclass
class _Configured:
    judge: Judge
    rate: float
    filter: TraceFilter
    client: JudgeClient | None = None
    embeddings: JudgeClient | None = None
    budget: EndpointBudget | None = None

    @property
    def name(self) -> str:
        return self.judge.name

    @property
    def local(self) -> bool:
        return isinstance(self.judge, HeuristicJudge)


@dataclass
class _Plan:
    # What the judges judge: an EvalRecord here; a session's prepared transcript for the session
    # judges (`tracejudge.metrics.session_judges`, which reuses this runner's machinery).
    subject: Any
    app: str
    # Per configured judge, in order: the decided Assessment (a skip) or the judge to run.
    slots: list[Assessment | _Configured]

    @property
    def remote(self) -> bool:
        return any(isinstance(s, _Configured) and not s.local for s in self.slots)


class JudgeRunner:
    """Runs the configured judges on records. See the module docstring for the order of decisions."""

    def __init__(
        self,
        config: JudgesConfig | Mapping[str, Any] | None = None,
        *,
        registry: CollectorRegistry | None = None,
        metrics: JudgeMetrics | None = None,
        app_label: Callable[[str | None], str] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = load_judges_config(config)
        if metrics is None:
            metrics = self._new_metrics(registry if registry is not None else CollectorRegistry(), app_label)
        self.metrics = metrics
        self._clock = clock
        self.clients: dict[str, JudgeClient] = {}
        self.budgets: dict[str, EndpointBudget] = {}
        self._judges = self._configure_all(env)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------- set-up
    # Hooks a runner over other subjects (the session judges) overrides: its metrics, its judges,
    # how it plans a subject (`_plan`) and what a verdict observes (`_observe_verdict`).
    def _new_metrics(self, registry: CollectorRegistry, app_label: Callable[[str | None], str] | None) -> Any:
        return JudgeMetrics(registry, app_label or default_app_label)

    def _configure_all(self, env: Mapping[str, str] | None) -> list[_Configured]:
        return [self._configure(n, s, env) for n, s in self.config.judge_settings().items()]

    def _client(self, name: str, env: Mapping[str, str] | None) -> JudgeClient:
        if name not in self.clients:
            cfg = self.config.endpoints[name]
            self.clients[name] = JudgeClient(
                name,
                cfg,
                api_key=resolve_api_key(name, cfg, env),
                extra_headers=resolve_headers(name, cfg, env),
                on_request=self.metrics.observe_request,
                on_breaker_change=self.metrics.set_circuit_open,
                clock=self._clock,
            )
            self.budgets[name] = EndpointBudget(
                cfg.requests_per_second, cfg.tokens_per_minute, clock=self._clock
            )
            self.metrics.set_circuit_open(name, False)
        return self.clients[name]

    def _configure(self, name: str, settings: Any, env: Mapping[str, str] | None) -> _Configured:
        cfg = self.config
        rate = cfg.sample_rate_of(name, settings)
        flt = TraceFilter(settings.filters if settings.filters is not None else cfg.filters)
        if cfg.provider_of(name, settings) == "heuristic":
            heuristic = HEURISTIC_FACTORIES[name](settings=settings)
            heuristic.identity  # noqa: B018 - computed once, here
            return _Configured(heuristic, rate, flt)
        endpoint_name = cfg.endpoint_of(settings)
        client = self._client(endpoint_name, env)
        embeddings = None
        if isinstance(settings, AnswerRelevancySettings):
            emb_name = settings.embeddings_endpoint or endpoint_name
            embeddings = self._client(emb_name, env)
        judge: Judge
        if isinstance(settings, CustomJudgeConfig):
            judge = CustomJudge(name, settings, client.config, endpoint_name)
        elif name == "answer_relevancy":
            judge = BUILTIN_FACTORIES[name](
                settings=settings,
                endpoint=client.config,
                endpoint_name=endpoint_name,
                embeddings_endpoint=embeddings.config if embeddings else None,
                embeddings_endpoint_name=embeddings.name if embeddings else None,
            )
        else:
            judge = BUILTIN_FACTORIES[name](
                settings=settings, endpoint=client.config, endpoint_name=endpoint_name
            )
        judge.identity  # noqa: B018 - computed once, here, rather than on the first verdict
        return _Configured(judge, rate, flt, client, embeddings, self.budgets[endpoint_name])

    def judge_names(self) -> list[str]:
        """The configured judges, in the order their assessments appear in results."""
        return [c.name for c in self._judges]

    @property
    def needs_event_loop(self) -> bool:
        """False when every judge is local (heuristic): `submit` then always completes inline."""
        return any(not c.local for c in self._judges)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ----------------------------------------------------------------------------------- decisions
    def _skip(
        self,
        app: str,
        cj: _Configured,
        reason: str,
        rationale: str | None = None,
        duration: float | None = None,
    ) -> Assessment:
        self.metrics.observe_skipped(app, cj.name, reason)
        return Assessment(
            name=cj.name,
            skipped=reason,
            rationale=rationale,
            source=cj.judge.source,
            duration_seconds=duration,
            judge=cj.judge.identity,
            sample_rate=cj.rate,
        )

    def _plan(self, record: EvalRecord) -> _Plan:
        app = self.metrics.app_label(record.app)
        status = trace_status(record)
        point: float | None = None
        slots: list[Assessment | _Configured] = []
        for cj in self._judges:
            if status == "failed":
                slots.append(self._skip(app, cj, "failed_trace"))
                continue
            if not cj.filter.matches(record, status):
                slots.append(self._skip(app, cj, "filtered"))
                continue
            missing = cj.judge.missing_inputs(record)
            if missing:
                slots.append(self._skip(app, cj, "missing_inputs", "missing: " + ", ".join(missing)))
                continue
            self.metrics.observe_eligible(app, cj.name)
            if cj.rate < 1.0:
                if point is None:
                    point = sample_point(sampling_key(record), self.config.sampling_seed)
                if not point < cj.rate:
                    slots.append(self._skip(app, cj, "not_sampled"))
                    continue
            self.metrics.observe_sampled(app, cj.name)
            slots.append(cj)
        return _Plan(record, app, slots)

    def _finish(self, plan: _Plan, results: Mapping[int, Assessment]) -> list[Assessment]:
        out = []
        for i, slot in enumerate(plan.slots):
            a = slot if isinstance(slot, Assessment) else results[i]
            if a.skipped is None or self.config.emit_skipped:
                out.append(a)
        return out

    def _run_local(
        self, plan: _Plan, only_local: bool, skip_reason: str | None = None
    ) -> dict[int, Assessment]:
        """Run the heuristic judges inline; with `skip_reason`, skip the remote ones for that reason."""
        done: dict[int, Assessment] = {}
        for i, slot in enumerate(plan.slots):
            if isinstance(slot, _Configured):
                if slot.local:
                    done[i] = self._run_heuristic(slot, plan)
                elif skip_reason is not None:
                    done[i] = self._skip(plan.app, slot, skip_reason)
                elif only_local:
                    raise AssertionError("remote judge in a local-only plan")
        return done

    def _run_heuristic(self, cj: _Configured, plan: _Plan) -> Assessment:
        assert isinstance(cj.judge, HeuristicJudge)
        t0 = time.perf_counter()
        try:
            a = cj.judge.judge_now(plan.subject)
        except NotApplicable as exc:
            return self._skip(plan.app, cj, "not_applicable", str(exc))
        except Exception as exc:  # a bug in a heuristic must not lose the record
            log.warning("heuristic judge %s failed: %s", cj.name, type(exc).__name__)
            a = self._error(cj, "internal", type(exc).__name__)
        return self._observe(plan, cj, a, time.perf_counter() - t0)

    def _error(self, cj: _Configured, reason: str, detail: str) -> Assessment:
        self.metrics.observe_error(cj.name, reason)
        return Assessment(
            name=cj.name, error=f"{reason}: {detail}", source=cj.judge.source, judge=cj.judge.identity
        )

    def _observe(self, plan: _Plan, cj: _Configured, a: Assessment, seconds: float) -> Assessment:
        a.duration_seconds = round(seconds, 6)
        a.sample_rate = cj.rate
        self.metrics.observe_duration(cj.name, seconds)
        if a.error is None and a.skipped is None:
            self._observe_verdict(plan, cj, a)
        return a

    def _observe_verdict(self, plan: _Plan, cj: _Configured, a: Assessment) -> None:
        self.metrics.observe_verdict(
            plan.app, cj.name, passed=a.passed, score=a.score, trace_id=plan.subject.trace_id
        )

    async def _run_remote(self, cj: _Configured, plan: _Plan) -> Assessment:
        assert cj.client is not None
        if not cj.client.breaker.allows() or (
            cj.embeddings is not None and not cj.embeddings.breaker.allows()
        ):
            return self._skip(plan.app, cj, "circuit_open")
        try:
            job = cj.judge.prepare(plan.subject)
        except TooLarge as exc:
            return self._skip(plan.app, cj, "too_large", str(exc))
        except NotApplicable as exc:
            return self._skip(plan.app, cj, "not_applicable", str(exc))
        if cj.budget is not None and not cj.budget.try_acquire(job.cost):
            return self._skip(plan.app, cj, "budget")
        ctx = JudgeContext(cj.client, cj.embeddings)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.judgement_timeout_seconds):
                a = await job.run(ctx)
        except JudgeCallError as exc:
            if exc.reason == "circuit_open" and ctx.requests == 0:
                # Another judgement opened the breaker between our check and our first request.
                return self._skip(plan.app, cj, "circuit_open", duration=round(time.perf_counter() - t0, 6))
            a = self._error(cj, exc.reason, exc.detail)
        except JudgeAnswerError as exc:
            a = self._error(cj, exc.reason, exc.detail)
        except TimeoutError:
            a = self._error(cj, "timeout", f"judgement exceeded {self.config.judgement_timeout_seconds:g}s")
        except Exception as exc:
            log.warning(
                "judge %s failed unexpectedly: %s",
                cj.name,
                type(exc).__name__,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            a = self._error(cj, "internal", type(exc).__name__)
        finally:
            if cj.budget is not None:
                cj.budget.settle(
                    job.cost, requests_made=ctx.requests, tokens_used=ctx.input_tokens + ctx.output_tokens
                )
            self.metrics.observe_tokens(cj.name, ctx.input_tokens, ctx.output_tokens)
        a.input_tokens, a.output_tokens = ctx.reported_usage()
        return self._observe(plan, cj, a, time.perf_counter() - t0)

    async def _execute(self, plan: _Plan) -> list[Assessment]:
        done = self._run_local(plan, only_local=False)
        remote = [(i, s) for i, s in enumerate(plan.slots) if isinstance(s, _Configured) and not s.local]
        results = await asyncio.gather(*(self._run_remote(s, plan) for _, s in remote))
        done.update((i, a) for (i, _), a in zip(remote, results, strict=True))
        return self._finish(plan, done)

    def _enter(self) -> bool:
        with self._lock:
            if self._in_flight >= self.config.max_in_flight:
                return False
            self._in_flight += 1
            self.metrics.in_flight.set(self._in_flight)
            return True

    def _leave(self, *_: Any) -> None:
        with self._lock:
            self._in_flight -= 1
            self.metrics.in_flight.set(self._in_flight)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._bound_loop is None:
            self._bound_loop = loop
        elif self._bound_loop is not loop:
            raise RuntimeError(
                "this JudgeRunner is bound to another event loop (its HTTP clients live there); "
                "call judge() from that loop, or use submit()/judge_sync() everywhere"
            )

    # ----------------------------------------------------------------------------------- public API
    async def judge(self, record: EvalRecord) -> list[Assessment]:
        """All configured judges on one record; never raises for a judge's failure (it is recorded)."""
        plan = self._plan(record)
        if not plan.remote:
            return self._finish(plan, self._run_local(plan, only_local=True))
        if self._closed:
            return self._finish(plan, self._run_local(plan, only_local=False, skip_reason="closed"))
        self._bind()
        if not self._enter():
            return self._finish(plan, self._run_local(plan, only_local=False, skip_reason="overloaded"))
        try:
            return await self._execute(plan)
        finally:
            self._leave()

    def submit(self, record: EvalRecord) -> concurrent.futures.Future[list[Assessment]]:
        """Thread-safe, non-blocking: judge on the runner's background loop. The future is already done
        when nothing remote needs to run (heuristics, all skipped, overloaded, closed)."""
        plan = self._plan(record)
        reason = None
        if plan.remote:
            if self._closed:
                reason = "closed"
            elif not self._enter():
                reason = "overloaded"
            else:
                loop = self._background_loop()
                fut = asyncio.run_coroutine_threadsafe(self._execute_bound(plan), loop)
                fut.add_done_callback(self._leave)
                return fut
        done: concurrent.futures.Future[list[Assessment]] = concurrent.futures.Future()
        done.set_result(
            self._finish(plan, self._run_local(plan, only_local=not plan.remote, skip_reason=reason))
        )
        return done

    async def _execute_bound(self, plan: _Plan) -> list[Assessment]:
        self._bind()
        return await self._execute(plan)

    def judge_sync(self, record: EvalRecord) -> list[Assessment]:
        """Blocking `judge` for tests and scripts (runs on the runner's own loop thread)."""
        if not self.needs_event_loop:
            return self._judge_local(record)
        loop = self._background_loop()
        return asyncio.run_coroutine_threadsafe(self._judge_bound(record), loop).result()

    async def _judge_bound(self, record: EvalRecord) -> list[Assessment]:
        return await self.judge(record)

    def judge_many(
        self, records: Iterable[EvalRecord], *, window: int | None = None
    ) -> Iterator[list[Assessment]]:
        """Judge records in order with at most `window` (default max_in_flight) in flight; yields each
        record's assessments in input order. Never thins for capacity (it waits instead)."""
        limit = max(1, min(window or self.config.max_in_flight, self.config.max_in_flight))
        pending: deque[concurrent.futures.Future[list[Assessment]]] = deque()
        loop = self._background_loop() if self.needs_event_loop else None
        for record in records:
            if loop is None:
                yield self._judge_local(record)
                continue
            pending.append(asyncio.run_coroutine_threadsafe(self._judge_bound(record), loop))
            if len(pending) >= limit:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _judge_local(self, record: EvalRecord) -> list[Assessment]:
        plan = self._plan(record)
        return self._finish(plan, self._run_local(plan, only_local=True))

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("this JudgeRunner is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="tracejudge-judges", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    async def aclose(self, drain_seconds: float = 10.0) -> None:
        """Stop accepting judgements (new ones are skipped as "closed"), give those in flight up to
        `drain_seconds` to finish, then close the HTTP clients."""
        self._closed = True
        deadline = time.monotonic() + drain_seconds
        while self._in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for client in self.clients.values():
            await client.aclose()

    def close(self, drain_seconds: float = 10.0) -> None:
        """Blocking `aclose` for the runner's own loop (submit/judge_sync/judge_many users)."""
        self._closed = True
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(drain_seconds), loop).result(timeout=drain_seconds + 30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
        with self._lock:
            self._loop = self._thread = None

    def __enter__(self) -> JudgeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> JudgeRunner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
