"""Free TCP ports for processes that must know a port before they start (a gateway started beside
its workers, a benchmark's servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1.

    The port comes from below the kernel's ephemeral range: a port the kernel hands to `bind(0)` or
    to an outgoing connection can be taken by another process (a worker's metrics server, a gloo
    socket) between this check and the worker's own bind, which once failed a whole CI run. Ports
    already handed out in this process are never handed out again, since they may not be bound yet.
    """
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port below the ephemeral range (starts at {low})")
