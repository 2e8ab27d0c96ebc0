"""Start `tandem` server processes for integration tests and learn their addresses from the ready
line (`tandem <role> ready grpc=HOST:PORT[ metrics=HOST:PORT][ http=HOST:PORT]`) they print on stdout once SERVING.

    worker = start_worker(["prefill", "--port", "0"])
    ... worker.address ...
    assert worker.stop() == 0
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SERVERS = ("prefill", "decode", "worker")  # the gateway serves /metrics on its HTTP port
_READY = re.compile(r"^tandem (\w+) ready grpc=(\S+)(?: metrics=(\S+))?(?: http=(\S+))?$")


class Worker:
    """One `python -m services.cli ...` process; its logs (stderr) go to `log_path`."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.args = list(args)
        # Tests never rely on a fixed port: the metrics port is a free one unless a test picks it.
        if self.args[0] in _SERVERS and "--metrics-port" not in self.args:
            self.args += ["--metrics-port", "0"]
        self.address: str | None = None
        self.metrics_address: str | None = None
        self.http_address: str | None = None  # the gateway's HTTP API
        env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with tempfile.NamedTemporaryFile(prefix=f"tandem-{self.args[0]}-", suffix=".log", delete=False) as log:
            self.log_path = Path(log.name)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *self.args],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_ready(self, timeout: float = 300.0) -> str:
        """Block until the ready line; its address. RuntimeError (with the log's tail) if the
        process exits or prints something else first, or the timeout passes."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        match = _READY.match(line or "")
        if match is None:
            self.stop(timeout=5.0)
            raise RuntimeError(f"{self.args} did not become ready (stdout: {line!r}); log:\n{self.log_tail()}")
        self.address, self.metrics_address, self.http_address = match.group(2), match.group(3), match.group(4)
        return self.address

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit (SIGKILL after `timeout`); the exit code. The log is kept
        only when the exit code is not 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The end of the process's stderr (empty once a clean stop removed the log)."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_worker(
    args: Sequence[str], wait: bool = True, timeout: float = 300.0, env: Mapping[str, str] | None = None
) -> Worker:
    """Start `tandem <args>` (e.g. ["decode", "--port", "0", "--kv-backend", "grpc"]) with `env` added
    to this process's environment; unless `wait` is False, return once it is SERVING, with `address`
    (and `metrics_address`) set."""
    worker = Worker(args, env)
    if wait:
        worker.wait_ready(timeout)
    return worker


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for tests that must know it before the ready line).

    The port comes from below the kernel's ephemeral range: a port the kernel hands to `bind(0)` or
    to an outgoing connection can be taken by another process (a worker's metrics server, a gloo
    socket) between this check and the worker's own bind, which once failed a whole CI run. Ports
    already handed out in this process are never handed out again, since they may not be bound yet.
    """
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port below the ephemeral range (starts at {low})")
