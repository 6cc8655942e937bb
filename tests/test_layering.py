"""The house's shape, checked on every run so it cannot erode.

Layers, from the bottom (README, "Reading the code"): the nouns (`schemas/`), the input formats
(`schemas/formats/`), what is measured — computed metrics, cost and the judges (`metrics/`), the
Prometheus families (`metrics/telemetry/`), the configuration, the pipeline and the Kafka runtime
(`consumer/config.py`, `consumer/pipeline.py`, `consumer/runtime/`), the stages and the write-back sinks
(`consumer/stages/`, `consumer/sinks/`), the Python API (`tracejudge`), and the commands and the demo
(`consumer/commands/`, `consumer/demo/`). A module imports only from its own layer or the layers below
it — every import counts, at module level, inside a function or under `TYPE_CHECKING` — no two modules
import each other round a circle, no stage imports another stage, and no module imports another's
private (`_underscore`) names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tracejudge": ROOT / "api", "tracejudge.schemas": ROOT / "schemas",
            "tracejudge.metrics": ROOT / "metrics", "tracejudge.consumer": ROOT / "consumer"}

# Bottom to top. A module's layer is the one with the longest prefix of its dotted name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("nouns", ("tracejudge.schemas",)),
    ("formats", ("tracejudge.schemas.formats",)),
    ("scoring and judges", ("tracejudge.metrics",)),
    ("telemetry", ("tracejudge.metrics.telemetry",)),
    ("runtime", ("tracejudge.consumer", "tracejudge.consumer.config", "tracejudge.consumer.pipeline",
                 "tracejudge.consumer.runtime")),
    ("stages", ("tracejudge.consumer.stages", "tracejudge.consumer.sinks", "tracejudge.consumer.writeback")),
    ("api", ("tracejudge",)),
    ("commands", ("tracejudge.consumer.commands", "tracejudge.consumer.demo")),
]
# The stages proper: each is a consumer group of its own and never imports another. The other modules of
# `consumer/stages/` are parts the stages share (decoding, assembly).
STAGES = {f"tracejudge.consumer.stages.{name}" for name in ("run", "sessions", "sink", "agreement",
                                                            "backfill", "findings")}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    names: tuple[str, ...]
    line: int


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts]) if parts else package
            if package == "tracejudge" or name not in found:
                found.setdefault(name, path)
    return found


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imports(known: dict[str, Path]) -> Iterator[Import]:
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tracejudge"):
                        yield Import(source, _owning(alias.name, known), (), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, source, is_package)
                if not base.startswith("tracejudge"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in known:  # `from package import module`
                        yield Import(source, sub, (), node.lineno)
                    else:
                        yield Import(source, _owning(base, known), (alias.name,), node.lineno)


def _absolute(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = source.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _owning(name: str, known: dict[str, Path]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


KNOWN = modules()
EDGES = [i for i in imports(KNOWN) if i.target != i.source]


def test_every_module_has_a_layer() -> None:
    assert [m for m in KNOWN if layer_of(m) < 0] == []


def test_imports_point_down_only() -> None:
    upward = [f"{i.source} (layer {LAYERS[layer_of(i.source)][0]}) imports {i.target} "
              f"(layer {LAYERS[layer_of(i.target)][0]}), line {i.line}"
              for i in EDGES if layer_of(i.target) > layer_of(i.source)]
    assert upward == []


def test_no_stage_imports_another_stage() -> None:
    sideways = [f"{i.source} imports {i.target}, line {i.line}" for i in EDGES
                if i.target in STAGES and (i.source in STAGES or
                i.source.startswith("tracejudge.consumer.stages."))]
    assert sideways == []


def test_no_private_names_across_modules() -> None:
    private = [f"{i.source} imports {i.target}.{n}, line {i.line}" for i in EDGES for n in i.names
               if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in KNOWN}
    for i in EDGES:
        if i.target in graph:
            graph[i.source].add(i.target)
    assert [sorted(c) for c in _cycles(graph)] == []


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_checks_can_fail() -> None:
    """The checker itself finds an upward import, a circle and a private name when there is one."""
    assert layer_of("tracejudge.schemas.record") < layer_of("tracejudge.consumer.stages.run")
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []
