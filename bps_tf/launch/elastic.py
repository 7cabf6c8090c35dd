"""bpslaunch's elastic local mode (``--min-np``, ``--max-np``,
``--host-discovery-script``, ``--elastic-timeout``; docs/elastic.md).

The servers start as in a fixed job, the workers with ``BYTEPS_ELASTIC=1``.
A worker that dies does not stop the job: the scheduler starts a new
membership epoch with the others. While the job runs, the discovery script
(re-run every ``--discovery-interval`` seconds) says how many worker slots
each host has, as ``host:slots`` lines; on one machine only this machine's
names are hosts (``localhost``, ``127.0.0.1``, its host name) and a slot is
one worker process. When the script offers more slots than workers run (up
to ``--max-np``), new workers start; they join at the next membership epoch
(the running workers admit them at their next commit). A host whose workers
failed ``--blacklist-after`` times gets no new workers. The job ends when
the workers finish (exit 0), and fails when a server dies, when every worker
is gone (the trained state goes with them), or when the scheduler gives up
waiting for ``--min-np`` workers.
"""
from __future__ import annotations

import socket
import subprocess
import time
from typing import Dict, List, Mapping, Optional

from bps_tf.launch.output import plural, say
from bps_tf.launch.procs import LOG, POLL_INTERVAL_S, Job, Stop

DEFAULT_DISCOVERY_INTERVAL_S = 1.0
DEFAULT_BLACKLIST_AFTER = 3
DISCOVERY_TIMEOUT_S = 10.0


def local_names() -> set:
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        names.add(socket.gethostname())
    except OSError:
        pass
    return names


def parse_discovery(text: str, local: set) -> Dict[str, int]:
    """{host: slots} from the script's ``host:slots`` (or ``host``, 1 slot)
    lines. Raises ValueError naming a malformed line or a host that is not
    this machine (a local launcher starts processes here only)."""
    hosts: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        host, _, slots = line.partition(":")
        host = host.strip()
        try:
            count = int(slots) if slots.strip() else 1
        except ValueError:
            raise ValueError(f"line {number} {raw!r}: expected host:slots") from None
        if count < 0:
            raise ValueError(f"line {number} {raw!r}: slots must not be negative")
        if host not in local:
            raise ValueError(f"line {number} {raw!r}: host {host!r} is not this machine; "
                             f"a local bpslaunch starts workers on "
                             f"{', '.join(sorted(local))} only")
        hosts[host] = hosts.get(host, 0) + count
    return hosts


class Discovery:
    """Runs the host discovery script and reports the slots it offers."""

    def __init__(self, script: Optional[str], fixed_slots: int, interval_s: float):
        self.script = script
        self.fixed_slots = fixed_slots
        self.interval_s = interval_s
        self.last_run = float("-inf")
        self.slots = fixed_slots
        self.local = local_names()
        self._complained = ""

    def poll(self, now: float) -> Optional[int]:
        """Slots on this machine when the script ran now; None between runs
        (a worker that just died must not be replaced from an old answer)."""
        if self.script is None:
            return self.slots
        if now - self.last_run < self.interval_s:
            return None
        self.last_run = now
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=DISCOVERY_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise ValueError(f"it exited with code {done.returncode}: "
                                 f"{done.stderr.strip()[:200]}")
            self.slots = sum(parse_discovery(done.stdout, self.local).values())
            self._complained = ""
        except (ValueError, subprocess.TimeoutExpired, OSError) as exc:
            why = f"host discovery script {self.script!r}: {exc}; keeping {self.slots} slot(s)"
            if why != self._complained:
                say(why)
                self._complained = why
        return self.slots


