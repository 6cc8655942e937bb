"""Every configuration key the README and the documentation's pages name exists: a key renamed or removed
in the settings models leaves no page telling readers to set it. The keys are the generated reference's
(docs/hooks/reference_config.py walks the models), so nothing here is listed by hand but the few dotted
names in the pages that are not keys (file names, OpenTelemetry attributes, loggers)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
# `a.b` in backquotes whose first part is a section of the file: a key named in prose.
NAMED = re.compile(r"`([a-z_]+(?:\[\])?(?:\.[A-Za-z0-9_<>\[\]-]+)+)`")
NOT_KEYS = {
    "http.response.status_code", "http.status_code",  # OpenTelemetry span attributes
    "kafka.cluster", "kafka.consumer.fetcher",  # kafka-python's loggers
    "sink.<kind>", "sink.KIND",  # a sink's own section, whatever its kind
}
NOT_KEY_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".py")


def _reference_keys() -> set[str]:
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))
    reference = importlib.import_module("reference_config")
    keys: set[str] = set()
    for section in reference.sections():
        keys.add(section.path)
        keys.update(key.path for key in section.keys)
    return keys


def _patterns(keys: set[str]) -> list[re.Pattern[str]]:
    """A key path as a pattern: `<name>` is any name, `[]` may be written or left out; what follows a
    mapping of the user's names (`judges.redaction.patterns.<yours>`) is allowed under it."""
    out = []
    for key in keys:
        rx = re.escape(key).replace(re.escape("<name>"), r"[^.\[\]]+").replace(re.escape("[]"), r"(?:\[\])?")
        out.append(re.compile(rx + r"$"))
    return out


def _named_keys() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").rglob("*.md"))]:
        for match in NAMED.finditer(doc.read_text(encoding="utf-8")):
            found.setdefault(match.group(1), []).append(doc.relative_to(ROOT).as_posix())
    return found


def test_every_key_the_documentation_names_is_a_key_of_the_settings() -> None:
    keys = _reference_keys()
    sections = {k.split(".")[0].split("[")[0] for k in keys}
    patterns = _patterns(keys)
    mappings = tuple(f"{k}." for k in keys)  # a key under a mapping the user names
    unknown = {
        name: where for name, where in _named_keys().items()
        if name.split(".")[0].split("[")[0] in sections and name not in NOT_KEYS
        and not name.endswith(NOT_KEY_SUFFIXES) and not any(p.match(name) for p in patterns)
        and not (name.startswith(mappings) and _under_mapping(name, keys))
    }
    assert not unknown, f"keys the documentation names that the settings do not have: {unknown}"


def _under_mapping(name: str, keys: set[str]) -> bool:
    """`judges.redaction.patterns.employee_id`: one more name under a key whose value is a mapping of
    names the user chooses (its type in the reference is a mapping)."""
    parent = name.rsplit(".", 1)[0]
    return parent in keys and not any(k.startswith(parent + ".") for k in keys)


def test_the_check_sees_a_key_that_does_not_exist() -> None:
    keys = _reference_keys()
    patterns = _patterns(keys)
    assert any(p.match("judges.endpoints.default.base_url") for p in patterns)
    assert any(p.match("collections.file") for p in patterns)
    assert not any(p.match("stream.result_topic") for p in patterns)  # results_topic, misspelt
    assert "stream.results_topic" in _named_keys()
