"""Fixtures of the coordinator's unit tests (helpers live in fakes.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
