"""`free_port` must not hand out a port the kernel may give to someone else's `bind(0)`: a CI run
once failed when a decode worker's metrics server took the port chosen for the prefill worker."""

from __future__ import annotations

import socket
from pathlib import Path

from harness.ports import free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_come_from_below_the_ephemeral_range_and_are_never_repeated() -> None:
    ports = [free_port() for _ in range(200)]
    assert max(ports) < _ephemeral_low()
    assert len(set(ports)) == len(ports)


def test_a_port_is_bindable_when_handed_out() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
