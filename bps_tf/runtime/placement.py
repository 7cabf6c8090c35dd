"""The shapes of a process's place in a bps_tf job, shared by every source that reads it.

``ClusterConfig`` (what ``bps_tf.runtime.cluster.resolve`` returns), the error it raises, and the
small readers both ``cluster.py`` (DMLC_*, TF_CONFIG) and ``k8s_cluster.py`` (a Kubernetes pod's
variables) use: integer variables with a message that names the fix, the bind address, loopback
tests. No TensorFlow here.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

DEFAULT_BIND_HOST = "0.0.0.0"      # when the job spans hosts other than this one
LOOPBACK_BIND_HOST = "127.0.0.1"   # when every address of the job is a loopback one


class ClusterSpecError(ValueError):
    """The environment does not describe a valid place in a bps_tf job."""


@dataclass
class ClusterConfig:
    role: str
    rank: int = -1                  # worker rank; -1 for other roles
    num_workers: int = 1
    num_servers: int = 0
    scheduler_host: str = ""
    scheduler_port: int = 0
    server_id: int = -1             # -1: the scheduler assigns one
    advertise_host: str = ""        # the host other nodes reach this one at
    port: int = 0                   # the port a server/scheduler binds; 0: the OS picks
    bind_host: str = DEFAULT_BIND_HOST
    host_scheduler: bool = False    # this server also runs the scheduler
    ready_file: str = ""            # where the scheduler host writes its port
    local_rank: int = -1            # -1: the scheduler groups workers by host
    local_size: int = -1
    hostname: str = field(default_factory=socket.gethostname)
    source: str = "none"            # "DMLC", "TF_CONFIG", "Kubernetes" or "none"

    def core_values(self) -> Dict[str, object]:
        """The placement keys the C++ core reads (see docs/contracts.md)."""
        return {
            "role": self.role,
            "rank": self.rank,
            "num_workers": self.num_workers,
            "num_servers": self.num_servers,
            "scheduler_host": self.scheduler_host,
            "scheduler_port": self.scheduler_port,
            "server_id": self.server_id,
            "advertise_host": self.advertise_host,
            "port": self.port,
            "bind_host": self.bind_host,
            "host_scheduler": 1 if self.host_scheduler else 0,
            "ready_file": self.ready_file,
            "local_rank": self.local_rank,
            "local_size": self.local_size,
            "hostname": self.hostname,
            # Where the scheduler's address and the cluster's size come
            # from: the core's waiting lines and errors name them.
            "scheduler_origin": {"TF_CONFIG": "TF_CONFIG's ps task 0",
                                 "Kubernetes": "server 0's pod name (DMLC_PS_ROOT_URI "
                                               "overrides it)"}.get(
                self.source, "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT"),
            "members_origin": {"TF_CONFIG": "TF_CONFIG's cluster (its chief, worker and ps "
                                            "tasks)"}.get(
                self.source, "DMLC_NUM_WORKER/DMLC_NUM_SERVER"),
        }


def int_var(environ: Mapping[str, str], name: str, *, default: Optional[int] = None,
             minimum: Optional[int] = None, maximum: Optional[int] = None,
             fix: str = "") -> int:
    text = environ.get(name, "").strip()
    hint = f"; {fix}" if fix else ""
    if not text:
        if default is None:
            raise ClusterSpecError(f"{name} is not set{hint}")
        return default
    try:
        number = int(text, 10)
    except ValueError:
        raise ClusterSpecError(f"{name}={text!r} is not an integer{hint}") from None
    if minimum is not None and number < minimum or maximum is not None and number > maximum:
        low = "" if minimum is None else str(minimum)
        high = "" if maximum is None else str(maximum)
        span = f"from {low} to {high}" if low and high else (f"at least {low}" if low else f"at most {high}")
        raise ClusterSpecError(f"{name}={text!r} is out of range: it must be {span}{hint}")
    return number


def flag_var(environ: Mapping[str, str], name: str) -> bool:
    text = environ.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ClusterSpecError(f"{name}={environ[name]!r} is not a flag; set it to 0 or 1")


def choose_bind_host(environ: Mapping[str, str], hosts: List[str], own: str = "") -> str:
    """BYTEPS_BIND_HOST, else a loopback address when every address of the
    job is a loopback one (a cluster on one machine is not reachable from
    others): this node's own (e.g. 127.0.0.2) when it is an IPv4 literal,
    else 127.0.0.1; else every address of this host."""
    chosen = strip_brackets(environ.get("BYTEPS_BIND_HOST", "").strip())
    if chosen:
        return chosen
    known = [h for h in hosts if h]
    if known and all(is_loopback(h) for h in known):
        return own if own.count(".") == 3 and is_loopback(own) else LOOPBACK_BIND_HOST
    return DEFAULT_BIND_HOST


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost (names are not resolved otherwise)."""
    import ipaddress
    host = strip_brackets(host.strip()).lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def strip_brackets(host: str) -> str:
    # "[::1]" and "::1" name the same host; keep the bare form, join_host_port re-adds them.
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host
