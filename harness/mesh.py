"""A mesh as real processes on loopback: prefill workers, decode workers, colocated workers (the
flexible shape: each computes prompts, decodes them, or both) and a gateway in front of them,
started together (their model loads overlap) and stopped together.

    mesh = start_mesh(prefill=2, decode=2, gateway_flags=["--ttft-slo-ms", "600000"])
    ... mesh.gateway.address, mesh.gateway.http_address, mesh.workers ...
    codes = mesh.stop()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker

WORKER_FLAGS = ("--threads", "1", "--kv-cache-mib", "128")


@dataclass
class Mesh:
    """The processes of one mesh; `stop()` ends them, the gateway first."""

    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]
    gateway: WorkerProcess
    colocated: list[WorkerProcess] = field(default_factory=list)

    @property
    def workers(self) -> list[WorkerProcess]:
        """The prefill, decode and colocated workers (the processes that hold KV blocks)."""
        return [*self.prefill, *self.decode, *self.colocated]

    @property
    def processes(self) -> list[WorkerProcess]:
        """Every process, the gateway last."""
        return [*self.workers, self.gateway]

    def stop(self) -> dict[str, int]:
        """SIGTERM every process, the gateway first; each one's exit code by `role@address`."""
        return {f"{p.args[0]}@{p.address}": p.stop() for p in reversed(self.processes)}


def start_mesh(
    prefill: int = 1,
    decode: int = 1,
    worker_flags: Sequence[str] = WORKER_FLAGS,
    gateway_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    colocated: int = 0,
) -> Mesh:
    """Start the workers (`colocated` of them `tandem worker --role colocated`) and a gateway over
    them (`--port 0 --http-port 0` plus `gateway_flags`), with `env` added to their environment;
    return once every process is serving. If one fails to start, the others are stopped."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["colocated"] * colocated
    # Ports known before the start, so that the gateway starts with the workers.
    ports = [free_port() for _ in roles]
    addresses = {role: ",".join(f"127.0.0.1:{port}" for r, port in zip(roles, ports, strict=True) if r == role)
                 for role in ("prefill", "decode", "colocated")}
    arg_lists = [[*(["worker", "--role", role] if role == "colocated" else [role]), "--port", str(port),
                  *worker_flags] for role, port in zip(roles, ports, strict=True)]
    pools = [arg for role, pool in addresses.items() if pool for arg in (f"--{role}", pool)]
    arg_lists.append(["gateway", "--port", "0", "--http-port", "0", *pools, *gateway_flags])
    processes = [start_worker(args, wait=False, env=env) for args in arg_lists]
    try:
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in reversed(processes):
            process.stop(timeout=10.0)
        raise
    *workers, gateway = processes
    return Mesh(workers[:prefill], workers[prefill:prefill + decode], gateway, workers[prefill + decode:])


@contextlib.contextmanager
def running(arg_lists: Sequence[Sequence[str]], env: Mapping[str, str] | None = None) -> Iterator[list[WorkerProcess]]:
    """`tandem <args>` for each of `arg_lists`, with `env` added to their environment, started
    together and yielded once every one serves; stopped after, the last first, each exiting 0."""
    processes = [start_worker(args, wait=False, env=env) for args in arg_lists]
    try:
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        codes = [process.stop() for process in reversed(processes)]
        assert codes == [0] * len(processes)
