"""The hosts of an elastic local job, as horovodrun keeps them (docs/elastic.md).

Hosts come from ``-H host:slots,...`` (fixed) or a host discovery script
(``host:slots`` lines, run again every ``--discovery-interval`` seconds).
Each listed name is a host of its own, even two names of this machine
(``localhost`` and ``127.0.0.1``): a local launcher starts every host's
workers here, and a host's slots are worker processes. With ``--host-exec``
the hosts are other machines (or network namespaces), and each worker is
started on its host through that command prefix (HostExec). Hosts are kept in
the order they first appeared; ranks are planned over them in that order,
each host's slots in turn, up to ``--max-np`` (Horovod's assignment), so
the oldest hosts hold the lowest ranks.

A host whose worker failed is blacklisted: it gets no new workers, and its
other workers leave the job. With ``--blacklist-cooldown-range MIN MAX`` it
comes back after a cooldown that doubles with each blacklisting (plus up to
MIN at random), kept within MIN and MAX seconds; without it, never.

No TensorFlow here.
"""
from __future__ import annotations

import random
import shlex
import socket
import subprocess
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from bps_tf.launch.output import say

DISCOVERY_TIMEOUT_S = 10.0
COOLDOWN_BOUNDS_S = (1, 3600)    # what --blacklist-cooldown-range may ask (Horovod's)
# The name of the one host of an elastic job started without -H or a script.
DEFAULT_HOST = "localhost"


def local_names() -> set:
    """This machine's names: every loopback address, localhost, its host name."""
    names = {"localhost", "::1", "ip6-localhost"}
    try:
        names.add(socket.gethostname())
    except OSError:
        pass
    return names


def is_local(host: str, local: set) -> bool:
    if host in local:
        return True
    parts = host.split(".")
    return len(parts) == 4 and parts[0] == "127" and all(p.isdigit() and int(p) < 256 for p in parts)


def parse_hosts(text: str, local: Optional[set], default_slots: int = 1,
                where: str = "-H") -> Dict[str, int]:
    """{host: slots}, in order, from ``host:slots`` items (lines of a discovery
    script, or -H's comma-separated list); ``host`` alone has
    ``default_slots``. Raises ValueError naming a malformed item or a host
    that is not this machine (``local``'s names; None: any host, --host-exec)."""
    hosts: Dict[str, int] = {}
    items = text.replace(",", "\n").splitlines()
    for number, raw in enumerate(items, 1):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        host, sep, slots = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        host = host.strip()
        try:
            count = int(slots) if sep else default_slots
        except ValueError:
            raise ValueError(f"{where} item {number} {raw!r}: expected host:slots") from None
        if count < 0:
            raise ValueError(f"{where} item {number} {raw!r}: slots must not be negative")
        if not host:
            raise ValueError(f"{where} item {number} {raw!r}: no host name")
        if local is not None and not is_local(host, local):
            raise ValueError(f"{where} item {number} {raw!r}: host {host!r} is not this machine; "
                             f"without --host-exec bpslaunch starts workers here only (its "
                             f"names: {', '.join(sorted(local))}, 127.x.y.z)")
        hosts[host] = hosts.get(host, 0) + count
    return hosts


class Slot(NamedTuple):
    """A planned worker: its host, its index there, and Horovod's numbers."""
    host: str
    local_rank: int
    rank: int
    size: int
    local_size: int
    cross_rank: int
    cross_size: int


def plan(hosts: Sequence[Tuple[str, int]], max_np: int) -> List[Slot]:
    """Ranks over the hosts in order, each host's slots in turn, up to
    ``max_np`` (Horovod's host assignment)."""
    taken: List[Tuple[str, int]] = []
    for host, slots in hosts:
        for local in range(slots):
            if len(taken) == max_np:
                break
            taken.append((host, local))
    size = len(taken)
    per_host: Dict[str, int] = {}
    for host, _ in taken:
        per_host[host] = per_host.get(host, 0) + 1
    # cross rank: this host among the hosts that have a worker of this local rank
    at_local: Dict[int, List[str]] = {}
    for host, local in taken:
        at_local.setdefault(local, []).append(host)
    return [Slot(host, local, rank, size, per_host[host], at_local[local].index(host),
                 len(at_local[local])) for rank, (host, local) in enumerate(taken)]


def fixed_slots(num_workers: int, hosts: Optional[str], any_host: bool = False) -> List[Slot]:
    """A fixed job's workers on -H's hosts (this machine's names, or any with
    --host-exec), or on localhost. ValueError when -H is malformed or offers
    too few slots."""
    if not hosts:
        return plan([(DEFAULT_HOST, num_workers)], num_workers)
    slots = plan(list(parse_hosts(hosts, None if any_host else local_names()).items()),
                 num_workers)
    if len(slots) < num_workers:
        raise ValueError(f"-np {num_workers}, but -H {hosts} offers {len(slots)} slot(s)")
    return slots


class _HostState:
    def __init__(self):
        self.blacklisted = False
        self.count = 0
        self.until = 0.0     # end of the cooldown; 0: none (blacklisted for good)


