"""Start server processes and learn where a Tandem server serves from its ready line.

Every Tandem server prints one line on stdout once it is SERVING (services/common/server.py):

    tandem <role> ready grpc=HOST:PORT[ metrics=HOST:PORT][ http=HOST:PORT]

`tandem mesh`, the integration tests and the benchmarks start their processes as `ServerProcess`es
and read that line with `ReadyLine.parse`; nothing else parses it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

_READY = re.compile(r"^tandem (\w+) ready grpc=(\S+)(?: metrics=(\S+))?(?: http=(\S+))?$")


@dataclass(frozen=True)
class ReadyLine:
    """What a ready line says: the server's role and the addresses it serves on."""

    role: str
    grpc: str
    metrics: str | None = None
    http: str | None = None

    @classmethod
    def parse(cls, line: str) -> ReadyLine | None:
        """The fields of a ready line; None when `line` is not one."""
        match = _READY.match(line.strip())
        return None if match is None else cls(*match.groups())


class LaunchError(RuntimeError):
    """A process ended, or printed no ready line in time."""


def tandem_command(args: Sequence[str]) -> list[str]:
    """The command line of `tandem ARGS` run by this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]


class ServerProcess:
    """One child process in a process group of its own, so that a Ctrl-C meant for the parent does
    not reach it and stopping it stops whatever it started. Its stdout is read on a thread: every
    line goes to `on_line` and the first ready line is kept as `ready`. Its stderr goes to `stderr`
    (this process's own when None)."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, stderr: IO[str] | IO[bytes] | None = None,
                 on_line: Callable[[str], None] | None = None, cpus: Collection[int] | None = None) -> None:
        self.name = name
        self.ready: ReadyLine | None = None
        self._on_line = on_line
        self._settled = threading.Event()  # set at the ready line, or when stdout ends without one
        self.proc = subprocess.Popen(list(argv), cwd=cwd, env=None if env is None else dict(env),
                                     stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1,
                                     process_group=0)
        if cpus is not None:
            os.sched_setaffinity(self.proc.pid, set(cpus))
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if self._on_line is not None:
                self._on_line(line)
            if self.ready is None and (ready := ReadyLine.parse(line)) is not None:
                self.ready = ready
                self._settled.set()
        self._settled.set()

    def wait_ready(self, timeout: float) -> ReadyLine:
        """Block until the ready line and return it; LaunchError if the process ends first or
        `timeout` seconds pass."""
        self._settled.wait(max(0.0, timeout))
        if self.ready is not None:
            return self.ready
        if self._settled.is_set():
            raise LaunchError(f"{self.name} exited with code {self.proc.wait()} before it was ready")
        raise LaunchError(f"{self.name} printed no ready line within {timeout:.0f} s")

    def terminate(self) -> None:
        """Ask the process to drain and exit (SIGTERM to its group), if it still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it may exit between the poll and the signal
                os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> tuple[int, bool]:
        """Wait up to `timeout` seconds for the exit, then SIGKILL the group; (exit code, killed)."""
        try:
            return self.proc.wait(max(0.0, timeout)), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(), True

    def stop(self, timeout: float) -> int:
        """SIGTERM, SIGKILL after `timeout` seconds; the exit code."""
        self.terminate()
        return self.wait_or_kill(timeout)[0]
