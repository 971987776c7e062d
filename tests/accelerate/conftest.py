"""Every Accelerate test starts and ends with accelerate's process-wide state reset."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("accelerate")

from tests.helpers.accelerate_runs import reset_accelerate  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    """Reset accelerate's singletons around the test."""
    reset_accelerate()
    yield
    reset_accelerate()
