"""`tandem worker --role prefill|decode|colocated`: the one worker command; `tandem prefill` and
`tandem decode` are its aliases with the role fixed.

A colocated worker (the default) takes any part of a request: it serves tandem.v1.Decode and
tandem.v1.KVTransfer (computing a prompt and decoding it, like vLLM, or decoding a prompt computed
elsewhere) and tandem.v1.Prefill (computing a prompt for another worker and pushing its KV), so the
gateway places each request on one worker or two. The other roles restrict a worker to one side: a
prefill worker serves only tandem.v1.Prefill; a decode worker only Decode and KVTransfer (it still
computes a prompt itself when the gateway sends it one without a prefill worker).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from engine.config import Role
from services.commands.address_flags import AddressFlags
from services.commands.engine_flags import EngineFlags, flags_engine_config, repository_version
from services.commands.kv_flags import KVLinkFlags
from services.commands.security_flags import TlsFlags
from services.common.config_flags import add_flags, flag, from_args
from services.common.grpc_limits import GrpcLimits

if TYPE_CHECKING:
    from services.common.worker_config import WorkerConfig
    from services.repository.swap_settings import SwapSettings

# Each command's default --port.
PORTS = {"prefill": 50061, "decode": 50071, "worker": 50081}
# What only a worker that receives KV (decode, colocated) takes.
_RECEIVING = ("kv_backend", "kv_host", "memory_limit_mib")


@dataclass(frozen=True)
class WorkerFlags:
    """The flags of `tandem worker` (and its aliases): one field per flag."""

    role: Role = flag("colocated", "what the worker serves: colocated (any part of a request: prompts for "
                                   "itself or for other workers, decoding its own or others' prompts), or "
                                   "restricted to prefill (prompts in, first tokens and KV out) or decode "
                                   "(the same as `tandem decode`)")
    address: AddressFlags = dataclasses.field(default_factory=AddressFlags)
    grace_period: float = flag(30.0, "seconds in-flight requests get to finish on SIGTERM")
    kv: KVLinkFlags = dataclasses.field(default_factory=KVLinkFlags)
    kv_host: str | None = flag(None, "address the torch_dist rendezvous stores bind to (default: --advertise-host)")
    kv_timeout: float = flag(30.0, "seconds a prompt's KV may take between the workers: a decode worker's "
                                   "reservation waits this long for its first token and KV, a prefill worker "
                                   "drops pages not delivered by then")
    memory_limit_mib: int | None = flag(
        None, "memory the worker may hold with two model versions loaded: with --pool, a new version the "
        "repository assigns the pool loads beside the serving one when both fit, else the swap is refused "
        "(default: no swap in the process)")
    metrics_port: int | None = flag(None, "port of the Prometheus /metrics endpoint (default: --port + 1000; "
                                          "0 = a free port, printed on the ready line)")
    limits: GrpcLimits = dataclasses.field(default_factory=GrpcLimits)
    tls: TlsFlags = dataclasses.field(default_factory=TlsFlags)
    engine: EngineFlags = dataclasses.field(default_factory=EngineFlags)

    def __post_init__(self) -> None:
        receiving = {"--kv-backend": self.kv.kv_backend != KVLinkFlags.kv_backend,
                     "--kv-host": self.kv_host is not None, "--memory-limit-mib": self.memory_limit_mib is not None}
        given = [option for option, set_here in receiving.items() if set_here]
        if self.role == "prefill" and given:
            raise ValueError(f"{given[0]}: a decode or colocated worker's flag; a prefill worker sends KV over the "
                             "backend its decode workers name and swaps no model")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `worker` subcommand and its aliases `prefill` and `decode`."""
    worker = sub.add_parser("worker", help="serve a worker: prefill, decode, or colocated (both in one engine)")
    add_flags(worker, WorkerFlags, defaults={"port": PORTS["worker"]})
    worker.set_defaults(func=run)
    prefill = sub.add_parser("prefill", help="serve a prefill worker: prompts in, first tokens and KV pages out "
                                             "(`tandem worker --role prefill`)")
    add_flags(prefill, WorkerFlags, defaults={"port": PORTS["prefill"]}, skip=("role", *_RECEIVING))
    prefill.set_defaults(func=run, role="prefill")
    decode = sub.add_parser("decode", help="serve a decode worker: reserves KV, has it prefilled, streams tokens "
                                           "(`tandem worker --role decode`)")
    add_flags(decode, WorkerFlags, defaults={"port": PORTS["decode"]}, skip=("role",))
    decode.set_defaults(func=run, role="decode")


def worker_config(flags: WorkerFlags) -> WorkerConfig:
    """The WorkerConfig those flags describe; ValueError naming the flag."""
    from services.common.channels import Channels
    from services.common.worker_config import WorkerConfig
    from services.observability.metrics import default_metrics_port

    address = flags.address
    return WorkerConfig(
        engine=flags_engine_config(flags.engine, flags.role),
        host=address.host,
        port=address.port,
        advertise_host=address.advertise_host,
        grace_period=flags.grace_period,
        metrics_port=default_metrics_port(address.port, flags.metrics_port),
        channels=Channels(flags.tls.config(), flags.limits),
        kv_backend=flags.kv.kv_backend,
        kv_host=flags.kv_host,
        kv_timeout=flags.kv_timeout,
        kv_checksum=flags.kv.kv_checksum == "on",
        version=repository_version(flags.engine),
        swap=swap_settings(flags),
    )


def swap_settings(flags: WorkerFlags) -> SwapSettings | None:
    """A worker given its version by pool follows the repository file (services.decode.model_swap);
    one pinned by --model-version or --model serves that for life."""
    from services.repository.swap_settings import SwapSettings

    limit_mib, engine = flags.memory_limit_mib, flags.engine
    if limit_mib is not None and limit_mib <= 0:
        raise ValueError(f"--memory-limit-mib: must be positive, got {limit_mib}")
    if engine.model_repository is None or engine.pool is None:
        if limit_mib is not None:
            raise ValueError("--memory-limit-mib: bounds a hot swap, which a worker given --model-repository and "
                             "--pool makes; this one serves one version for life")
        return None
    return SwapSettings(engine.model_repository, engine.pool, None if limit_mib is None else limit_mib * 1024 * 1024)


def run(args: argparse.Namespace) -> NoReturn:
    """Serve until SIGTERM/SIGINT, then end the process with the drain's exit code."""
    import asyncio

    from services.common.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before the engine thread starts: see the module

    import torch

    from services.common.server import exit_process
    from services.observability.tracing import setup_tracing

    flags: WorkerFlags = from_args(WorkerFlags, args)
    torch.set_num_threads(flags.engine.threads)
    config = worker_config(flags)
    if flags.role == "prefill":
        from services.prefill.handler import serve
    else:
        from services.decode.handler import serve
    tracing = setup_tracing({"colocated": "worker"}.get(flags.role, flags.role))
    code = asyncio.run(serve(config))
    if tracing is not None:
        tracing.shutdown()
    exit_process(code)
