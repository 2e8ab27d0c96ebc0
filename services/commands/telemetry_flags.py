"""The `--metrics-port` flag of every serving command, and the tracing set-up they share."""

from __future__ import annotations

import argparse


def add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    """Add `--metrics-port` (Prometheus /metrics over HTTP)."""
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="port of the Prometheus /metrics endpoint (default: --port + 1000; 0 = a free "
                             "port, printed on the ready line)")


def metrics_port(args: argparse.Namespace) -> int:
    """The metrics port those flags describe; ValueError naming the flag."""
    from services.observability.metrics import default_metrics_port

    return default_metrics_port(args.port, args.metrics_port)