def supervise_elastic(job: Job, start_worker, *, min_np: int, max_np: int,
                      discovery: Discovery, blacklist_after: int,
                      deadline: Optional[float], timeout: Optional[float],
                      shutdown_timeout: float) -> int:
    """Watches an elastic job until it ends; ``start_worker(newcomer)`` starts one worker."""
    exited: set = set()
    failures = 0            # of this machine's workers (the one host of a local job)
    blacklisted = False
    finishing = False       # a worker finished: the job is ending, nobody new starts
    succeeded = 0
    workers_done_at: Optional[float] = None
    server_left: Optional[float] = None   # a server exited 0: the job is ending
    while True:
        job.check(deadline, timeout)
        now = time.monotonic()
        for child in job.newly_exited(exited):
            if child.kind == "server":
                if child.returncode != 0:
                    say(f"{child.label()} {child.exit_text()}; an elastic job cannot go on "
                        f"without its servers (see its last message); stopping the other "
                        f"processes")
                    raise Stop(child.returncode if child.returncode > 0 else 1)
                server_left = server_left or now
                finishing = True
                continue
            if child.returncode == 0:
                succeeded += 1
                finishing = True
                continue
            failures += 1
            left = len(job.running("worker"))
            say(f"{child.label()} {child.exit_text()}; elastic: the job goes on with "
                f"{plural(left, 'worker')} (--min-np {min_np})")
            if not blacklisted and failures >= blacklist_after:
                blacklisted = True
                say(f"this host's workers failed {failures} times (--blacklist-after "
                    f"{blacklist_after}): it is blacklisted, no new workers start on it")
        workers = job.running("worker")
        if workers and server_left is not None and now - server_left >= shutdown_timeout:
            say(f"a server exited while workers were still running, and they did not finish "
                f"within {shutdown_timeout:g} s; stopping the other processes")
            raise Stop(1)
        if not workers:
            if succeeded:
                servers = job.running("server")
                if not servers:
                    return 0
                workers_done_at = workers_done_at or now
                if now - workers_done_at >= shutdown_timeout:
                    job.stop(servers)
                    return 0
            else:
                # Only the workers hold the trained state (the servers keep nothing
                # across epochs): newcomers would start from scratch, silently.
                say("elastic: every worker is gone, and the state they trained with them; "
                    "the job failed (restart it from a checkpoint)")
                raise Stop(1)
        if not finishing and not blacklisted:
            slots = discovery.poll(now)
            for _ in range(max(0, min(slots or 0, max_np) - len(workers))):
                start_worker(True)
        time.sleep(POLL_INTERVAL_S)


def elastic_env(shared: Mapping[str, str], min_np: int, max_np: int,
                elastic_timeout: float) -> Dict[str, str]:
    env = dict(shared)
    env.update({"BYTEPS_ELASTIC": "1", "BYTEPS_ELASTIC_MIN_WORKERS": str(min_np),
                "BYTEPS_ELASTIC_MAX_WORKERS": str(max_np),
                "BYTEPS_ELASTIC_TIMEOUT": f"{elastic_timeout:g}"})
    return env


def worker_env(shared: Mapping[str, str], rank: int, scheduler_port: int, newcomer: bool,
               elastic_timeout: float) -> Dict[str, str]:
    """A worker of an elastic local job. Its rank changes with the membership
    (bps_tf.rank()), so no HOROVOD_RANK-style variable is set; a newcomer has
    no rank until the scheduler admits it, and waits up to --elastic-timeout."""
    env = dict(shared)
    env.update({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(0 if newcomer else rank),
                "DMLC_PS_ROOT_PORT": str(scheduler_port)})
    env.pop("BYTEPS_HEALTH_PORT", None)
    if newcomer:
        env["BYTEPS_ELASTIC_NEWCOMER"] = "1"
        env["BYTEPS_RENDEZVOUS_TIMEOUT"] = f"{max(elastic_timeout, 1.0):g}"
    return env


def check_options(num_proc: Optional[int], min_np: Optional[int], max_np: Optional[int]):
    """(start, min, max) worker counts; ValueError when they cannot hold together."""
    start = num_proc if num_proc is not None else (min_np or 1)
    low = min_np if min_np is not None else 1
    high = max_np if max_np is not None else max(start, low)
    if not 1 <= low <= start <= high:
        raise ValueError(f"elastic: need 1 <= --min-np ({low}) <= -np ({start}) <= --max-np "
                         f"({high})")
    return start, low, high


def log_start(num: int, low: int, high: int, script: Optional[str]) -> None:
    where = f"host discovery {script!r}" if script else "no discovery script: lost workers are not replaced"
    say(f"elastic: {plural(num, 'worker')} to start, between {low} and {high}; {where}")
    LOG.info("elastic job: min %d, max %d", low, high)


__all__: List[str] = ["Discovery", "supervise_elastic", "elastic_env", "worker_env",
                      "check_options", "parse_discovery", "log_start"]
