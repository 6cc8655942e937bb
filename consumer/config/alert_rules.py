"""A Prometheus rules file with the link annotations of every alert written in (`tracejudge alerts render`;
the links: `tracejudge.consumer.config.alert_links`) (`tracejudge.consumer.config`).

Generic over the file: every alerting rule of every group gets `runbook_url`, `dashboard_url` and, where
it has an app, `traces_url`, from its own shape (`alert_links.shape_of`), so an alert added tomorrow gets
its links with no list to update. Rendering replaces the link annotations a file already has (and an
older relative `runbook`), so a rendered file renders to itself with the same configuration and to
another deployment's links with another.

The text is edited in place, never re-dumped: comments, key order, quoting and the block scalars of the
expressions stay as they were written, and only the lines of the link annotations change. The result is
parsed again and compared with the input (everything but those annotations must be equal) before it is
returned, so a file this code cannot edit safely is an error, never a damaged file.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from tracejudge.consumer.config.alert_links import REPLACED_ANNOTATIONS, link_annotations, shape_of
from tracejudge.consumer.config.alerts import AlertsSettings
from tracejudge.schemas.errors import InputError

__all__ = ["render_rules", "rules_document"]


def rules_document(text: str, name: str = "the rules file") -> dict[str, Any]:
    """The parsed rules file, checked to have Prometheus's shape: `groups`, each with `rules`, each
    alerting rule with a name and an `expr`. `InputError` names what is wrong and where."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(f"{name} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        raise InputError(f"{name} is not a Prometheus rules file: it needs a top-level `groups:` list")
    for g, group in enumerate(doc["groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("rules"), list):
            raise InputError(f"{name}: groups[{g}] needs a `rules:` list")
        for r, rule in enumerate(group["rules"]):
            where = f"{name}: groups[{g}].rules[{r}]"
            if not isinstance(rule, dict) or not isinstance(rule.get("expr"), str | int | float):
                raise InputError(f"{where} needs an `expr`")
            if "alert" in rule and not isinstance(rule["alert"], str):
                raise InputError(f"{where}: `alert` must be a name")
            if "alert" in rule and not isinstance(rule.get("annotations", {}), dict | None):
                raise InputError(f"{where} ({rule['alert']}): `annotations` must be a mapping")
    return doc


def render_rules(text: str, alerts: AlertsSettings, *, app_tag: str | None = None,
                 name: str = "the rules file") -> str:
    """`text` (a rules file) with every alert's link annotations set from `alerts`; `app_tag` is
    `stream.app_tag` (`alert_links.link_annotations`). Raises `InputError` for a file that is not a
    rules file or that this code cannot edit without changing something else."""
    doc = rules_document(text, name)
    recording = {str(r["record"]): str(r["expr"]) for g in doc["groups"] for r in g["rules"] if "record" in r}
    links = []
    for rule in (r for g in doc["groups"] for r in g["rules"] if "alert" in r):
        try:
            shape = shape_of(rule, recording)
        except ValueError as exc:  # a `for:` or a range that is not a duration
            raise InputError(f"{name}: alert {rule['alert']}: {exc}") from None
        links.append(link_annotations(alerts, shape, app_tag=app_tag))
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    nodes = _alert_nodes(text)
    if len(nodes) != len(links):
        raise InputError(f"{name}: found {len(nodes)} alerting rules in its text and {len(links)} in its "
                         "groups; write each rule as a block mapping under groups[].rules")
    edits = [edit for node, annotations in zip(nodes, links, strict=True)
             for edit in _edits(node, annotations, name)]
    # Bottom up, so each edit's line numbers still hold; an insertion goes before a deletion ending there.
    for start, stop, new in sorted(edits, key=lambda e: (e[0], e[1] - e[0]), reverse=True):
        lines[start:stop] = new
    out = "".join(lines)
    _check(doc, out, links, name)
    return out


def _alert_nodes(text: str) -> list[yaml.MappingNode]:
    """The mapping node of every alerting rule, in file order (the order `links` was built in)."""
    root = yaml.compose(text)
    out = []
    for _, groups in _pairs(root):
        if _scalar(_) != "groups":
            continue
        for group in groups.value:
            for key, rules in _pairs(group):
                if _scalar(key) == "rules":
                    out += [rule for rule in rules.value
                            if any(_scalar(k) == "alert" for k, _ in _pairs(rule))]
    return out


def _edits(rule: yaml.MappingNode, annotations: Mapping[str, str], name: str
           ) -> list[tuple[int, int, list[str]]]:
    """(first line, line after the last, new lines) of each change to one rule: its link annotations
    deleted and the new ones added after its annotations block (which is added when it has none).
    Everything else, comments included, stays as it is."""
    alert = next(_scalar(v) for k, v in _pairs(rule) if _scalar(k) == "alert")
    found = [(k, v) for k, v in _pairs(rule) if _scalar(k) == "annotations"]
    indent = " " * rule.start_mark.column
    if not found:
        end = _last_line(rule) + 1
        return [(end, end, [f"{indent}annotations:\n", *_lines(annotations, indent + "  ")])]
    key, block = found[0]
    if isinstance(block, yaml.ScalarNode) and block.value in ("", "~", "null"):  # `annotations:` empty
        line = key.start_mark.line
        new = [f"{indent}annotations:\n", *_lines(annotations, indent + "  ")]
        return [(line, _last_line(block) + 1, new)]
    if not isinstance(block, yaml.MappingNode) or block.flow_style:
        raise InputError(f"{name}: alert {alert}: write `annotations:` as a block mapping (one key a line) "
                         "to have its links rendered")
    end = _last_line(block) + 1
    edits = [(k.start_mark.line, _last_line(v) + 1, []) for k, v in _pairs(block)
             if _scalar(k) in REPLACED_ANNOTATIONS]
    return [*edits, (end, end, _lines(annotations, " " * block.start_mark.column))]


def _lines(annotations: Mapping[str, str], indent: str) -> list[str]:
    return [f"{indent}{key}: {_quoted(value)}\n" for key, value in annotations.items()]


def _quoted(value: str) -> str:
    """A YAML single-quoted scalar: the templates' double quotes stay readable."""
    return "'" + value.replace("'", "''") + "'"


def _last_line(node: yaml.Node) -> int:
    """The 0-based last line of a node's own text: a collection's is its last child's (its end mark is
    the next token's), a scalar's is where it ends (column 0 of the next line for a block scalar),
    trailing blank lines left out."""
    while isinstance(node, yaml.MappingNode | yaml.SequenceNode) and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(last, tuple) else last
    end = node.end_mark
    line = end.line - 1 if end.column == 0 and end.line > node.start_mark.line else end.line
    source = (end.buffer or "").splitlines()
    while line > node.start_mark.line and line < len(source) and not source[line].strip():
        line -= 1
    return line


def _pairs(node: yaml.Node) -> list[tuple[yaml.Node, yaml.Node]]:
    return list(node.value) if isinstance(node, yaml.MappingNode) else []


def _scalar(node: yaml.Node) -> Any:
    return node.value if isinstance(node, yaml.ScalarNode) else None


def _check(doc: dict[str, Any], out: str, links: list[dict[str, str]], name: str) -> None:
    """The edited text must parse to the input with only the link annotations changed."""
    expected = copy.deepcopy(doc)
    alerts = [rule for g in expected["groups"] for rule in g["rules"] if "alert" in rule]
    for rule, new in zip(alerts, links, strict=True):
        kept = {k: v for k, v in (rule.get("annotations") or {}).items() if k not in REPLACED_ANNOTATIONS}
        rule["annotations"] = {**kept, **new}
    try:
        got = yaml.safe_load(out)
    except yaml.YAMLError:
        got = None
    if got != expected:
        raise InputError(f"{name}: its layout is one tracejudge cannot edit in place (the result would "
                         "differ in more than the link annotations); write each rule as a block mapping")
