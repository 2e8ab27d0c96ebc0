"""`tandem` server processes for the integration tests and the benchmarks: each one's stderr goes to
a log file of its own (kept only when it exits uncleanly), its addresses come from its ready line
(services/launcher.py).

    worker = start_worker(["prefill", "--port", "0"])
    ... worker.address ...
    assert worker.stop() == 0
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from harness.paths import REPO
from services.launcher import LaunchError, ServerProcess, tandem_command

_SERVERS = ("prefill", "decode", "worker")  # the gateway serves /metrics on its HTTP port


class WorkerProcess:
    """One `python -m services.cli ARGS` process (`proc`); its logs (stderr) go to `log_path`."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None, wrapper: Sequence[str] = ()) -> None:
        """`wrapper` prefixes the command line (e.g. `ip netns exec NAME`: harness.hosts)."""
        self.args = list(args)
        # Never a fixed port unless asked for: the metrics port is a free one unless the caller picks it.
        if self.args[0] in _SERVERS and "--metrics-port" not in self.args:
            self.args += ["--metrics-port", "0"]
        env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with tempfile.NamedTemporaryFile(prefix=f"tandem-{self.args[0]}-", suffix=".log", delete=False) as log:
            self.log_path = Path(log.name)
            self._server = ServerProcess(self.args[0], [*wrapper, *tandem_command(self.args)], env=env, cwd=REPO,
                                         stderr=log)
        self.proc = self._server.proc

    @property
    def address(self) -> str | None:
        """Its gRPC address, once ready."""
        return ready.grpc if (ready := self._server.ready) else None

    @property
    def metrics_address(self) -> str | None:
        """Its Prometheus endpoint (a worker's), once ready."""
        return ready.metrics if (ready := self._server.ready) else None

    @property
    def http_address(self) -> str | None:
        """The gateway's HTTP API, once ready."""
        return ready.http if (ready := self._server.ready) else None

    def wait_ready(self, timeout: float = 300.0) -> str:
        """Block until the ready line; its address. RuntimeError (LaunchError, with the log's tail)
        if the process exits first or the timeout passes; the process is stopped then."""
        try:
            return self._server.wait_ready(timeout).grpc
        except LaunchError as error:
            self.stop(timeout=5.0)
            raise LaunchError(f"{self.args} did not become ready ({error}); log:\n{self.log_tail()}") from None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit (SIGKILL after `timeout`); the exit code. The log is kept
        only when the exit code is not 0."""
        code = self._server.stop(timeout)
        if code == 0:
            self.log_path.unlink(missing_ok=True)
        return code

    def tensor_parallel_ranks(self) -> list[int]:
        """The pids of the worker's other tensor-parallel ranks: its child processes started by
        multiprocessing's spawn (not its resource tracker)."""
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        ranks = []
        for pid in map(int, found.split()):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    ranks.append(pid)
        return ranks

    def log_tail(self, lines: int = 40) -> str:
        """The end of the process's stderr (empty once a clean stop removed the log)."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_worker(
    args: Sequence[str], wait: bool = True, timeout: float = 300.0, env: Mapping[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> WorkerProcess:
    """Start `tandem <args>` (e.g. ["decode", "--port", "0", "--kv-backend", "grpc"]) with `env` added
    to this process's environment, its command line prefixed by `wrapper`; unless `wait` is False,
    return once it is SERVING, with `address` (and `metrics_address`) set."""
    worker = WorkerProcess(args, env, wrapper)
    if wait:
        worker.wait_ready(timeout)
    return worker
