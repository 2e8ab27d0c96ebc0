"""The worker processes integration modules share (shared_pool.py): started by the first module that
asks for them, stopped at the end of the session."""

from __future__ import annotations

import pytest
from shared_pool import Pool, start_pool

from harness.leak_check import assert_no_leaks


@pytest.fixture(scope="session")
def shared_pool() -> Pool:
    pool = start_pool()
    yield pool
    codes = {f"{worker.args[0]}@{worker.address}": worker.stop() for worker in pool.workers}
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def pool(shared_pool: Pool) -> Pool:
    """The shared workers for one module, which must leave them holding nothing (checked here, so that a
    leak fails the module that made it rather than the next one)."""
    yield shared_pool
    assert_no_leaks(shared_pool.workers)
