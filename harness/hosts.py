"""Separate hosts on one machine: each a network namespace with one interface, joined through veth
pairs to one bridge, for the integration tests and the benchmarks that must not run on loopback.

    hosts = Hosts(["gateway", "prefill-1", "decode-1"])  # needs root: see `namespaces_unavailable`
    try:
        ... start_worker(["prefill", "--host", hosts.address("prefill-1"), ...], wrapper=hosts.exec_argv("prefill-1"))
        hosts.link_down("prefill-1"); hosts.link_up("prefill-1"); hosts.cap("prefill-1", "200mbit")
    finally:
        hosts.close()

The bridge lives in a namespace of its own (the "switch") that holds no address, and each host's
only routes are its /24 of RFC 2544's benchmarking range (198.18.0.0/15) and its loopback, with
IPv6 off: traffic between the hosts can reach nothing else. That is checked before the constructor
returns, and before anything runs in them. The machine running the harness joins the bridge too,
as the client host (`client_address`): tests and benchmarks call the gateway and the workers from it.

Every name the harness creates starts with `PREFIX`, the creating process's id and a count of the
Hosts it made (`tag`), so a crashed run's namespaces are found and removed by the next one
(`remove_stale`, which `Hosts` runs first).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence

PREFIX = "tndh"
TEST_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: for benchmarking, never routed
_IP = shutil.which("ip") or "/usr/sbin/ip"
_TC = shutil.which("tc") or "/usr/sbin/tc"
_SYSCTL = shutil.which("sysctl") or "/usr/sbin/sysctl"
_HOST_IF = "eth0"  # each host's one interface
_BRIDGE = "br0"
# tndh<pid>n<k>-<host> for namespaces, tndh<pid>n<k> for the client link: the k-th Hosts of process pid.
_OWNED = re.compile(rf"^{PREFIX}(\d+)n\d+(?:-|$)")
_made_here = itertools.count()


class HostsError(RuntimeError):
    """A command of the harness failed, or the hosts are not isolated."""


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make network namespaces for the harness, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(_IP):
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe-{uuid.uuid4().hex[:6]}"
    try:
        _run(_IP, "netns", "add", probe)
    except HostsError as error:
        return f"`ip netns add` is refused here: {error}"
    _run(_IP, "netns", "del", probe)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    """SIGKILL every process still running in `netns` (by id: only the harness starts them there)."""
    with contextlib.suppress(HostsError):
        for pid in _run(_IP, "netns", "pids", netns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _delete_netns(netns: str) -> None:
    _kill_inside(netns)
    with contextlib.suppress(HostsError):
        _run(_IP, "netns", "del", netns)


def owned_namespaces() -> list[str]:
    """The harness's namespaces on this machine, of every run."""
    names = [line.split()[0] for line in _run(_IP, "netns", "list").splitlines() if line.strip()]
    return [name for name in names if _OWNED.match(name)]


def owned_links() -> list[str]:
    """The harness's client links in this (the root) namespace, of every run."""
    names = [line.split(":")[1].strip().split("@")[0] for line in _run(_IP, "-o", "link", "show").splitlines()]
    return [name for name in names if _OWNED.match(name)]


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (a crashed run); their names."""
    removed = []
    for name in owned_namespaces():
        if not _alive(int(_OWNED.match(name).group(1))):  # type: ignore[union-attr]
            _delete_netns(name)
            removed.append(name)
    for name in owned_links():
        if not _alive(int(_OWNED.match(name).group(1))):  # type: ignore[union-attr]
            with contextlib.suppress(HostsError):
                _run(_IP, "link", "del", name)
            removed.append(name)
    return removed


def _routed_networks(*netns: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 destinations of every route (all tables) in a namespace (none given: this one's)."""
    where = ["-n", netns[0]] if netns else []
    networks = []
    for line in _run(_IP, *where, "-4", "-o", "route", "show", "table", "all").splitlines():
        tokens = line.split()
        destination = tokens[1] if tokens[0] in ("local", "broadcast", "unicast", "multicast", "anycast") else tokens[0]
        networks.append(ipaddress.ip_network("0.0.0.0/0" if destination == "default" else destination, strict=False))
    return networks


def _free_subnet(run_id: int) -> ipaddress.IPv4Network:
    """A /24 of the test range that this machine routes nowhere yet."""
    taken = [net for net in _routed_networks() if net.prefixlen > 0]
    subnets = list(TEST_RANGE.subnets(new_prefix=24))
    for offset in range(len(subnets)):
        subnet = subnets[(run_id + offset) % len(subnets)]
        if not any(subnet.overlaps(net) for net in taken):
            return subnet
    raise HostsError(f"every /24 of {TEST_RANGE} is routed on this machine already")


