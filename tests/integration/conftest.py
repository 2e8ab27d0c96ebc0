"""The worker processes integration modules share (shared_pool.py): started by the first module that
asks for them, stopped once the last integration test is done."""

from __future__ import annotations

import pytest
from shared_pool import Pool, start_pool

from harness.leak_check import assert_no_leaks

_running: list[Pool] = []


@pytest.fixture(scope="session")
def shared_pool() -> Pool:
    pool = start_pool()
    _running.append(pool)
    yield pool
    _stop_pool()


@pytest.fixture(scope="module")
def pool(shared_pool: Pool) -> Pool:
    """The shared workers for one module, which must leave them holding nothing (checked here, so that a
    leak fails the module that made it rather than the next one)."""
    yield shared_pool
    assert_no_leaks(shared_pool.workers)


@pytest.hookimpl(trylast=True)  # after the module's own fixtures (the leak check above) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the pool after the last integration test rather than at the session's end: the unit tests
    that follow in one `make test` session need the memory its workers hold."""
    if _running and (nextitem is None or nextitem.path.parent != item.path.parent):
        _stop_pool()


def _stop_pool() -> None:
    while _running:
        pool = _running.pop()
        codes = {f"{worker.args[0]}@{worker.address}": worker.stop() for worker in pool.workers}
        assert set(codes.values()) == {0}, codes
