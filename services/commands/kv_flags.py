"""`--kv-checksum`, the same on both ends of a KV transfer (prefill and decode workers, and the mesh)."""

from __future__ import annotations

import argparse


def add_kv_checksum_flag(parser: argparse.ArgumentParser) -> None:
    """Add `--kv-checksum on|off` (default on)."""
    parser.add_argument("--kv-checksum", default="on", choices=["on", "off"],
                        help="a checksum on KV pages (CRC32C on gRPC and gloo, device sums on NCCL). off "
                             "skips it only for peers that are off too: a checksum is used unless both ends say off")


def kv_checksum(args: argparse.Namespace) -> bool:
    """Whether the flag asks for checksums."""
    return args.kv_checksum == "on"