class Hosts:
    """Named hosts (network namespaces) on one bridge; `close()` removes everything it made."""

    def __init__(self, names: Sequence[str], run_id: int | None = None) -> None:
        """Make the hosts (`names`, e.g. "prefill-1": 11 characters at most) and check their isolation;
        HostsError (after removing what was made) if a step fails. `run_id` (default: this process's
        id) names them, so that a run whose process is gone is recognised as stale."""
        if len(set(names)) != len(names) or any(not re.fullmatch(r"[a-z0-9-]{1,11}", n) for n in names):
            raise ValueError(f"names: expected distinct [a-z0-9-]{{1,11}} names, got {list(names)}")
        remove_stale()
        self.run_id = os.getpid() if run_id is None else run_id
        self.tag = f"{PREFIX}{self.run_id}n{next(_made_here)}"
        self.names = list(names)
        self.subnet = _free_subnet(self.run_id)
        hosts = list(self.subnet.hosts())
        self.client_address = str(hosts[0])
        self._addresses = {name: str(hosts[i + 1]) for i, name in enumerate(names)}
        self._switch = f"{self.tag}-switch"
        self._client_link = self.tag
        self._made: list[str] = []
        try:
            self._build()
            self.check_isolated()
        except BaseException:
            self.close()
            raise

    def netns(self, name: str) -> str:
        """The namespace of host `name`."""
        if name not in self._addresses:
            raise KeyError(f"no host {name!r}; hosts: {self.names}")
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        """Host `name`'s IPv4 address."""
        self.netns(name)
        return self._addresses[name]

    def exec_argv(self, name: str) -> list[str]:
        """The prefix that runs a command on host `name` (`ip netns exec` execs it: same process id)."""
        return [_IP, "netns", "exec", self.netns(name)]

    def _port(self, name: str) -> str:
        """Host `name`'s port on the bridge (in the switch namespace)."""
        self.netns(name)
        return f"p-{name}"

    def _build(self) -> None:
        for netns in [self._switch, *(self.netns(name) for name in self.names)]:
            _run(_IP, "netns", "add", netns)
            self._made.append(netns)
            _run(_IP, "netns", "exec", netns, _SYSCTL, "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                 "net.ipv6.conf.default.disable_ipv6=1")
        _run(_IP, "-n", self._switch, "link", "add", _BRIDGE, "type", "bridge")
        _run(_IP, "-n", self._switch, "link", "set", _BRIDGE, "up")
        prefix = self.subnet.prefixlen
        for name in self.names:
            netns, port = self.netns(name), self._port(name)
            _run(_IP, "link", "add", port, "netns", self._switch, "type", "veth", "peer", "name", _HOST_IF,
                 "netns", netns)
            _run(_IP, "-n", self._switch, "link", "set", port, "master", _BRIDGE, "up")
            _run(_IP, "-n", netns, "addr", "add", f"{self._addresses[name]}/{prefix}", "dev", _HOST_IF)
            _run(_IP, "-n", netns, "link", "set", _HOST_IF, "up")
            _run(_IP, "-n", netns, "link", "set", "lo", "up")
        # The client host: this namespace's end of a pair whose other end is a bridge port.
        _run(_IP, "link", "add", self._client_link, "type", "veth", "peer", "name", "p-client", "netns", self._switch)
        _run(_IP, "-n", self._switch, "link", "set", "p-client", "master", _BRIDGE, "up")
        _run(_IP, "addr", "add", f"{self.client_address}/{prefix}", "dev", self._client_link)
        _run(_IP, "link", "set", self._client_link, "up")

    def check_isolated(self) -> None:
        """HostsError unless every host routes only its subnet and loopback (IPv4; IPv6 off) and the
        switch holds no address: the hosts can send nowhere but to each other and the client host."""
        loopback = ipaddress.ip_network("127.0.0.0/8")
        for name in self.names:
            netns = self.netns(name)
            outside = [str(net) for net in _routed_networks(netns)
                       if not (net.subnet_of(self.subnet) or net.subnet_of(loopback))]
            if outside:
                raise HostsError(f"host {name} routes outside {self.subnet}: {outside}")
            if _run(_IP, "-n", netns, "-6", "-o", "route", "show", "table", "all").strip():
                raise HostsError(f"host {name} has IPv6 routes")
        if _run(_IP, "-n", self._switch, "-o", "addr", "show").strip():
            raise HostsError("the switch namespace holds an address")

    def link_down(self, name: str) -> None:
        """Pull host `name`'s cable: its port on the bridge goes down, so everything it sends or is
        sent is dropped without an error (its interface merely loses carrier)."""
        _run(_IP, "-n", self._switch, "link", "set", self._port(name), "down")

    def link_up(self, name: str) -> None:
        """Plug host `name`'s cable back in."""
        _run(_IP, "-n", self._switch, "link", "set", self._port(name), "up")

    def cap(self, name: str, rate: str) -> None:
        """Cap what host `name` sends to `rate` (tc's units: "1gbit", "200mbit") with a token bucket
        (tbf) holding at most 10 ms of it (64 KiB at least, a whole GSO packet); replaces a cap."""
        rate_bytes = rate_bits(rate) // 8
        burst = max(rate_bytes // 100, 64 * 1024)
        _run(_TC, "-n", self.netns(name), "qdisc", "replace", "dev", _HOST_IF, "root", "tbf", "rate", rate,
             "burst", str(burst), "latency", "50ms")

    def uncap(self, name: str) -> None:
        """Remove host `name`'s cap (none: nothing to do)."""
        with contextlib.suppress(HostsError):
            _run(_TC, "-n", self.netns(name), "qdisc", "del", "dev", _HOST_IF, "root")

    def close(self) -> None:
        """Kill what still runs on the hosts and remove the namespaces (the client link goes with the
        switch, which holds its peer). Safe to call twice."""
        for netns in reversed(self._made):
            _delete_netns(netns)
        self._made.clear()
        with contextlib.suppress(HostsError):
            if self._client_link in owned_links():
                _run(_IP, "link", "del", self._client_link)


def rate_bits(rate: str) -> int:
    """tc's rate words in bits per second: "1gbit" -> 10**9, "200mbit" -> 2 * 10**8."""
    match = re.fullmatch(r"(\d+)(kbit|mbit|gbit|bit)", rate)
    if match is None:
        raise ValueError(f"rate: expected e.g. 200mbit or 1gbit, got {rate!r}")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[match.group(2)]
    return int(match.group(1)) * scale
