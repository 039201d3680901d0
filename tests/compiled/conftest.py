"""Each compiled test starts from a clean dynamo: its caches and recompile counts are
process-wide, so what earlier tests in the same worker compiled (which differs with how
pytest-xdist distributes the tests) must not decide whether a region runs compiled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
