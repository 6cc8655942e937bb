"""`tracejudge dataset synthesize`: a question/answer set from real documents.

    tracejudge dataset synthesize (--docs DIR | --chunks FILE | --results FILE)... --config FILE --out FILE
        [-n N] [--check context_sufficiency|groundedness] [--seed TEXT] [--max-chunks N] ...

Reads chunks (`tracejudge.metrics.synthesis.chunks`: a folder of text/Markdown, JSON Lines chunks, the
retrieved context of result files; deduplicated by doc_uri and content), picks at most --max-chunks by
the seed, and for each chunk in order asks the configured judge endpoint for N questions, a reference
answer from the chunk alone and the answerability check (`tracejudge.metrics.synthesis.runner`: the
judges' budgets, spend caps, breaker and redaction at egress). Rows are agent-evaluation rows
(`request`, `expected_response`, `expected_retrieved_context` = the source chunk) that `tracejudge eval`
reads as they are. Progress is kept in `OUT.progress` (`synthesis_progress`), so a rerun after an
interruption continues where it stopped without asking the endpoint again for finished chunks.

Exit status: 0 complete; 2 usage, configuration, unreadable input or no usable chunk (nothing sent);
3 output error; 4 stopped before the end (a spend cap or budget with no room, the endpoint failing, or
chunks whose calls failed): the output holds the rows so far and a rerun continues; 130 interrupted
(the progress file is kept, the output not written: rerun to finish).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from tracejudge.consumer.commands.outputs import AtomicOutput, OutputError, refuse_overwriting_inputs
from tracejudge.consumer.commands.synthesis_progress import Progress, settings_fingerprint
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.runtime import exit_status
from tracejudge.metrics.synthesis.chunks import (
    Chunk,
    ChunkSet,
    Skips,
    read_chunk_rows,
    read_folder,
    read_result_contexts,
    select,
)
from tracejudge.metrics.synthesis.filters import NearDuplicates
from tracejudge.metrics.synthesis.runner import (
    CHECKS,
    ChunkFailed,
    Stopped,
    SynthesisRunner,
    SynthesisSettings,
    Tally,
)
from tracejudge.schemas.errors import InputError

__all__ = ["add_arguments", "main"]

log = logging.getLogger(__name__)
NAME = "tracejudge dataset synthesize"
PROGRESS_EVERY_SECONDS = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("documents (at least one; each may be repeated)")
    src.add_argument("--docs", action="append", default=[], metavar="DIR",
                     help="a folder of text or Markdown files, cut at headings and paragraphs")
    src.add_argument("--chunks", action="append", default=[], metavar="FILE",
                     help='a JSON Lines file of {"doc_uri", "content"} chunks (.gz too)')
    src.add_argument("--results", action="append", default=[], metavar="FILE",
                     help="result files (tracejudge eval/run output): the retrieved context they hold")
    p.add_argument("--config", type=Path, required=True, metavar="FILE",
                   help="the YAML file whose judges: section defines the endpoint (budgets, spend caps, "
                        "redaction)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the dataset (JSON Lines); OUT.progress beside it makes the run resumable")
    p.add_argument("--endpoint", metavar="NAME", help="the judges.endpoints entry to use (default: the "
                                                      "section's default endpoint)")
    p.add_argument("-n", "--questions-per-chunk", type=int, default=3, metavar="N",
                   help="questions asked per chunk (default 3)")
    p.add_argument("--check", choices=CHECKS, default="context_sufficiency",
                   help="the judge that keeps only the questions the chunk answers (default "
                        "context_sufficiency)")
    p.add_argument("--seed", default="", metavar="TEXT", help="picks the --max-chunks chunks (default '')")
    p.add_argument("--max-chunks", type=int, metavar="N", help="at most N chunks, picked by the seed")
    p.add_argument("--chunk-chars", type=int, default=2000, metavar="N",
                   help="the largest chunk cut from a document, in characters (default 2000)")
    p.add_argument("--max-file-bytes", type=int, default=5_000_000, metavar="N",
                   help="larger files in --docs are skipped and counted (default 5000000)")
    p.add_argument("--near-duplicate-threshold", type=float, default=0.8, metavar="J",
                   help="drop a question whose word-set Jaccard similarity with an earlier one is at least "
                        "J (default 0.8)")
    p.add_argument("--quote-words", type=int, default=8, metavar="N",
                   help="drop a question sharing a run of N words with its answer (default 8)")
    p.add_argument("--budget-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for the endpoint's request/token budget to refill before "
                        "stopping (default 120)")
    p.add_argument("--restart", action="store_true", help="discard OUT.progress and start again")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or summary on stderr")


def _check_args(args: argparse.Namespace) -> None:
    if not (args.docs or args.chunks or args.results):
        raise InputError("no documents: give --docs DIR, --chunks FILE or --results FILE")
    if args.out == "-":
        raise InputError("--out must be a file (its progress file sits beside it)")
    if args.questions_per_chunk < 1 or args.questions_per_chunk > 20:
        raise InputError("--questions-per-chunk must be between 1 and 20")
    if args.max_chunks is not None and args.max_chunks < 1:
        raise InputError("--max-chunks must be >= 1")
    if args.chunk_chars < 200:
        raise InputError("--chunk-chars must be >= 200")
    if args.max_file_bytes < 1:
        raise InputError("--max-file-bytes must be >= 1")
    if not 0 < args.near_duplicate_threshold <= 1:
        raise InputError("--near-duplicate-threshold must be in (0, 1]")
    if args.quote_words < 2:
        raise InputError("--quote-words must be >= 2")
    if args.budget_wait < 0:
        raise InputError("--budget-wait must be >= 0")
    out = Path(args.out).resolve()
    for folder in args.docs:
        if out.is_relative_to(Path(folder).resolve()):
            raise InputError(f"--out {args.out} is inside --docs {folder}: the next run would read it (and "
                             "its progress file) as documents; write it elsewhere")


def _read_chunks(args: argparse.Namespace, skips: Skips) -> list[Chunk]:
    chunks = ChunkSet(skips)
    for folder in args.docs:
        chunks.extend(read_folder(folder, args.chunk_chars, args.max_file_bytes, skips))
    for name in args.chunks:
        chunks.extend(read_chunk_rows(name, skips))
    for name in args.results:
        chunks.extend(read_result_contexts(name, skips))
    return chunks.chunks


def _settings(args: argparse.Namespace) -> SynthesisSettings:
    return SynthesisSettings(questions_per_chunk=args.questions_per_chunk, check=args.check,
                             near_duplicate_threshold=args.near_duplicate_threshold,
                             quote_words=args.quote_words, budget_wait_seconds=args.budget_wait,
                             endpoint=args.endpoint)


def main(args: argparse.Namespace) -> int:
    """See the module docstring for the exit statuses."""
    err = None if args.quiet else sys.stderr
    skips = Skips()
    with ExitStack() as stack:
        try:
            _check_args(args)
            progress_path = args.out + ".progress"
            inputs = [*args.chunks, *args.results, str(args.config)]
            refuse_overwriting_inputs({"--out": args.out, "the progress file": progress_path}, inputs)
            settings = load_settings(args.config, offline=True)
            if settings.judges is None:
                raise InputError(f"--config {args.config}: no judges: section (the endpoint to ask)")
            chunks = _read_chunks(args, skips)
            print(f"{NAME}: read {len(chunks)} chunks; skipped: {skips.line()}", file=sys.stderr)
            if not chunks:
                raise InputError("nothing usable: no chunk in the documents given (see the skipped counts)")
            chunks = select(chunks, args.max_chunks, args.seed)
            runner = SynthesisRunner(settings.judges, _settings(args))
            stack.callback(runner.close, 1.0)
            fp = settings_fingerprint({"seed": args.seed, "n": args.questions_per_chunk, "check": args.check,
                                       "near": args.near_duplicate_threshold, "quote": args.quote_words,
                                       "chunk_chars": args.chunk_chars, "versions": runner.versions()})
            progress = Progress.open(progress_path, fp, restart=args.restart)
            stack.callback(progress.close)
        except ConfigError as exc:
            print(f"{NAME}: invalid configuration\n{exc.report()}", file=sys.stderr)
            return exit_status.USAGE
        except InputError as exc:
            print(f"{NAME}: {exc}", file=sys.stderr)
            return exit_status.USAGE
        except OutputError as exc:
            print(f"{NAME}: {exc}", file=sys.stderr)
            return exit_status.OUTPUT_ERROR
        run = Run(runner, progress, chunks, args.near_duplicate_threshold, err)
        try:
            run.all()
            rows = run.rows()
            out = stack.enter_context(AtomicOutput(args.out))
            for row in rows:
                out.write(orjson.dumps(row) + b"\n")
            out.commit()
            if run.complete:
                progress.remove()
        except OutputError as exc:
            print(f"{NAME}: {exc}", file=sys.stderr)
            return exit_status.OUTPUT_ERROR
        run.summary(args, len(rows), skips)
    return exit_status.OK if run.complete else exit_status.SERVICE_FAILED


class Run:
    """The chunks in order: resumed from the progress file, or synthesized and added to it."""

    def __init__(self, runner: SynthesisRunner, progress: Progress, chunks: list[Chunk], threshold: float,
                 err: Any) -> None:
        self.runner, self.progress, self.chunks, self.err = runner, progress, chunks, err
        self.accepted = NearDuplicates(threshold)
        self.dropped: Counter[str] = Counter()
        self.earlier = Tally()
        self.resumed = self.made = self.failed = 0
        self.stopped: str | None = None
        self._last_line = time.monotonic()

    @property
    def complete(self) -> bool:
        return self.stopped is None and self.failed == 0

    def all(self) -> None:
        for i, chunk in enumerate(self.chunks, 1):
            entry = self.progress.done.get(chunk.key)
            if entry is not None:
                self.resumed += 1
                self.earlier.merge(entry.get("used") or {})
            else:
                try:
                    outcome = self.runner.synthesize(chunk, self.accepted)
                except ChunkFailed as exc:
                    self.failed += 1
                    log.warning("chunk %s failed (done again on the next run): %s", chunk.doc_uri, exc)
                    continue
                except Stopped as exc:
                    self.stopped = str(exc)
                    break
                self.progress.add(chunk.key, outcome.rows, dict(outcome.dropped), outcome.tally.as_dict())
                entry = self.progress.done[chunk.key]
                self.made += 1
            for row in entry["rows"]:
                self.accepted.add(row["request"])
            self.dropped.update(entry.get("dropped") or {})
            self._progress_line(i)

    def rows(self) -> list[dict[str, Any]]:
        done = self.progress.done
        return [row for c in self.chunks if c.key in done for row in done[c.key]["rows"]]

    def _progress_line(self, i: int, force: bool = False) -> None:
        now = time.monotonic()
        due = force or i == len(self.chunks) or now - self._last_line >= PROGRESS_EVERY_SECONDS
        if self.err is None or not due:
            return
        self._last_line = now
        print(f"{NAME}: {i}/{len(self.chunks)} chunks, {len(self.accepted)} rows, "
              f"{_usd(self.runner.spent.cost_usd)} this run", file=self.err, flush=True)

    def summary(self, args: argparse.Namespace, rows: int, skips: Skips) -> None:
        if self.stopped is not None:
            print(f"{NAME}: stopped before the end: {self.stopped}; {args.out} holds the rows so far, run "
                  "again to continue", file=sys.stderr)
        if self.failed:
            print(f"{NAME}: {self.failed} chunks failed at the endpoint; run again to retry them",
                  file=sys.stderr)
        if self.err is None:
            return
        err, spent = self.err, self.runner.spent
        print(f"{NAME} summary", file=err)
        print(f"  chunks           {len(self.chunks)} ({self.made} done now, {self.resumed} by an earlier "
              f"run, {self.failed} failed)", file=err)
        print(f"  skipped inputs   {skips.line()}", file=err)
        dropped = ", ".join(f"{n} {k}" for k, n in sorted(self.dropped.items())) or "none"
        print(f"  dropped          {dropped}", file=err)
        print(f"  rows             {rows} written to {args.out}", file=err)
        print(f"  budget waits     {self.runner.budget_waits} (steps judged again once the endpoint's "
              "request/token budget had refilled)", file=err)
        model = self.runner.steps["synthesis_questions"].judge.identity.model
        print(f"  cost (this run)  {spent.calls} calls, {spent.input_tokens} input + {spent.output_tokens} "
              f"output tokens, {_usd(spent.cost_usd, model, self.runner.endpoint)}", file=err)
        if self.resumed:
            total = Tally()
            total.merge(spent.as_dict())
            total.merge(self.earlier.as_dict())
            print(f"  with earlier     {total.calls} calls, {_usd(total.cost_usd)} in all", file=err)


def _usd(cost: float | None, model: str | None = None, endpoint: str | None = None) -> str:
    if cost is not None:
        return f"{cost:.6f} USD"
    if model is None:
        return "USD unknown"
    return (f"USD unknown (model {model!r} is not in the price table: set judges.endpoints.{endpoint}.price)")
