"""Where `tracejudge dataset merge-labels` reads people's expectations from: JSON Lines files, an MLflow
tracking server (the expectations and HUMAN feedback on each collected trace, fetched by trace id),
and the labels topic (read from its beginning to the end it had when the command started: bounded).

Every source yields `Expectation`s (`schemas/formats/expectations.py`); a line or record that holds none
is counted in `Problems` by kind and the first `MAX_SHOWN` are kept to print, never fatal. A source
that cannot be read at all (a missing file, a file none of whose lines is a label, an MLflow server
that does not answer, a broker that cannot be reached) raises `InputError` (exit status 2).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from tracejudge.schemas.errors import InputError
from tracejudge.schemas.formats.expectations import (
    Expectation,
    LabelLineError,
    from_label_line,
    from_mlflow_assessments,
)
from tracejudge.schemas.formats.input_files import Oversized, open_input, read_lines

__all__ = ["MAX_SHOWN", "Problems", "from_files", "from_mlflow", "from_topic"]

MAX_SHOWN = 20
MAX_LINE_BYTES = 4 * 1024 * 1024
TRACES_PATH = "/api/3.0/mlflow/traces"


@dataclass
class Problems:
    """Label lines that were not used, by kind, and the first few to show."""

    counts: Counter[str] = field(default_factory=Counter)
    shown: list[str] = field(default_factory=list)

    def add(self, kind: str, where: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.shown) < MAX_SHOWN:
            self.shown.append(f"{where}: {detail}")


def _line(line: bytes | Oversized, where: str, problems: Problems) -> list[Expectation] | None:
    if isinstance(line, Oversized):
        problems.add("malformed", where, f"{line.size} bytes, more than a label line may have")
        return None
    try:
        return from_label_line(line, where)
    except LabelLineError as exc:
        problems.add(exc.kind, where, str(exc))
        return None


def from_files(stack: ExitStack, names: Iterable[str], problems: Problems) -> Iterator[Expectation]:
    """The expectations of JSON Lines label files (.gz too). A file with lines none of which is a
    label (not even a verdict label) is the wrong file: `InputError`."""
    for name in names:
        stream = open_input(stack, name)
        labels = lines = 0
        for lineno, line in read_lines(stream, name, MAX_LINE_BYTES):
            lines += 1
            before = problems.counts["malformed"]
            got = _line(line, f"{name}:{lineno}", problems)
            if got is not None:
                labels += 1
                yield from got
            elif problems.counts["malformed"] == before:
                labels += 1  # a verdict label: a labels file, just not an expectation
        if lines and not labels:
            raise InputError(f"{name}: no line is a label (expected JSON objects with \"trace_id\" and "
                             "expected_response, expected_facts or expected_retrieved_context)")


def _mlflow_ids(trace_id: str) -> list[str]:
    """The ids MLflow may store a collected trace under: as collected, and "tr-" + its hex id."""
    if trace_id.startswith("tr-"):
        return [trace_id]
    return [trace_id, f"tr-{trace_id}"] if all(c in "0123456789abcdef" for c in trace_id) else [trace_id]


def from_mlflow(url: str, trace_ids: Iterable[str], problems: Problems, *,
                timeout: float = 30.0) -> Iterator[Expectation]:
    """The expectations (and HUMAN feedback named like a row's field) on each trace, read from the
    tracking server at `url` (`MLFLOW_TRACKING_TOKEN`, when set, is sent as a bearer token). A trace the
    server does not have is counted (`not_in_mlflow`)."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers) as client:
        for trace_id in trace_ids:
            info = _trace_info(client, url, trace_id)
            if info is None:
                problems.add("not_in_mlflow", f"mlflow {trace_id}", "the server has no such trace")
                continue
            yield from from_mlflow_assessments(trace_id, info.get("assessments"), f"mlflow trace {trace_id}")


def _trace_info(client: httpx.Client, url: str, trace_id: str) -> dict[str, Any] | None:
    for candidate in _mlflow_ids(trace_id):
        try:
            r = client.get(f"{TRACES_PATH}/{quote(candidate, safe='')}")
        except httpx.HTTPError as exc:
            raise InputError(f"--labels-from-mlflow {url}: cannot reach the server: {exc}") from exc
        if r.status_code == 404:
            continue
        if r.status_code != 200:
            raise InputError(f"--labels-from-mlflow {url}: reading trace {candidate} answered HTTP "
                             f"{r.status_code}")
        try:
            info = (orjson.loads(r.content).get("trace") or {}).get("trace_info")
        except (orjson.JSONDecodeError, AttributeError):
            info = None
        if isinstance(info, dict):
            return info
    return None


def from_topic(client_config: dict[str, Any], topic: str, problems: Problems, *, max_records: int,
               timeout: float) -> Iterator[Expectation]:
    """The expectations on the labels topic, read from its beginning without a consumer group (nothing
    is committed) up to the end each partition has when first fetched, at most `max_records` records
    (more are counted as `over_max_records`) and `timeout` seconds (`InputError` when the end is not
    reached by then)."""
    from kafka import KafkaConsumer, TopicPartition

    try:
        consumer = KafkaConsumer(**client_config, group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest")
    except Exception as exc:  # kafka-python raises NoBrokersAvailable, KafkaConfigurationError, ...
        raise InputError(f"--labels-topic {topic}: cannot connect: {exc}") from exc
    try:
        deadline = time.monotonic() + timeout
        partitions = consumer.partitions_for_topic(topic)
        while not partitions and time.monotonic() < deadline:
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise InputError(f"--labels-topic {topic}: no such topic")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends: dict[Any, int] = {}
        read = 0
        while True:
            for tp, batch in consumer.poll(timeout_ms=200).items():
                for record in batch:
                    if tp in ends and record.offset >= ends[tp]:
                        continue
                    read += 1
                    if read > max_records:
                        problems.add("over_max_records", f"{topic}[{tp.partition}]@{record.offset}",
                                     f"past --max-label-records {max_records}")
                        continue
                    where = f"{topic}[{tp.partition}]@{record.offset}"
                    got = _line(record.value or b"", where, problems)
                    if got:
                        yield from got
            # The high watermark a fetch reports, fixed at first sight: labels added later are not awaited.
            for tp in tps:
                high = consumer.highwater(tp)
                if high is not None and tp not in ends:
                    ends[tp] = high
            if len(ends) == len(tps) and all(consumer.position(tp) >= ends[tp] for tp in tps):
                return
            if time.monotonic() > deadline:
                raise InputError(f"--labels-topic {topic}: its end was not reached within {timeout:g} s")
    finally:
        consumer.close()
