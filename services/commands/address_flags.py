"""Where a serving command listens and what address it gives others: `--host`, `--port` and
`--advertise-host`, the same on every server."""

from __future__ import annotations

import argparse


def add_address_flags(parser: argparse.ArgumentParser, default_port: int, advertised_for: str) -> None:
    """`--host`, `--port` (0: a free port) and `--advertise-host`; `advertised_for` says who uses
    the advertised address, for the help text."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="0 = a free port")
    parser.add_argument("--advertise-host", default=None,
                        help=f"address other hosts reach this process at ({advertised_for}; default: --host; "
                             "set it when --host is a wildcard such as 0.0.0.0)")
