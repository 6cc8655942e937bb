"""`JudgeRunner`: runs the configured judges, orchestrating the parts around them: the planner
(`planning`: sampling, filters, shadows), what judgements may spend (`spending`, over `budget`), the
endpoint clients and their breakers (`client`, `breaker`), the judges themselves (`registry`) and the
metrics (`series`). Session judges run on the same machinery (`sessions.SessionJudgeRunner`).

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

Every skip is counted in tracejudge_judge_skipped_total{reason} and, unless `emit_skipped: false` (on
the stream; offline every skip is kept), returned as an `Assessment` with `skipped` set, so a result
says why a judge is absent and `EvaluationResult.passed` never mistakes a skip for a pass. Nothing
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

Defaults that thin or skip judgements (the stream's 10% sample of model judges, `max_in_flight`, each
endpoint's circuit breaker) are logged once per process at start-up when the configuration leaves them
at their default (`thinning_defaults`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.metrics.app_labels import default_app_label
from tracejudge.metrics.judges.base import (
    Judge,
    JudgeAnswerError,
    JudgeContext,
    NotApplicable,
    TooLarge,
)
from tracejudge.metrics.judges.breaker import CallLedger, JudgeCallError, reset_call_ledger, use_call_ledger
from tracejudge.metrics.judges.client import JudgeClient
from tracejudge.metrics.judges.config import (
    AnswerRelevancySettings,
    CustomJudgeConfig,
    JudgesConfig,
    load_judges_config,
)
from tracejudge.metrics.judges.custom import CustomJudge
from tracejudge.metrics.judges.endpoints import resolve_api_key, resolve_headers
from tracejudge.metrics.judges.heuristic import HeuristicJudge
from tracejudge.metrics.judges.planning import Configured, Plan, Planner, Scope, placement, record_scope
from tracejudge.metrics.judges.redaction import Redactor, reset_redaction, use_redaction
from tracejudge.metrics.judges.registry import BUILTIN_FACTORIES, HEURISTIC_FACTORIES
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.metrics.judges.spending import Spending
from tracejudge.metrics.judges.trust.shadows import compare_shadows, configure_shadows
from tracejudge.metrics.version_labels import VersionLabelLimiter
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, JudgeIdentity

__all__ = ["JudgeRunner"]

log = logging.getLogger(__name__)

# The start-up lines already logged in this process (one per distinct configuration, not one per
# `evaluate()` call of a test suite).
_LOGGED: set[str] = set()
_LOGGED_LOCK = threading.Lock()


def _log_once(message: str) -> None:
    with _LOGGED_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    log.info("%s", message)


class JudgeRunner:
    """Runs the configured judges on records. See the module docstring for the order of decisions."""

    # How the planner sees a subject (`tracejudge.metrics.judges.planning`): a record here, a
    # conversation for the session judges.
    scope_of: Callable[[Any], Scope] = staticmethod(record_scope)

    def __init__(
        self,
        config: JudgesConfig | Mapping[str, Any] | None = None,
        *,
        registry: CollectorRegistry | None = None,
        metrics: JudgeMetrics | None = None,
        app_label: Callable[[str | None], str] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        version_label: VersionLabelLimiter | None = None,
    ):
        self.config = load_judges_config(config)
        if metrics is None:
            metrics = self._new_metrics(registry if registry is not None else CollectorRegistry(), app_label)
        self.metrics = metrics
        if version_label is not None:
            # The stream's bound on the verdicts' `version` label; a retired version's series go.
            metrics.version_label = version_label
            version_label.on_retire(metrics.retire_version)
        self._clock = clock
        self.clients: dict[str, JudgeClient] = {}
        # Budgets, spend caps and prices per endpoint (tracejudge.metrics.judges.spending).
        self.spending = Spending(getattr(metrics, "registry", None) or CollectorRegistry(), clock,
                                 fleet=self.config.fleet_spend)
        self.budgets = self.spending.budgets
        self.spend_caps = self.spending.spend_caps
        # Redaction before egress: every judge client passes its text through it (None: disabled).
        self.redactor = Redactor.for_runner(self.config.redaction, getattr(metrics, "registry", None))
        self._judges = self._configure_all(env)
        self.planner = Planner(self._judges, self.metrics, self.config.sampling_seed)
        self._shadowed = any(c.shadow_of is not None for c in self._judges)
        self._canaries: dict[str, Configured] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        defaults = self.thinning_defaults()
        if defaults:
            _log_once("judges: defaults that thin or skip judgements: " + "; ".join(defaults))

    # ----------------------------------------------------------------------------------- set-up
    # Hooks a runner over other subjects (the session judges) overrides: its metrics, its judges,
    # how the planner sees a subject (`scope_of`) and what a verdict observes (`_observe_verdict`).
    def _new_metrics(self, registry: CollectorRegistry, app_label: Callable[[str | None], str] | None) -> Any:
        return JudgeMetrics(registry, app_label or default_app_label)

    def _configure_all(self, env: Mapping[str, str] | None) -> list[Configured]:
        live = [self._configure(n, s, env) for n, s in self.config.judge_settings().items()]

        def make(name: str, settings: Any, kind: str, model: str | None) -> Configured:
            return self._configure(name, settings, env, kind=kind, model=model)

        return live + configure_shadows(live, self.config.shadow_judges(), make)

    def _client(self, name: str, env: Mapping[str, str] | None, model: str | None = None) -> JudgeClient:
        # `model`: a shadow judge's candidate model on this endpoint (its own client, the same budget).
        key = name if model is None else f"{name}\x00{model}"
        if key not in self.clients:
            cfg = self.config.endpoints[name]
            if model is not None:
                cfg = cfg.model_copy(update={"model": model})
            self.clients[key] = JudgeClient(
                name,
                cfg,
                api_key=resolve_api_key(name, cfg, env),
                extra_headers=resolve_headers(name, cfg, env),
                on_request=self.metrics.observe_request,
                on_breaker_change=self.metrics.set_circuit_open,
                on_retry=self.metrics.observe_retry,
                on_refused=self.metrics.observe_circuit_refusal,
                clock=self._clock,
                redactor=self.redactor,
            )
            self.spending.add_client(name, cfg, self.clients[key], model)
            self.metrics.set_circuit_open(name, False)
        return self.clients[key]

    def _configure(
        self,
        name: str,
        settings: Any,
        env: Mapping[str, str] | None,
        *,
        kind: str | None = None,
        model: str | None = None,
    ) -> Configured:
        """One judge. `kind`/`model`: a shadow judge that is the built-in `kind` under its own `name`,
        with `model` instead of its endpoint's."""
        cfg = self.config
        rate, flt = placement(cfg, name, settings)
        if cfg.provider_of(name, settings) == "heuristic":
            heuristic = HEURISTIC_FACTORIES[kind or name](settings=settings)
            heuristic.name = name
            heuristic.identity  # noqa: B018 - computed once, here
            return Configured(heuristic, rate, flt)
        endpoint_name = cfg.endpoint_of(settings)
        client = self._client(endpoint_name, env, model)
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
            judge = BUILTIN_FACTORIES[kind or name](
                settings=settings, endpoint=client.config, endpoint_name=endpoint_name
            )
            judge.name = name
        judge.identity  # noqa: B018 - computed once, here, rather than on the first verdict
        return Configured(judge, rate, flt, client, embeddings, self.budgets[endpoint_name])

    def thinning_defaults(self) -> list[str]:
        """The defaults in effect that thin or skip judgements, one phrase each: the sample rate of
        model judges whose configuration sets none (on the stream), `max_in_flight` (on the stream;
        offline waits instead), and each endpoint's circuit breaker. Values the configuration sets are
        not listed: they were chosen."""
        cfg = self.config
        out: list[str] = []
        # Trace and session judges by name (the names never overlap): this runner has one kind.
        settings = {**cfg.judge_settings(), **cfg.session_judge_settings()}
        sampled = [c.name for c in self._judges
                   if c.shadow_of is None and c.rate < 1.0 and c.name in settings
                   and cfg.sample_rate_is_default(settings[c.name])]
        if sampled:
            out.append(f"sample_rate {cfg.sample_rate_of(sampled[0], settings[sampled[0]]):g} for "
                       f"{', '.join(sampled)} (the stream's default for model judges: the rest of the "
                       "eligible records are skipped as not_sampled; set judges.sample_rate or a judge's "
                       "sample_rate, 1.0 to judge every record)")
        remote = [c for c in self._judges if not c.local]
        if remote and not cfg.offline and "max_in_flight" not in cfg.model_fields_set:
            out.append(f"max_in_flight {cfg.max_in_flight} (records beyond it in judgement at once are "
                       "skipped as overloaded)")
        for name in sorted({c.client.name for c in remote if c.client is not None}):
            ep = cfg.endpoints[name]
            if not {"breaker_failure_threshold", "breaker_reset_seconds"} & ep.model_fields_set:
                out.append(f"endpoints.{name}: after {ep.breaker_failure_threshold} consecutive failed calls "
                           f"the endpoint is not called for {ep.breaker_reset_seconds:g} s (skipped as "
                           "circuit_open; breaker_failure_threshold, breaker_reset_seconds)")
        return out

    def judge_names(self) -> list[str]:
        """The configured live judges, in the order their assessments appear in results."""
        return [c.name for c in self._judges if c.shadow_of is None]

    def shadow_names(self) -> dict[str, str]:
        """The shadow (candidate) judges -> the live judge each shadows; after the live ones in results."""
        return {c.name: c.shadow_of for c in self._judges if c.shadow_of is not None}

    def identities(self) -> dict[str, JudgeIdentity]:
        """Each configured judge's identity (its `version` fingerprint keys its calibration)."""
        return {c.name: c.judge.identity for c in self._judges}

    @property
    def needs_event_loop(self) -> bool:
        """False when every judge is local (heuristic): `submit` then always completes inline."""
        return any(not c.local for c in self._judges)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ----------------------------------------------------------------------------------- decisions
    def _plan(self, subject: Any) -> Plan:
        return self.planner.plan(self.scope_of(subject))

    def _finish(self, plan: Plan, results: Mapping[int, Assessment]) -> list[Assessment]:
        out = []
        for i, slot in enumerate(plan.slots):
            a = slot if isinstance(slot, Assessment) else results[i]
            # Offline every skip is kept: a test's `passed` must see the judge that did not judge.
            if a.skipped is None or self.config.emit_skipped or self.config.offline:
                out.append(a)
        if self._shadowed:
            compare_shadows(self.metrics, out)
        return out

    def _run_local(
        self, plan: Plan, only_local: bool, skip_reason: str | None = None
    ) -> dict[int, Assessment]:
        """Run the heuristic judges inline; with `skip_reason`, skip the remote ones for that reason."""
        done: dict[int, Assessment] = {}
        for i, slot in enumerate(plan.slots):
            if isinstance(slot, Configured):
                if slot.local:
                    done[i] = self._run_heuristic(slot, plan)
                elif skip_reason is not None:
                    done[i] = self.planner.skip(plan.app, slot, skip_reason)
                elif only_local:
                    raise AssertionError("remote judge in a local-only plan")
        return done

    def _run_heuristic(self, cj: Configured, plan: Plan) -> Assessment:
        assert isinstance(cj.judge, HeuristicJudge)
        t0 = time.perf_counter()
        try:
            a = cj.judge.judge_now(plan.subject)
        except NotApplicable as exc:
            return self.planner.skip(plan.app, cj, "not_applicable", str(exc))
        except Exception as exc:  # a bug in a heuristic must not lose the record
            log.warning("heuristic judge %s failed: %s", cj.name, type(exc).__name__)
            a = self._error(cj, "internal", type(exc).__name__)
        return self._observe(plan, cj, a, time.perf_counter() - t0)

    def _error(self, cj: Configured, reason: str, detail: str) -> Assessment:
        if not cj.canary:
            self.metrics.observe_error(cj.name, reason)
        return Assessment(
            name=cj.name,
            error=f"{reason}: {detail}",
            source=cj.judge.source,
            judge=cj.judge.identity,
            shadow_of=cj.shadow_of,
        )

    def _observe(self, plan: Plan, cj: Configured, a: Assessment, seconds: float) -> Assessment:
        a.duration_seconds = round(seconds, 6)
        a.sample_rate = cj.rate
        if cj.canary:  # observed by the canary series only (tracejudge.metrics.judges.trust.canaries)
            return a
        self.metrics.observe_duration(cj.name, seconds)
        a.shadow_of = cj.shadow_of
        if a.error is None and a.skipped is None and cj.shadow_of is None:
            self._observe_verdict(plan, cj, a)
        return a

    def _observe_verdict(self, plan: Plan, cj: Configured, a: Assessment) -> None:
        self.metrics.observe_verdict(
            plan.app, cj.name, passed=a.passed, score=a.score, trace_id=plan.subject.trace_id,
            version=self.metrics.version_label(plan.app, plan.subject.version),
        )

    async def _run_remote(self, cj: Configured, plan: Plan) -> Assessment:
        assert cj.client is not None
        if not cj.client.breaker.allows() or (
            cj.embeddings is not None and not cj.embeddings.breaker.allows()
        ):
            return self.planner.skip(plan.app, cj, "circuit_open")
        try:
            job = cj.judge.prepare(plan.subject)
        except TooLarge as exc:
            return self.planner.skip(plan.app, cj, "too_large", str(exc))
        except NotApplicable as exc:
            return self.planner.skip(plan.app, cj, "not_applicable", str(exc))
        reserved = await self.spending.reserve(cj, job.cost)
        if reserved is None:
            return self.planner.skip(plan.app, cj, "budget")
        ctx = JudgeContext(cj.client, cj.embeddings)
        # One redaction session per judgement: the same value gets the same placeholder in all its calls.
        redaction = self.redactor.session(plan.redaction_memo) if self.redactor is not None else None
        redaction_token = use_redaction(redaction)
        # What all the judgement's calls did (tracejudge.metrics.judges.breaker.CallLedger).
        calls = CallLedger()
        calls_token = use_call_ledger(calls)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.judgement_timeout_seconds):
                a = await job.run(ctx)
        except JudgeCallError as exc:
            if exc.reason == "circuit_open" and calls.sent == 0:
                # Another judgement opened the breaker between our check and our first request.
                waited = round(time.perf_counter() - t0, 6)
                return self.planner.skip(plan.app, cj, "circuit_open", duration=waited)
            # A judgement that sent requests reports the error they got, not the refusal of a retry.
            a = self._error(cj, *calls.explain(exc))
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
            reset_call_ledger(calls_token)
            reset_redaction(redaction_token)
            self.spending.settle(reserved, ctx)
            self.metrics.observe_tokens(cj.name, ctx.input_tokens, ctx.output_tokens)
        a.input_tokens, a.output_tokens = ctx.reported_usage()
        self.spending.charge(reserved, cj.name, a)
        if redaction is not None and redaction.replaced:
            a.redacted = True
        return self._observe(plan, cj, a, time.perf_counter() - t0)

    async def _execute(self, plan: Plan) -> list[Assessment]:
        done = self._run_local(plan, only_local=False)
        remote = [(i, s) for i, s in enumerate(plan.slots) if isinstance(s, Configured) and not s.local]
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

    def submit_canary(self, record: EvalRecord, name: str) -> concurrent.futures.Future[Assessment]:
        """Judge a canary record with the live judge `name` (its client, budget, breaker and timeout),
        without sampling or filters, observed only in the canary series
        (tracejudge.metrics.judges.trust.canaries).
        Thread-safe; the future is already done for a local judge and when the runner is overloaded or
        closed (an assessment skipped for that reason, counted as a canary skip)."""
        cj = self._canaries.get(name)
        if cj is None:
            live = next(c for c in self._judges if c.name == name and c.shadow_of is None)
            cj = self._canaries[name] = replace(live, canary=True)
        plan = Plan(record, "canary", [cj])
        done: concurrent.futures.Future[Assessment] = concurrent.futures.Future()
        if cj.local:
            done.set_result(self._run_heuristic(cj, plan))
            return done
        if self._closed or not self._enter():
            done.set_result(self.planner.skip(plan.app, cj, "closed" if self._closed else "overloaded"))
            return done
        try:
            loop = self._background_loop()
        except RuntimeError:  # closed meanwhile
            self._leave()
            done.set_result(self.planner.skip(plan.app, cj, "closed"))
            return done
        fut = asyncio.run_coroutine_threadsafe(self._run_canary(cj, plan), loop)
        fut.add_done_callback(self._leave)
        return fut

    async def _run_canary(self, cj: Configured, plan: Plan) -> Assessment:
        self._bind()
        return await self._run_remote(cj, plan)

    async def _execute_bound(self, plan: Plan) -> list[Assessment]:
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
        self.spending.close()  # its fleet-spend ledger leaves the process's registry

    def close(self, drain_seconds: float = 10.0) -> None:
        """Blocking `aclose` for the runner's own loop (submit/judge_sync/judge_many users)."""
        self._closed = True
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            self.spending.close()
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
