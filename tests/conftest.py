"""Fixtures shared across test files. Test helpers that talk to real parts live in tests/support/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.kafka import shared_broker
from support.openai_stub import OpenAIStub

from tracejudge.consumer.demo.broker import LocalBroker


@pytest.fixture
def stub() -> Iterator[OpenAIStub]:
    """A real OpenAI-compatible HTTP server on loopback with scripted answers."""
    with OpenAIStub() as s:
        yield s


@pytest.fixture(scope="session")
def broker() -> LocalBroker:
    """One Tansu broker on a free loopback port for the whole run (topics and groups are unique per test)."""
    return shared_broker()
