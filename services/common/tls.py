"""TLS for every Tandem listener and channel, from certificate files, in one place.

A process given `--tls-cert` and `--tls-key` serves TLS; given `--tls-ca` as well, its internal
links are mutual: a worker then accepts only clients whose certificate that CA signed, and every
channel it (or the gateway) opens to another worker presents its own certificate and trusts only
that CA. With none of the flags everything stays plaintext, as on a developer's loopback.

Workers are usually reached by pod IP, which a certificate rarely names; `--tls-server-name` sets
the name the channels check the peer's certificate against instead (one SAN shared by the pool).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    """PEM files: this process's certificate chain and key, and the CA its peers must be signed by."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None  # None: no client certificates asked for; peers checked against system roots
    server_name: str | None = None  # the name peers' certificates must carry (None: the host dialled)

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file), ("--tls-ca", self.ca_file)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: {path} is not a readable file")
        if self.server_name == "":
            raise ValueError("--tls-server-name: must not be empty")

    @property
    def mutual(self) -> bool:
        """Whether peers must present a certificate signed by `ca_file`."""
        return self.ca_file is not None

    def _pem(self) -> tuple[bytes, bytes, bytes | None]:
        ca = self.ca_file.read_bytes() if self.ca_file is not None else None
        return self.cert_file.read_bytes(), self.key_file.read_bytes(), ca

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials:
        """Credentials of a gRPC server; with `client_auth` and a CA, clients without a certificate
        from that CA are refused during the TLS handshake."""
        cert, key, ca = self._pem()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=client_auth and ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel to another Tandem process: presents our certificate, trusts the CA."""
        cert, key, ca = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options that go with `channel_credentials` (the expected peer name, if set)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config arguments serving HTTPS with this certificate (no client certificates:
        HTTP clients authenticate with API keys)."""
        return {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}


def warn_if_worker_exposed(role: str, host: str, tls: TlsConfig | None) -> bool:
    """`warn_if_exposed` for a worker, whose callers authenticate with certificates from --tls-ca."""
    return warn_if_exposed(role, host, tls, tls is not None and tls.mutual, "client certificates (--tls-ca)")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(role: str, host: str, tls: TlsConfig | None, authenticated: bool = True,
                    credential: str = "API keys") -> bool:
    """Log one loud warning when `host` is reachable from other machines while the traffic is in
    plaintext (or, `authenticated` False, anyone may call: callers show no `credential`); True if
    it warned."""
    missing = [what for what, ok in (("TLS", tls is not None), (credential, authenticated)) if not ok]
    if is_loopback(host) or not missing:
        return False
    log.warning("SECURITY: %s listens on %s without %s: anyone who can reach it can read its traffic "
                "and call it. See docs/security.md.", role, host, " or ".join(missing))
    return True
