"""A disaggregated mesh across separate hosts (harness.hosts): a gateway host, prefill hosts
and decode hosts, one worker on each worker host and any number of gateways on the gateway host.
Every process binds and advertises its own host's address; nothing runs on loopback.

    hosts = Hosts(HOST_NAMES)
    mesh = start_host_mesh(hosts, worker_flags, decode_flags={"decode-1": [...], "decode-2": [...]},
                           gateways={"all": ["decode-1", "decode-2"]})
    ... mesh.gateways["all"].address, mesh.prefill["prefill-1"], mesh.decode["decode-2"] ...
    mesh.stop(); hosts.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harness.hosts import Hosts
from harness.worker import WorkerProcess, start_worker

GATEWAY_HOST = "gateway"
PREFILL_HOSTS = ("prefill-1", "prefill-2")
DECODE_HOSTS = ("decode-1", "decode-2")
HOST_NAMES = (GATEWAY_HOST, *PREFILL_HOSTS, *DECODE_HOSTS)
# Each host has its own network stack, so fixed ports never collide.
PREFILL_PORT, DECODE_PORT, GATEWAY_PORT, GATEWAY_HTTP_PORT = 50061, 50071, 50051, 8000


@dataclass
class HostMesh:
    """The processes of one mesh across hosts; `stop()` ends them, the gateways first."""

    hosts: Hosts
    prefill: dict[str, WorkerProcess]  # by host
    decode: dict[str, WorkerProcess]  # by host
    gateways: dict[str, WorkerProcess]  # by the name the caller gave

    @property
    def workers(self) -> list[WorkerProcess]:
        """The prefill and decode workers (the processes that hold KV blocks)."""
        return [*self.prefill.values(), *self.decode.values()]

    @property
    def processes(self) -> list[WorkerProcess]:
        """Every process, the gateways first."""
        return [*self.gateways.values(), *self.workers]

    def stop(self) -> dict[str, int]:
        """SIGTERM every process, the gateways first; each one's exit code by `role@address`."""
        return {f"{p.args[0]}@{p.address}": p.stop() for p in self.processes}


def _address(hosts: Hosts, host: str, port: int) -> str:
    return f"{hosts.address(host)}:{port}"


def start_host_mesh(
    hosts: Hosts,
    worker_flags: Sequence[str],
    decode_flags: Mapping[str, Sequence[str]],
    gateways: Mapping[str, Sequence[str]],
    gateway_flags: Sequence[str] = (),
    host_flags: Mapping[str, Sequence[str]] = {},
    host_wrapper: Mapping[str, Sequence[str]] = {},
    prefill_hosts: Sequence[str] = PREFILL_HOSTS,
) -> HostMesh:
    """Start a prefill worker on each of `prefill_hosts`, a decode worker on each host of `decode_flags`
    (with those flags, e.g. its `--kv-backend`), all with `worker_flags`, and on the gateway host one
    gateway per entry of `gateways` (name -> the decode hosts it fronts; every prefill worker) with
    `gateway_flags`. `host_flags` adds flags per host (the gateway host's go to every gateway) and
    `host_wrapper` prefixes a host's command lines, run inside the host. Returns once every process
    serves; if one fails to start, the others are stopped."""
    prefill = ",".join(_address(hosts, host, PREFILL_PORT) for host in prefill_hosts)
    plans: list[tuple[str, str, list[str]]] = []  # (kind, host, args)
    for host in prefill_hosts:
        plans.append(("prefill", host, ["prefill", "--port", str(PREFILL_PORT), *worker_flags]))
    for host, flags in decode_flags.items():
        plans.append(("decode", host, ["decode", "--port", str(DECODE_PORT), *worker_flags, *flags]))
    for i, decode_hosts in enumerate(gateways.values()):
        decode = ",".join(_address(hosts, host, DECODE_PORT) for host in decode_hosts)
        plans.append(("gateway", GATEWAY_HOST, [
            "gateway", "--port", str(GATEWAY_PORT + i), "--http-port", str(GATEWAY_HTTP_PORT + i),
            "--prefill", prefill, "--decode", decode, *gateway_flags]))
    processes = []
    try:
        for _, host, args in plans:
            address = hosts.address(host)
            args = [*args, "--host", address, "--advertise-host", address, *host_flags.get(host, ())]
            wrapper = [*hosts.exec_argv(host), *host_wrapper.get(host, ())]
            processes.append(start_worker(args, wait=False, wrapper=wrapper))
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in reversed(processes):
            process.stop(timeout=10.0)
        raise
    by_kind: dict[str, list[tuple[str, WorkerProcess]]] = {"prefill": [], "decode": [], "gateway": []}
    for (kind, host, _), process in zip(plans, processes, strict=True):
        by_kind[kind].append((host, process))
    return HostMesh(hosts, dict(by_kind["prefill"]), dict(by_kind["decode"]),
                    dict(zip(gateways, (process for _, process in by_kind["gateway"]), strict=True)))
