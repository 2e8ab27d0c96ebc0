"""A throw-away certificate authority for tests: a CA and certificates it signs, as PEM files.

    ca = TestCa(tmp_path / "ca", "Tandem test CA")
    server = ca.issue("worker")  # names localhost and 127.0.0.1
    ... server.cert_file, server.key_file, ca.cert_file ...
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert_file: Path
    key_file: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class TestCa:
    """A self-signed CA written to `folder` (created), which issues server-and-client certificates."""

    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._folder = folder
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _VALID).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_file = folder / "ca.crt"
        self.cert_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, dns_names: tuple[str, ...] = ("localhost",),
              ips: tuple[str, ...] = ("127.0.0.1",)) -> Issued:
        """A certificate for `name` (also its first DNS name) usable as server and as client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names = [x509.DNSName(dns) for dns in dns_names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _VALID).not_valid_after(now + _VALID)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        issued = Issued(self._folder / f"{name}.crt", self._folder / f"{name}.key")
        issued.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, issued.key_file)
        return issued
