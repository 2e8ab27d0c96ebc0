"""`tandem decode`: a decode worker (tandem.v1.Decode and tandem.v1.KVTransfer) serving one engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, NoReturn

from services.commands.address_flags import add_address_flags
from services.commands.engine_flags import add_engine_flags, engine_config
from services.commands.kv_flags import add_kv_checksum_flag, kv_checksum
from services.commands.limit_flags import add_grpc_limit_flags, grpc_limits
from services.commands.security_flags import add_tls_flags, tls_config
from services.commands.telemetry_flags import add_metrics_flag, metrics_port

if TYPE_CHECKING:
    from services.decode.model_swap import SwapSettings


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `decode` subcommand."""
    decode = sub.add_parser("decode", help="serve a decode worker: reserves KV, has it prefilled, streams tokens")
    add_decode_flags(decode, default_port=50071)
    decode.set_defaults(func=run, role="decode")


def add_decode_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags of a worker serving tandem.v1.Decode (decode and colocated roles)."""
    add_address_flags(parser, default_port, "the ready line, and prefill workers for its KV")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--kv-backend", default="torch_dist", choices=["torch_dist", "grpc"],
                        help="how prompts' KV pages arrive from prefill workers")
    parser.add_argument("--kv-host", default=None,
                        help="address the torch_dist rendezvous stores bind to (default: --advertise-host)")
    parser.add_argument("--kv-timeout", type=float, default=30.0,
                        help="seconds a reservation waits for its prompt's first token and KV")
    add_kv_checksum_flag(parser)
    parser.add_argument("--memory-limit-mib", type=int, default=None,
                        help="memory the worker may hold with two model versions loaded: with --pool, a new "
                             "version the repository assigns the pool loads beside the serving one when both "
                             "fit, else the swap is refused (default: no swap in the process)")
    add_metrics_flag(parser)
    add_grpc_limit_flags(parser)
    add_tls_flags(parser)
    add_engine_flags(parser)


def run(args: argparse.Namespace) -> NoReturn:
    """Serve until SIGTERM/SIGINT, then end the process with the drain's exit code."""
    import asyncio

    from services.common.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before the engine thread starts: see the module

    import torch

    from services.common.server import exit_process
    from services.decode.handler import serve
    from services.observability.tracing import setup_tracing

    torch.set_num_threads(args.threads)
    config = engine_config(args, args.role)
    port = metrics_port(args)
    tls = tls_config(args)
    limits = grpc_limits(args)
    advertise_host = args.advertise_host or args.host
    swap = swap_settings(args)
    tracing = setup_tracing("worker" if args.role == "colocated" else "decode")
    code = asyncio.run(serve(config, args.host, args.port, args.grace_period, args.kv_backend,
                             args.kv_host or advertise_host, args.kv_timeout, port, advertise_host, tls, limits,
                             kv_checksum(args), swap, lambda version: engine_config(args, args.role, version)))
    if tracing is not None:
        tracing.shutdown()
    exit_process(code)


def swap_settings(args: argparse.Namespace) -> SwapSettings | None:
    """A worker given its version by pool follows the repository file (services.decode.model_swap);
    one pinned by --model-version or --model serves that for life."""
    from services.decode.model_swap import SwapSettings

    if args.memory_limit_mib is not None and args.memory_limit_mib <= 0:
        raise ValueError(f"--memory-limit-mib: must be positive, got {args.memory_limit_mib}")
    if args.model_repository is None or args.pool is None:
        if args.memory_limit_mib is not None:
            raise ValueError("--memory-limit-mib: bounds a hot swap, which a worker given --model-repository and "
                             "--pool makes; this one serves one version for life")
        return None
    limit = None if args.memory_limit_mib is None else args.memory_limit_mib * 1024 * 1024
    return SwapSettings(args.model_repository, args.pool, limit)