class HostPool:
    """The hosts on offer: fixed, or from the discovery script; blacklisting."""

    def __init__(self, fixed: Optional[Dict[str, int]], script: Optional[str],
                 default_slots: int, interval_s: float,
                 cooldown: Optional[Tuple[float, float]] = None, any_host: bool = False):
        self.script = script
        self.default_slots = default_slots
        self.interval_s = interval_s
        self.cooldown = cooldown
        self.local = None if any_host else local_names()
        self.slots: Dict[str, int] = dict(fixed or {})
        self.order: List[str] = list(self.slots)
        self.state: Dict[str, _HostState] = {}
        self.last_run = float("-inf")
        self.answered = script is None    # the script answered at least once
        self._complained = ""

    def refresh(self, now: float) -> bool:
        """Runs the discovery script when due; True when it ran (a fresh
        answer: a worker that just died is replaced only from one)."""
        if self.script is None or now - self.last_run < self.interval_s:
            return self.script is None
        self.last_run = now
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=DISCOVERY_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise ValueError(f"it exited with code {done.returncode}: "
                                 f"{done.stderr.strip()[:200]}")
            found = parse_hosts(done.stdout, self.local, self.default_slots, "discovery line")
        except (ValueError, subprocess.TimeoutExpired, OSError) as exc:
            why = (f"host discovery script {self.script!r}: {exc}; keeping the last answer "
                   f"({self.describe()})")
            if why != self._complained:
                say(why)
                self._complained = why
            return False
        self._complained = ""
        self.answered = True
        self.slots = found
        self.order = [h for h in self.order if h in found] + [h for h in found if h not in self.order]
        return True

    def blacklisted(self, host: str, now: float) -> bool:
        st = self.state.get(host)
        if st is None or not st.blacklisted:
            return False
        if st.until and now >= st.until:
            st.blacklisted = False      # the cooldown is over: the host is back
            say(f"elastic: host {host}'s blacklist cooldown is over; it takes workers again")
            return False
        return True

    def blacklist(self, host: str, now: float, why: str) -> None:
        st = self.state.setdefault(host, _HostState())
        if st.blacklisted:
            return
        st.blacklisted = True
        st.count += 1
        until = ""
        if self.cooldown:
            low, high = self.cooldown
            delay = low * (1 << st.count) + random.uniform(0, 1) * low
            st.until = now + max(low, min(high, delay))
            until = f" for {st.until - now:.1f} s (--blacklist-cooldown-range {low:g} {high:g})"
        say(f"elastic: host {host} is blacklisted{until}: {why}")

    def available(self, now: float) -> List[Tuple[str, int]]:
        """(host, slots) that may run workers, in order."""
        return [(h, self.slots[h]) for h in self.order
                if self.slots.get(h, 0) > 0 and not self.blacklisted(h, now)]

    def listed_all_blacklisted(self, now: float) -> bool:
        listed = [h for h in self.order if self.slots.get(h, 0) > 0]
        return bool(listed) and all(self.blacklisted(h, now) for h in listed)

    def describe(self) -> str:
        return ", ".join(f"{h}:{self.slots[h]}" for h in self.order) or "no hosts"


class HostExec(NamedTuple):
    """--host-exec and --address: each worker runs on its host through a
    command prefix (``{host}`` in it names the host); the scheduler and the
    servers stay on this machine and listen on ``address``, which the hosts
    reach. Empty: every host is a name of this machine."""
    template: str = ""
    address: str = ""

    @property
    def remote(self) -> bool:
        return bool(self.template)

    def argv(self, host: str, command: Sequence[str]) -> List[str]:
        if not self.remote:
            return list(command)
        return [part.replace("{host}", host) for part in shlex.split(self.template)] + \
            list(command)


def check_host_exec(template: Optional[str], address: Optional[str]) -> HostExec:
    """The checked pair; ValueError saying what is missing or malformed."""
    if not template:
        if address:
            raise ValueError("--address applies with --host-exec only: without it every "
                             "process runs on this machine, at 127.0.0.1")
        return HostExec()
    try:
        parts = shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"--host-exec {template!r}: {exc}") from None
    if not any("{host}" in p for p in parts):
        raise ValueError(f"--host-exec {template!r} does not name the host: put {{host}} where "
                         f"it goes, e.g. 'ip netns exec ns-{{host}}'")
    if not address:
        raise ValueError("--host-exec needs --address ADDR: this machine's address that the "
                         "workers' hosts reach (the scheduler and the servers listen on it)")
    return HostExec(template, address)


def check_cooldown(pair: Optional[Sequence[float]]) -> Optional[Tuple[float, float]]:
    if pair is None:
        return None
    low, high = float(pair[0]), float(pair[1])
    if not COOLDOWN_BOUNDS_S[0] <= low <= high <= COOLDOWN_BOUNDS_S[1]:
        raise ValueError(f"--blacklist-cooldown-range {low:g} {high:g}: need "
                         f"{COOLDOWN_BOUNDS_S[0]} <= MIN <= MAX <= {COOLDOWN_BOUNDS_S[1]} seconds")
    return low, high
