"""The security flags of the serving commands: TLS for every server, API keys for the gateway.

Kept apart from services.common.tls and services.gateway.api_keys so that parsing the command line
imports neither gRPC nor Starlette.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.tls import TlsConfig


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca`, `--tls-server-name` (see services.common.tls)."""
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="PEM CA certificate: links between Tandem processes become mutual TLS, "
                             "peers must present a certificate it signed")
    parser.add_argument("--tls-server-name", default=None,
                        help="name the workers' certificates carry, checked instead of the address dialled")


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the flags ask for, or None for plaintext; ValueError naming the flag."""
    from services.common.tls import TlsConfig

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_ca is not None or args.tls_server_name is not None:
            raise ValueError("--tls-ca/--tls-server-name: need --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert/--tls-key: give both or neither")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's `--api-key-file` and `--metrics-auth` (see services.gateway.api_keys)."""
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="file of the API keys clients must send as `Authorization: Bearer <key>`: "
                             "TOML [[key]] tables (name, secret or secret_env, requests_per_minute, "
                             "tokens_per_minute, admin) or one key a line (also from TANDEM_API_KEYS, "
                             "comma-separated; none: no check); see docs/security.md")
    parser.add_argument("--metrics-auth", default="off", choices=["on", "off"],
                        help="whether GET /metrics of the HTTP API needs an API key too")
