"""The scheduler and the servers of an elastic local job, kept running
(docs/elastic.md, "No single point of failure").

In an elastic job bpslaunch runs the scheduler in a process of its own (a
fixed job keeps it inside server 0) and keeps ``--servers`` servers:

- the scheduler killed (any signal): started again at once on its port;
  the workers and servers re-register with it and the job goes on from the
  workers' last commit. An exit code is the scheduler's own verdict: 0 the
  job finished, anything else it failed (its message says why);
- a server that ends while the job runs is replaced by a new process with
  the same id, which joins at the workers' next commit; one that failed is
  reported to the scheduler at once (the workers roll back without waiting
  for BYTEPS_TIMEOUT). A server that left on SIGTERM (exit 0) is replaced
  too: bpslaunch keeps the number of servers asked for.

A process that keeps dying right after its start (KEEP_TRIES times within
KEEP_WINDOW_S of its start, in a row) stops the job: a replacement would
fail the same way.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Mapping, Optional

from bps_tf.launch.output import say
from bps_tf.launch.procs import Child, Job, Stop

KEEP_TRIES = 3
KEEP_WINDOW_S = 10.0

ServerEnv = Callable[..., Dict[str, str]]


def scheduler_env(shared: Mapping[str, str], port: int, ready_file: str) -> Dict[str, str]:
    env = dict(shared)
    env.update({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": str(port),
                "BYTEPS_READY_FILE": ready_file, "BYTEPS_LAUNCH_ID": "scheduler"})
    for name in ("BYTEPS_HEALTH_PORT", "BYTEPS_SERVER_ID", "BYTEPS_HOST_SCHEDULER"):
        env.pop(name, None)
    return env


class Keeper:
    """Starts the scheduler and the servers, and keeps them (see the module's text).

    ``server_env(shared, server_id, port, health_port=...)`` and ``argv(env)``
    are the launcher's; ``wait_port(child, ready_file)`` waits for the
    scheduler to report its port."""

    def __init__(self, job: Job, shared: Mapping[str, str], num_servers: int, ready_file: str,
                 server_env: ServerEnv, argv: Callable[[Dict[str, str]], list], health: int,
                 wait_port: Callable[[Child, str], int]):
        self.job = job
        self.shared = dict(shared)
        self.num_servers = num_servers
        self.ready_file = ready_file
        self.server_env = server_env
        self.argv = argv
        self.health = health
        self.wait_port = wait_port
        self.port = 0
        self.scheduler: Optional[Child] = None
        self.servers: Dict[int, Child] = {}       # pid -> child
        self.ids: Dict[int, int] = {}             # pid -> server id
        self.quick_deaths: Dict[str, int] = {}    # "scheduler" / "server <id>" -> in a row
        self.restarts = 0

    def start(self) -> int:
        """The scheduler (its port, once it reports it), then the servers."""
        self._start_scheduler()
        self.port = self.wait_port(self.scheduler, self.ready_file)
        for server_id in range(self.num_servers):
            self._start_server(server_id)
        return self.port

    def _start_scheduler(self) -> None:
        env = scheduler_env(self.shared, self.port, self.ready_file)
        self.scheduler = self.job.start("scheduler", "server", self.argv(env), env)

    def _start_server(self, server_id: int) -> Child:
        env = self.server_env(self.shared, server_id, self.port, health_port=self.health)
        env["BYTEPS_LAUNCH_ID"] = f"server {server_id}"
        child = self.job.start(f"server {server_id}", "server", self.argv(env), env)
        self.servers[child.pid] = child
        self.ids[child.pid] = server_id
        return child

    def owns(self, child: Child) -> bool:
        return child is self.scheduler or child.pid in self.servers

    def on_exit(self, child: Child, launch) -> None:
        """A scheduler or server process ended; ``launch`` is the
        ElasticLaunch (its link, whether the job ended or fails)."""
        if child is self.scheduler:
            return self._scheduler_ended(child, launch)
        server_id = self.ids.pop(child.pid)
        self.servers.pop(child.pid, None)
        if launch.ended is not None or launch.finishing or launch.failed:
            if child.returncode != 0 and launch.failed:
                raise Stop(child.returncode if child.returncode > 0 else 1)
            return   # the job ends: servers leave with it
        left = child.returncode == 0
        if not left and launch.link is not None:
            launch.link.lost(f"server {server_id}", f"bpslaunch saw that {child.label()} "
                                                    f"{child.exit_text()}")
        self._count_quick_death(f"server {server_id}", child, left)
        what = "left the job (SIGTERM)" if left else child.exit_text()
        new = self._start_server(server_id)
        say(f"{child.label()} {what}; elastic: {new.label()} replaces it and joins at the "
            f"workers' next commit")

    def _scheduler_ended(self, child: Child, launch) -> None:
        code = child.returncode
        if code == 0:
            launch.ended = launch.ended or time.monotonic()
            return
        if code > 0 or launch.ended is not None:
            if launch.ended is None:
                say(f"{child.label()} {child.exit_text()}: the scheduler stopped the job "
                    f"({launch.failed or 'see its last message'}); stopping the other processes")
                raise Stop(code if code > 0 else 1)
            return
        # Killed: the nodes keep the job's state; a new scheduler at the same
        # address takes their reports (scheduler_recover.cc).
        self._count_quick_death("scheduler", child, False)
        self.restarts += 1
        try:
            os.remove(self.ready_file)
        except OSError:
            pass
        self._start_scheduler()
        say(f"{child.label()} {child.exit_text()}; elastic: {self.scheduler.label()} starts on "
            f"port {self.port}, the workers and servers re-register and go on from their last "
            f"commit")
        if launch.link is not None:
            launch.reconnect()

    def _count_quick_death(self, what: str, child: Child, left: bool) -> None:
        lived = (child.ended_at or time.monotonic()) - child.started_at
        if left or lived > KEEP_WINDOW_S:
            self.quick_deaths[what] = 0
            return
        self.quick_deaths[what] = self.quick_deaths.get(what, 0) + 1
        if self.quick_deaths[what] >= KEEP_TRIES:
            say(f"elastic: the {what} ended {KEEP_TRIES} times within {KEEP_WINDOW_S:g} s of its "
                f"start ({child.label()} {child.exit_text()}); a replacement would fail the same "
                f"way: stopping the job")
            raise Stop(1)


__all__ = ["Keeper", "scheduler_env", "KEEP_TRIES", "KEEP_WINDOW_S"]
