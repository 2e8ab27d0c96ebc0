"""`tandem prefill`: a prefill worker (tandem.v1.Prefill) serving one engine."""

from __future__ import annotations

import argparse
from typing import NoReturn

from services.commands.address_flags import add_address_flags
from services.commands.engine_flags import add_engine_flags, engine_config
from services.commands.kv_flags import add_kv_checksum_flag, kv_checksum
from services.commands.limit_flags import add_grpc_limit_flags, grpc_limits
from services.commands.security_flags import add_tls_flags, tls_config
from services.commands.telemetry_flags import add_metrics_flag, metrics_port


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `prefill` subcommand."""
    prefill = sub.add_parser("prefill", help="serve a prefill worker: prompts in, first tokens and KV pages out")
    add_address_flags(prefill, 50061, "the ready line, and decode workers' torch_dist pairs for the KV it sends")
    prefill.add_argument("--grace-period", type=float, default=30.0,
                         help="seconds in-flight requests get to finish on SIGTERM")
    prefill.add_argument("--kv-timeout", type=float, default=30.0,
                         help="seconds a request's KV pages may take to reach the decode worker before "
                              "they are dropped")
    add_kv_checksum_flag(prefill)
    add_metrics_flag(prefill)
    add_grpc_limit_flags(prefill)
    add_tls_flags(prefill)
    add_engine_flags(prefill)
    prefill.set_defaults(func=run)


def run(args: argparse.Namespace) -> NoReturn:
    """Serve until SIGTERM/SIGINT, then end the process with the drain's exit code."""
    import asyncio

    from services.common.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before the engine thread starts: see the module

    import torch

    from services.common.server import exit_process
    from services.observability.tracing import setup_tracing
    from services.prefill.handler import serve

    torch.set_num_threads(args.threads)
    config = engine_config(args, "prefill")
    port = metrics_port(args)
    tls = tls_config(args)
    limits = grpc_limits(args)
    tracing = setup_tracing("prefill")
    code = asyncio.run(serve(config, args.host, args.port, args.grace_period, args.kv_timeout, port, tls, limits,
                             args.advertise_host, kv_checksum(args)))
    if tracing is not None:
        tracing.shutdown()
    exit_process(code)
