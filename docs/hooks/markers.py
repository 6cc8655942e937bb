"""The `<!-- generated: ... -->` marker lines of a page, outside fenced code, for the hooks that fill them
(`reference.py`: `configuration`, `metrics`; `commands.py`: `usage tracejudge ...`). One reading of
the syntax for both, so a marker one hook sees is the marker the other sees."""

from __future__ import annotations

import re

__all__ = ["MARKER", "generated_markers"]

MARKER = re.compile(r"^[ \t]*<!--[ \t]*generated:(.*?)-->[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```+|~~~+)")


def generated_markers(lines: list[str]) -> list[tuple[int, str]]:
    """(line index, what follows `generated:`, stripped) of every marker line outside fenced code. A
    fence closes on a line opening with at least as many of the same character."""
    found: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(lines):
        opened = _FENCE.match(line)
        if opened:
            if fence is None:
                fence = opened.group(1)
            elif opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if fence is None and (match := MARKER.match(line)):
            found.append((n, match.group(1).strip()))
    return found
