"""Fixtures shared across test files. Test helpers that talk to real parts live in tests/support/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.openai_stub import OpenAIStub


@pytest.fixture
def stub() -> Iterator[OpenAIStub]:
    """A real OpenAI-compatible HTTP server on loopback with scripted answers."""
    with OpenAIStub() as s:
        yield s
