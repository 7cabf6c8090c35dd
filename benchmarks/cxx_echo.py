"""The C++ raw-TCP bound (benchmarks/echo/ps_echo.cc): built with g++ at first
use into a cache folder keyed by the source's hash, then run like the Python
echo (benchmarks/workers/tcp_echo.py), which it replaces as the bound: one
Python thread pair per connection cannot keep up with bps_tf's C++ engine.

    path = cxx_echo.build()
    results = cxx_echo.run_job(procs, cases, num_clients=2, num_servers=2)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Mapping, Sequence

from benchmarks import common
from benchmarks.common import LOCALHOST, Host, JobFailed, Processes

SOURCE = common.BENCH_DIR / "echo" / "ps_echo.cc"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bps_tf" / "bench"


def build() -> Path:
    """The compiled tool (compiled now if this source was never built)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    binary = cache_dir() / f"ps_echo-{digest}"
    if binary.exists():
        return binary
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise JobFailed("the C++ echo bound needs g++ (or CXX=...): none found on PATH")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    proc = subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise JobFailed(f"compiling {SOURCE} failed:\n{proc.stderr}")
    tmp.replace(binary)
    return binary


def run_job(procs: Processes, cases: Sequence[Mapping], *, num_clients: int, num_servers: int,
            client_hosts: Sequence[Host] = (), server_hosts: Sequence[Host] = (),
            timeout: float = 1800.0, unix: bool = False) -> List[dict]:
    """Echo servers on the server hosts, clients on the worker hosts; returns
    the clients' results (same layout as common.run_echo_job's). `unix`:
    over abstract Unix sockets (one machine only), the bound of bps_tf's
    links between a worker and a server of one machine (BYTEPS_ENABLE_IPC)."""
    binary = str(build())
    client_hosts = list(client_hosts) or [LOCALHOST] * num_clients
    server_hosts = list(server_hosts) or [LOCALHOST] * num_servers
    if unix and any(h is not LOCALHOST for h in client_hosts + server_hosts):
        raise JobFailed("the Unix-socket echo runs on one machine only")
    env = common.child_env()
    addresses = []
    for i in range(num_servers):
        port_file = procs.log_dir / f"cxx_echo_server{i}.port"
        where = "unix" if unix else server_hosts[i].ip
        procs.start(f"cxx_echo_server{i}", [binary, "server", where, str(port_file)],
                    env, server_hosts[i].prefix, must_succeed=False)
        written = common.wait_for_file(procs, port_file)  # a port, or "unix:NAME"
        addresses.append(written if unix else f"{server_hosts[i].ip}:{written}")
    barrier_dir = procs.log_dir / "cxx_barrier"
    barrier_dir.mkdir(exist_ok=True)
    spec = ",".join(f"{c['label']}:{c['bytes']}:{c['warmup']}:{c['reps']}" for c in cases)
    clients = [procs.start(f"cxx_echo_client{r}",
                           [binary, "client", str(r), str(num_clients), str(barrier_dir),
                            str(procs.log_dir / f"echo{r}.json"), ",".join(addresses), spec],
                           env, client_hosts[r].prefix) for r in range(num_clients)]
    procs.wait(clients, timeout)
    return common.read_results(procs.log_dir, num_clients, "echo")
