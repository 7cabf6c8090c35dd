"""Bandwidth-limited "hosts" on one machine: network namespaces on a bridge.

    with NetnsHosts(8, rate="1gbit") as net:
        net.hosts[0].prefix   # ("ip", "netns", "exec", "bpsbench-<pid>-h0")
        net.hosts[0].ip       # "10.99.0.1"

Layout: namespace ``<tag>-sw`` holds a bridge; every host namespace
``<tag>-h<i>`` has one veth (eth0, 10.99.0.<i+1>/24) whose peer is a port of
the bridge. A token bucket (tc tbf) on *both* ends of each veth caps what a
host can send (its eth0) and what it can receive (the bridge port towards
it) at ``rate``, like a full-duplex NIC. Nothing is created outside these
namespaces (the bridge lives in its own namespace, not the caller's), and
the addresses exist only inside them.

Everything is removed on exit, also on Ctrl-C/SIGTERM (with
common.stop_on_signals); namespaces left by a run that was SIGKILLed are
removed by the next run (their tag holds the dead process's pid).

Needs root or CAP_NET_ADMIN, iproute2 (`ip`, `tc`) and the tbf qdisc.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import List, Optional

from benchmarks.common import Host, parse_rate

TAG_PREFIX = "bpsbench-"
SUBNET = "10.99.0"


class NetnsUnavailable(RuntimeError):
    pass


def require_netns_privileges() -> None:
    """Raises NetnsUnavailable with the fix when namespaces cannot be made."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found: install iproute2")
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "network namespaces and tc need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run this "
            "benchmark as root, e.g. `sudo -E env PATH=$PATH python benchmarks/netns_cluster.py`")


def _run(argv: List[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> List[str]:
    """Deletes namespaces of earlier runs whose process is gone."""
    listing = _run(["ip", "netns", "list"], check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(TAG_PREFIX) + r"(\d+)-\w+", name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


class NetnsHosts:
    def __init__(self, count: int, rate: Optional[str] = None, mtu: int = 1500,
                 latency: str = "5ms", host_nic: str = "tbf"):
        """``latency``: the queue of each switch port (tbf ``latency``).
        ``host_nic``: how a host's own egress is modelled. "tbf": the same
        short drop-tail queue as a switch port (the earlier results): a
        host then drops its own packets when TCP sends a burst, which no
        NIC does. "paced": a 25 ms queue and TCP Small Queues capped at
        64 KB per socket in each host, so a sender is held back in its
        socket, as by a NIC at the link rate, instead of losing packets."""
        if host_nic not in ("tbf", "paced"):
            raise ValueError(f"host_nic: 'tbf' or 'paced', not {host_nic!r}")
        self.host_nic = host_nic
        if not 1 <= count <= 200:
            raise ValueError("between 1 and 200 hosts")
        self.count = count
        self.tag = f"{TAG_PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(count)]
        self.mtu = mtu
        self.latency = latency
        self.host_latency = "25ms" if host_nic == "paced" else latency
        self.rate: Optional[str] = None
        self._initial_rate = rate
        self._created: List[str] = []
        self.switch_prefix = ("ip", "netns", "exec", self.switch)
        self.ports = [f"p{i}" for i in range(count)]   # bridge port towards host i
        self.hosts = [Host(ip=f"{SUBNET}.{i + 1}", prefix=("ip", "netns", "exec", n), name=n)
                      for i, n in enumerate(self.names)]

    # -- life cycle ------------------------------------------------------
    def __enter__(self) -> "NetnsHosts":
        require_netns_privileges()
        remove_stale_namespaces()
        try:
            self._create()
            if self._initial_rate:
                self.set_rate(self._initial_rate)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _ns(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        self._add_ns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        # Bridged frames would otherwise pass through iptables (per namespace
        # since Linux 5.3): CPU that a real switch does not cost the hosts.
        _run(["ip", "netns", "exec", self.switch, "sysctl", "-qw",
              "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0",
              "net.bridge.bridge-nf-call-arptables=0"], check=False)
        for i, name in enumerate(self.names):
            self._add_ns(name)
            port = f"p{i}"
            _run(["ip", "link", "add", "eth0", "netns", name, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", port, "netns", self.switch, "mtu", str(self.mtu)])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            _run(["ip", "-n", name, "addr", "add", f"{self.hosts[i].ip}/24", "dev", "eth0"])
            _run(["ip", "-n", name, "link", "set", "eth0", "up"])
            if self.host_nic == "paced":
                _run(["ip", "netns", "exec", name, "sysctl", "-qw",
                      "net.ipv4.tcp_limit_output_bytes=65536"])

    def remove(self) -> None:
        """Deletes every namespace this object created (their veths go too)."""
        for name in reversed(self._created):
            _run(["ip", "netns", "del", name], check=False)
        self._created.clear()

    # -- shaping -----------------------------------------------------------
    def set_rate(self, rate: Optional[str]) -> None:
        """Caps every host's upload and download at ``rate`` (None: no cap)."""
        for i, name in enumerate(self.names):
            for ns, dev, latency in ((name, "eth0", self.host_latency),
                                     (self.switch, f"p{i}", self.latency)):
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                     check=False)
                if rate:
                    self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                             "burst", str(self._burst_bytes(rate)), "latency", latency)
        self.rate = rate

    def _burst_bytes(self, rate: str) -> int:
        # At least one 64 KiB GSO super-packet plus headers, else tbf must
        # split them; about 2 ms of traffic at high rates.
        return max(128 << 10, int(parse_rate(rate) * 0.002))

    def describe(self) -> str:
        return (f"{self.count} namespaces on a bridge, veth mtu {self.mtu}, "
                f"tbf rate {self.rate or 'unlimited'} each way per host "
                f"(queue: switch ports {self.latency}, hosts {self.host_latency}, "
                f"host nic model {self.host_nic})")
