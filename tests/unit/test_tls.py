"""services.common.tls on real gRPC servers on loopback: mutual TLS lets a peer with a certificate
from the CA in and refuses one without a certificate or with one from another CA."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from certs import TestCa
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.channels import Channels
from services.common.tls import TlsConfig, warn_if_exposed, warn_if_worker_exposed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = TestCa(folder / "ca", "Tandem test CA"), TestCa(folder / "other", "Another CA")
    server, client, stranger = ca.issue("server"), ca.issue("client"), other.issue("stranger")
    return {"ca": ca.cert_file, "other_ca": other.cert_file, "server_cert": server.cert_file,
            "server_key": server.key_file, "client_cert": client.cert_file, "client_key": client.key_file,
            "stranger_cert": stranger.cert_file, "stranger_key": stranger.key_file}


async def _check(server_tls: TlsConfig, channel: grpc.aio.Channel) -> grpc.StatusCode:
    """Serve health with `server_tls` (clients must show a certificate) and Check it over `channel`."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_tls.server_credentials())
    await server.start()
    target = f"127.0.0.1:{port}"
    try:
        async with channel(target) as opened:
            await health_pb2_grpc.HealthStub(opened).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        await server.stop(None)


def test_a_peer_with_a_certificate_from_the_ca_is_served(pki: dict[str, Path]) -> None:
    server = TlsConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    client = TlsConfig(pki["client_cert"], pki["client_key"], pki["ca"])
    assert asyncio.run(_check(server, lambda target: Channels(client).open(target))) == grpc.StatusCode.OK


def test_the_checked_name_can_differ_from_the_address(pki: dict[str, Path]) -> None:
    server = TlsConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    named = TlsConfig(pki["client_cert"], pki["client_key"], pki["ca"], server_name="localhost")
    wrong = TlsConfig(pki["client_cert"], pki["client_key"], pki["ca"], server_name="elsewhere.example")
    assert asyncio.run(_check(server, lambda target: Channels(named).open(target))) == grpc.StatusCode.OK
    assert asyncio.run(_check(server, lambda target: Channels(wrong).open(target))) == grpc.StatusCode.UNAVAILABLE


def test_a_peer_without_a_certificate_is_refused(pki: dict[str, Path]) -> None:
    server = TlsConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    roots = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    assert asyncio.run(_check(server, lambda target: grpc.aio.secure_channel(target, roots))) \
        == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(_check(server, lambda target: Channels(None).open(target))) == grpc.StatusCode.UNAVAILABLE


def test_a_peer_with_a_certificate_from_another_ca_is_refused(pki: dict[str, Path]) -> None:
    server = TlsConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    # The stranger trusts our CA (so it would accept the server), but the server does not trust it.
    stranger = TlsConfig(pki["stranger_cert"], pki["stranger_key"], pki["ca"])
    assert asyncio.run(_check(server, lambda target: Channels(stranger).open(target))) \
        == grpc.StatusCode.UNAVAILABLE


def test_config_names_the_missing_file(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-ca"):
        TlsConfig(pki["server_cert"], pki["server_key"], tmp_path / "missing.crt")
    with pytest.raises(ValueError, match="--tls-server-name"):
        TlsConfig(pki["server_cert"], pki["server_key"], server_name="")


def test_only_an_exposed_plaintext_listener_warns(pki: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    tls = TlsConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    with caplog.at_level(logging.WARNING):
        assert not warn_if_exposed("prefill", "127.0.0.1", None, authenticated=False)
        assert not warn_if_exposed("prefill", "localhost", None, authenticated=False)
        assert not warn_if_exposed("prefill", "0.0.0.0", tls)
        assert warn_if_exposed("gateway", "0.0.0.0", tls, authenticated=False)
        assert warn_if_exposed("gateway", "10.0.0.7", None)
        assert not warn_if_worker_exposed("decode", "0.0.0.0", tls)
        assert warn_if_worker_exposed("decode", "0.0.0.0", TlsConfig(pki["server_cert"], pki["server_key"]))
    messages = [record.getMessage() for record in caplog.records]
    assert [message.split(":")[0] for message in messages] == ["SECURITY"] * 3
    assert "without API keys" in messages[0]
    assert "without TLS" in messages[1]
    assert "without client certificates" in messages[2]
