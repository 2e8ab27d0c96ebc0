"""The worker processes integration modules share (shared_pool.py): started by the first module that
asks for them, stopped once the last module using them is done.

The modules using the pool run first, together, so that the pool's four workers never sit beside a
module that starts as many of its own (fault-injecting meshes, tensor-parallel ranks): on CI's
24 GiB, one worker process holding ~2 GB, the two together were killed for memory."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from shared_pool import Pool, openai_client, start_pool

from harness.leak_check import assert_no_leaks
from harness.worker import WorkerProcess

_HERE = Path(__file__).parent
_running: list[Pool] = []
_pool_modules: set[Path] = set()


@pytest.fixture(scope="session")
def shared_pool() -> Pool:
    pool = start_pool()
    _running.append(pool)
    yield pool
    _stop_pool()


@pytest.fixture(scope="module")
def clients(gateways: list[WorkerProcess]) -> list[openai.OpenAI]:
    """The SDK's client of each gateway a module puts in front of the pool (its `gateways` fixture)."""
    return [openai_client(gateway) for gateway in gateways]


@pytest.fixture(scope="module")
def model_id(clients: list[openai.OpenAI]) -> str:
    """The model those gateways serve."""
    return clients[0].models.list().data[0].id


@pytest.fixture(scope="module")
def pool(shared_pool: Pool) -> Pool:
    """The shared workers for one module, which must leave them holding nothing (checked here, so that a
    leak fails the module that made it rather than the next one)."""
    yield shared_pool
    assert_no_leaks(shared_pool.workers)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the modules using the pool ahead of the other integration modules, each module's tests
    kept together and in their order."""
    here = [i for i, item in enumerate(items) if item.path.parent == _HERE]
    if not here:
        return
    _pool_modules.update(item.path for item in items if "shared_pool" in item.fixturenames)
    ours = [items[i] for i in here]
    ours.sort(key=lambda item: item.path not in _pool_modules)  # stable: module order kept within each group
    for i, item in zip(here, ours, strict=True):
        items[i] = item


@pytest.hookimpl(trylast=True)  # after the module's own fixtures (the leak check above) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the pool after the last module using it rather than at the session's end: the modules
    and the unit tests that follow need the memory its workers hold."""
    if _running and (nextitem is None or nextitem.path not in _pool_modules):
        _stop_pool()


def _stop_pool() -> None:
    while _running:
        pool = _running.pop()
        codes = {f"{worker.args[0]}@{worker.address}": worker.stop() for worker in pool.workers}
        assert set(codes.values()) == {0}, codes
