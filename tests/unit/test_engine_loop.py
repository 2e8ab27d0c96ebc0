"""The engine loop dispatches every command of engine.commands to the engine method it names, on the
engine thread (a recording stand-in for the engine: what is tested is the dispatch, not the model)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engine import commands
from engine.commands import Abort, AddRequest, Command, GetStats, ImportPages, Release, Reserve, StartDecode
from engine.config import EngineConfig
from engine.outputs import KVReservation
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop

PARAMS = SamplingParams()
RESERVATION = KVReservation("r", (4,), 0, 16, ticket=1)
# Each command, and the engine call it must become.
EXPECTED = {
    AddRequest: (AddRequest("r", (1, 2), PARAMS), ("add_request", ("r", (1, 2), PARAMS, None, None))),
    Reserve: (Reserve("r", (1, 2), PARAMS, None, 5.0), ("reserve", ("r", (1, 2), PARAMS, None, 5.0))),
    ImportPages: (ImportPages(RESERVATION, 3, (4,), "k", "v"), ("import_kv", (RESERVATION, 3, (4,), "k", "v"))),
    StartDecode: (StartDecode("r", 7), ("start_decode", ("r", 7, None))),
    Release: (Release("r"), ("release", ("r",))),
    Abort: (Abort("r"), ("abort", ("r",))),
    GetStats: (GetStats(), ("stats", ())),
    commands.AddAdapter: (commands.AddAdapter("adapter"), ("add_adapter", ("adapter",))),  # type: ignore[arg-type]
    commands.KeepAdapter: (commands.KeepAdapter("adapter"), ("keep_adapter", ("adapter",))),  # type: ignore[arg-type]
    commands.RemoveAdapter: (commands.RemoveAdapter("sql"), ("remove_adapter", ("sql",))),
}


class _RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, str]] = []
        self.config = EngineConfig()

    def has_unfinished(self) -> bool:
        return False

    def next_kv_deadline(self) -> float | None:
        return None

    def __getattr__(self, name: str):
        def record(*args):
            self.calls.append((name, args, threading.current_thread().name))
            return name
        return record


def test_every_command_of_the_module_has_an_expectation_here():
    defined = {value for value in vars(commands).values()
               if isinstance(value, type) and issubclass(value, Command) and value is not Command}
    assert defined == set(EXPECTED)


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda kind: kind.__name__)
def test_a_command_runs_its_engine_method_on_the_engine_thread(kind: type[Command]):
    command, (method, args) = EXPECTED[kind]
    assert dataclasses.is_dataclass(command)
    engine = _RecordingEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    loop.start()
    try:
        assert asyncio.run(loop.call(command)) == method
    finally:
        loop.stop()
    assert engine.calls == [(method, args, "engine")]


def test_pages_are_imported_on_the_callers_thread():
    engine = _RecordingEngine()
    command, (method, args) = EXPECTED[ImportPages]
    EngineLoop(engine).import_pages(command)  # type: ignore[arg-type]
    assert engine.calls == [(method, args, threading.current_thread().name)]


def test_something_that_is_not_a_command_fails_its_caller():
    loop = EngineLoop(_RecordingEngine())  # type: ignore[arg-type]
    loop.start()
    try:
        with pytest.raises(TypeError, match="not an engine command"):
            asyncio.run(loop.call(Command()))
    finally:
        loop.stop()
