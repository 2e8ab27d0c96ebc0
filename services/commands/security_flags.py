"""The security flags of the serving commands: TLS for every server, API keys for the gateway.

Kept apart from services.common.tls and services.gateway.api_keys so that parsing the command line
imports neither gRPC nor Starlette.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from services.common.config_flags import flag

if TYPE_CHECKING:
    from services.common.tls import TlsConfig


@dataclass(frozen=True)
class TlsFlags:
    """`--tls-cert`, `--tls-key`, `--tls-ca`, `--tls-server-name` (see services.common.tls)."""

    tls_cert: Path | None = flag(None, "PEM certificate chain: serve TLS")
    tls_key: Path | None = flag(None, "PEM private key of --tls-cert")
    tls_ca: Path | None = flag(None, "PEM CA certificate: links between Tandem processes become mutual TLS, "
                                     "peers must present a certificate it signed")
    tls_server_name: str | None = flag(None, "name the workers' certificates carry, checked instead of the "
                                             "address dialled")

    def __post_init__(self) -> None:
        if self.tls_cert is None and self.tls_key is None:
            if self.tls_ca is not None or self.tls_server_name is not None:
                raise ValueError("--tls-ca/--tls-server-name: need --tls-cert and --tls-key")
        elif self.tls_cert is None or self.tls_key is None:
            raise ValueError("--tls-cert/--tls-key: give both or neither")

    def config(self) -> TlsConfig | None:
        """The TlsConfig the flags ask for, or None for plaintext; ValueError naming the flag."""
        from services.common.tls import TlsConfig

        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsConfig(self.tls_cert, self.tls_key, self.tls_ca, self.tls_server_name)


@dataclass(frozen=True)
class ApiKeyFlags:
    """The gateway's `--api-key-file` and `--metrics-auth` (see services.gateway.api_keys)."""

    api_key_file: Path | None = flag(
        None, "file of the API keys clients must send as `Authorization: Bearer <key>`: TOML [[key]] tables "
        "(name, secret or secret_env, requests_per_minute, tokens_per_minute, admin) or one key a line (also "
        "from TANDEM_API_KEYS, comma-separated; none: no check); see docs/security.md")
    metrics_auth: Literal["on", "off"] = flag("off", "whether GET /metrics of the HTTP API needs an API key too")
