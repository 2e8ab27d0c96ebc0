"""Where a serving command listens and what address it gives others: `--host`, `--port` and
`--advertise-host`, the same on every server (each command sets its own default port)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config_flags import flag


@dataclass(frozen=True)
class AddressFlags:
    """The address flags of a server."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(0, "0 = a free port")
    advertise_host: str | None = flag(
        None, "address other hosts reach this process at (its ready line names it; workers' KV links use it; "
        "default: --host; set it when --host is a wildcard such as 0.0.0.0)")
