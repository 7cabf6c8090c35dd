"""bpslaunch's elastic local mode (docs/elastic.md): horovodrun's elastic
options (``--min-np``/``--max-np``, ``-H``, ``--host-discovery-script``,
``--reset-limit``, ``--blacklist-cooldown-range``, ``--elastic-timeout``).

The scheduler runs in a process of its own and the servers beside it
(keeper.py restarts the scheduler in place and replaces lost servers; see
docs/elastic.md, "No single point of failure"); the workers start with
``BYTEPS_ELASTIC=1``,
on the slots of the hosts (hosts.py): every slot the hosts offer, up to
``--max-np``, once they offer at least ``-np``. Each worker gets Horovod's
``HOROVOD_*`` variables as at its start (its host's name, its start rank)
and ``BYTEPS_LAUNCH_ID``, the launcher's name for it, by which the launcher
reports it to the scheduler over an authenticated link (control.py):

- a worker that fails or dies is reported at once, so the others roll back
  within a round trip; with hosts (``-H`` or a script) its host is
  blacklisted and the host's other workers leave with it (Horovod's
  policy); without, this machine's workers are replaced until they failed
  ``--blacklist-after`` times;
- hosts the script no longer lists (or slots it takes away) lose their
  workers: each gets SIGTERM and the scheduler is told; they leave at the
  next commit, without a rollback, with exit code 0;
- slots offered beyond the running workers get new workers, announced to
  the scheduler at once: the running workers hear of them, raise
  HostsUpdatedInterrupt at their next commit, and that reset waits for them.

The job ends when its training finished (a worker exited 0 and the
scheduler ended the job; workers still waiting to join are stopped, which
is no failure), and fails when the scheduler stops it (``--min-np`` or no
server within ``--elastic-timeout``, ``--reset-limit``), when the scheduler
or a server keeps dying right after its start, when every host is
blacklisted, or when every worker is gone.
"""
from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional

from bps_tf.launch.control import SchedulerLink
from bps_tf.launch.environments import horovod_env, place_on_host
from bps_tf.launch.hosts import (DEFAULT_HOST, HostExec, HostPool, Slot, check_cooldown,
                                 local_names, parse_hosts, plan)
from bps_tf.launch.output import plural, say
from bps_tf.launch.procs import LOG, POLL_INTERVAL_S, Child, Job, Stop
from bps_tf.runtime import config

DEFAULT_DISCOVERY_INTERVAL_S = 1.0
DEFAULT_BLACKLIST_AFTER = 3
# Hosts mode without --max-np admits what discovery offers, up to the size
# docs/scaling.md covers (Horovod sets no cap there).
MAX_WORKERS = 1024
LEAVE_TIMEOUT_MIN_S = 30.0   # a removed worker has at least this long to reach a commit
RENDEZVOUS_DEFAULT_S = 120.0


class Worker:
    """A worker process this launcher started, and what became of it."""

    def __init__(self, child: Child, launch_id: str, slot: Slot, newcomer: bool):
        self.child = child
        self.launch_id = launch_id
        self.slot = slot
        self.newcomer = newcomer
        self.removing_since: Optional[float] = None   # asked to leave by this launcher
        self.leaving = False                          # the scheduler says it leaves
        self.left = False                             # ... that it left

    def going(self) -> bool:
        return self.removing_since is not None or self.leaving or self.left


class ElasticLaunch:
    """Starts and supervises the workers of an elastic local job."""

    def __init__(self, job: Job, pool: HostPool, shared: Mapping[str, str], command,
                 *, min_np: int, max_np: int, hosts_mode: bool, blacklist_after: int,
                 elastic_timeout: float, host_exec: HostExec = HostExec()):
        self.job = job
        self.host_exec = host_exec
        self.pool = pool
        self.shared = dict(shared)
        self.command = list(command)
        self.min_np, self.max_np = min_np, max_np
        self.hosts_mode = hosts_mode
        self.blacklist_after = blacklist_after
        self.elastic_timeout = elastic_timeout
        self.leave_timeout = max(elastic_timeout, LEAVE_TIMEOUT_MIN_S)
        self.workers: Dict[int, Worker] = {}     # by pid
        self.link: Optional[SchedulerLink] = None
        self.port = 0
        self.started = 0          # workers started: the next one's label
        self.failures = 0         # plain mode: of this machine's workers
        self.no_new_workers = False
        self.succeeded = 0
        self.finishing = False    # a worker finished: nobody new starts
        self.ended: Optional[float] = None   # the scheduler ended the job (or server 0 left)
        self.members: set = set()
        self.failed = ""
        self.keeper = None   # keeper.Keeper: the scheduler and servers, kept running

    # ---------------------------------------------------------------- start

    def initial_plan(self, num_proc: int, deadline, timeout) -> List[Slot]:
        """Waits until the hosts offer ``num_proc`` slots (at most
        ``--elastic-timeout``), then plans every slot they offer up to --max-np."""
        since = time.monotonic()
        while True:
            self.job.check(deadline, timeout)
            now = time.monotonic()
            self.pool.refresh(now)
            offered = sum(n for _, n in self.pool.available(now))
            if self.pool.answered and offered >= num_proc:
                slots = plan(self.pool.available(now), self.max_np)
                log_start(len(slots), self.min_np, self.max_np, self.pool, self.hosts_mode,
                          self.blacklist_after)
                return slots
            if now - since > self.elastic_timeout:
                say(f"elastic: the hosts offer {offered} slot(s) ({self.pool.describe()}), fewer "
                    f"than -np {num_proc}, after {self.elastic_timeout:g} s (--elastic-timeout)")
                raise Stop(1)
            time.sleep(POLL_INTERVAL_S)

    def start_workers(self, port: int, slots: List[Slot]) -> None:
        self.port = port
        if config.value("BYTEPS_LAUNCHER_REPORTS", self.shared):
            self.link = SchedulerLink(port, self.shared)
        for slot in slots:
            self._start(slot, newcomer=False)

    def reconnect(self) -> None:
        """A new link to a restarted scheduler (the old one's keys were its)."""
        if self.link is not None:
            self.link.close()
        self.link = SchedulerLink(self.port, self.shared)

    def _start(self, slot: Slot, newcomer: bool) -> Worker:
        launch_id = str(self.started)
        self.started += 1
        env = worker_env(self.shared, slot, self.port, launch_id, newcomer, self.elastic_timeout)
        if self.host_exec.remote:
            place_on_host(env, slot.host)
        child = self.job.start(f"worker {launch_id}", "worker",
                               self.host_exec.argv(slot.host, self.command), env)
        worker = Worker(child, launch_id, slot, newcomer)
        self.workers[child.pid] = worker
        return worker

    # ----------------------------------------------------------- supervision

    def supervise(self, deadline, timeout, shutdown_timeout: float) -> int:
        exited: set = set()
        server_left: Optional[float] = None
        workers_done_at: Optional[float] = None
        while True:
            self.job.check(deadline, timeout)
            self._hear()
            now = time.monotonic()
            for child in self.job.newly_exited(exited):
                if self.keeper is not None and self.keeper.owns(child):
                    self.keeper.on_exit(child, self)   # keeper.py: restarted or replaced
                    if self.ended is not None:
                        server_left = server_left or now
                    continue
                if child.kind == "server":
                    if child.returncode != 0:
                        say(f"{child.label()} {child.exit_text()}; an elastic job cannot go on "
                            f"without its servers ({self.failed or 'see its last message'}); "
                            f"stopping the other processes")
                        raise Stop(child.returncode if child.returncode > 0 else 1)
                    server_left = server_left or now
                    self.ended = self.ended or now
                    continue
                self._on_worker_exit(self.workers[child.pid], now)
            live = [w for w in self.workers.values() if w.child.poll() is None]
            if self.ended is not None:
                # Workers that never joined have nothing to finish: not a failure.
                strays = [w for w in live if w.launch_id not in self.members and not w.going()]
                if strays and self.members:
                    LOG.info("the job ended; stopping %s, which never joined",
                             ", ".join(w.child.label() for w in strays))
                    for w in strays:
                        w.removing_since = now
                    self.job.stop([w.child for w in strays])
                    continue
            if not live:
                if not self.succeeded:
                    say("elastic: every worker is gone, and the state they trained with them; "
                        "the job failed (restart it from a checkpoint)")
                    raise Stop(1)
                servers = self.job.running("server")
                if not servers:
                    return 0
                workers_done_at = workers_done_at or now
                if now - workers_done_at >= shutdown_timeout:
                    self.job.stop(servers)
                    return 0
            elif server_left is not None and now - server_left >= shutdown_timeout:
                say(f"a server exited while workers were still running, and they did not finish "
                    f"within {shutdown_timeout:g} s; stopping the other processes")
                raise Stop(1)
            if self.hosts_mode and self.pool.listed_all_blacklisted(now) and \
                    not any(not w.going() for w in live):
                say(f"elastic: every host is blacklisted ({self.pool.describe()}); the job failed")
                raise Stop(1)
            if not self.finishing and self.ended is None:
                self._follow_hosts(now)
            self._expire_leavers(now)
            time.sleep(POLL_INTERVAL_S)

    def _hear(self) -> None:
        if self.link is None:
            return
        by_id = {w.launch_id: w for w in self.workers.values()}
        for msg in self.link.receive(0):
            if "members" in msg and msg["members"]:
                self.members = set(msg["members"].split(","))
                LOG.info("membership epoch %s: workers %s", msg.get("epoch"), msg["members"])
            for key in ("leaving", "left"):
                if msg.get(key) in by_id:
                    setattr(by_id[msg[key]], key, True)
            if "finished" in msg:
                self.ended = self.ended or time.monotonic()
            if msg.get("failed") and not self.failed:
                self.failed = msg["failed"]
                say(f"elastic: the scheduler stopped the job: {self.failed}")

    def _on_worker_exit(self, w: Worker, now: float) -> None:
        code = w.child.returncode
        if w.going():
            LOG.info("%s left the job (%s)", w.child.label(), w.child.exit_text())
            if code != 0 and not w.left:
                self._tell_lost(w, f"it {w.child.exit_text()} before it left")
            return
        if code == 0:
            self.succeeded += 1
            self.finishing = True
            return
        if self.ended is not None:
            LOG.info("%s %s after the job ended", w.child.label(), w.child.exit_text())
            return
        removed: List[Worker] = []
        why = ""
        if self.hosts_mode:
            host = w.slot.host
            self.pool.blacklist(host, now, f"{w.child.label()} {w.child.exit_text()}")
            removed = [o for o in self.workers.values() if o.slot.host == host and
                       o.child.poll() is None and not o.going()]
            why = f"host {host} is blacklisted"
        else:
            self.failures += 1
            if not self.no_new_workers and self.failures >= self.blacklist_after:
                self.no_new_workers = True
                say(f"this machine's workers failed {self.failures} times (--blacklist-after "
                    f"{self.blacklist_after}): no new workers start on it")
        for o in removed:
            o.removing_since = now
        self._tell_lost(w, w.child.exit_text(), removed, why)
        left = [o for o in self.workers.values() if o.child.poll() is None and not o.going()]
        note = f"; {plural(len(removed), 'worker')} of host {w.slot.host} leave" if removed else ""
        say(f"{w.child.label()} {w.child.exit_text()}; elastic: the job goes on with "
            f"{plural(len(left), 'worker')} (--min-np {self.min_np}){note}")
        for o in removed:
            o.child.signal_group(15)

    def _tell_lost(self, w: Worker, why: str, removed=(), removed_why: str = "") -> None:
        if self.link is not None:
            self.link.lost(w.launch_id, f"bpslaunch saw that {w.child.label()} {why}",
                           [o.launch_id for o in removed], removed_why)

    def _follow_hosts(self, now: float) -> None:
        fresh = self.pool.refresh(now)
        wanted = plan(self.pool.available(now), self.max_np)
        places = {(s.host, s.local_rank) for s in wanted}
        live = [w for w in self.workers.values() if w.child.poll() is None and not w.going()]
        if self.hosts_mode:
            gone = [w for w in live if (w.slot.host, w.slot.local_rank) not in places]
            if gone:
                hosts = sorted({w.slot.host for w in gone})
                why = f"host(s) {', '.join(hosts)} no longer offered ({self.pool.describe()})"
                say(f"elastic: {why}: {', '.join(w.child.label() for w in gone)} leave the job "
                    f"at the next commit")
                for w in gone:
                    w.removing_since = now
                    w.child.signal_group(15)
                if self.link is not None:
                    self.link.remove([w.launch_id for w in gone], why)
                live = [w for w in live if w not in gone]
        if not fresh or self.no_new_workers:
            return
        taken = {(w.slot.host, w.slot.local_rank) for w in live}
        new = [self._start(s, newcomer=True) for s in wanted if (s.host, s.local_rank) not in taken]
        if new:
            say(f"elastic: starting {', '.join(w.child.label() for w in new)} on "
                f"{', '.join(sorted({w.slot.host for w in new}))}; they join at the workers' "
                f"next commit")
            if self.link is not None:
                self.link.announce(w.launch_id for w in new)

    def _expire_leavers(self, now: float) -> None:
        for w in self.workers.values():
            if w.removing_since is None or w.child.poll() is not None or w.left:
                continue
            if now - w.removing_since > self.leave_timeout:
                say(f"elastic: {w.child.label()} did not leave within {self.leave_timeout:g} s; "
                    f"killing it")
                self.job.stop([w.child], first_signal=9)
                self._tell_lost(w, f"did not leave within {self.leave_timeout:g} s")


def elastic_env(shared: Mapping[str, str], min_np: int, max_np: int, elastic_timeout: float,
                reset_limit: Optional[int] = None) -> Dict[str, str]:
    env = dict(shared)
    env.update({"BYTEPS_ELASTIC": "1", "BYTEPS_ELASTIC_MIN_WORKERS": str(min_np),
                "BYTEPS_ELASTIC_MAX_WORKERS": str(max_np),
                "BYTEPS_ELASTIC_TIMEOUT": f"{elastic_timeout:g}", "HOROVOD_ELASTIC": "1"})
    if reset_limit is not None:
        env["BYTEPS_ELASTIC_RESET_LIMIT"] = str(reset_limit)
    return env


def worker_env(shared: Mapping[str, str], slot: Slot, scheduler_port: int, launch_id: str,
               newcomer: bool, elastic_timeout: float) -> Dict[str, str]:
    """A worker of an elastic local job: a starting worker has its rank in
    DMLC_WORKER_ID; a newcomer has none yet (the scheduler ranks it after the
    members, by the rank planned for it, its HOROVOD_RANK) and waits to be
    admitted at least as long as a membership change may take."""
    env = dict(shared)
    env.update({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(0 if newcomer else slot.rank),
                "DMLC_PS_ROOT_PORT": str(scheduler_port), "BYTEPS_LAUNCH_ID": launch_id})
    env.update(horovod_env(slot))
    env.pop("BYTEPS_HEALTH_PORT", None)
    if newcomer:
        env["BYTEPS_ELASTIC_NEWCOMER"] = "1"
        own = float(shared.get("BYTEPS_RENDEZVOUS_TIMEOUT") or RENDEZVOUS_DEFAULT_S)
        env["BYTEPS_RENDEZVOUS_TIMEOUT"] = f"{max(elastic_timeout, own):g}"
    return env


def check_options(num_proc: Optional[int], min_np: Optional[int], max_np: Optional[int],
                  hosts_mode: bool = False):
    """(start, min, max) worker counts; ValueError when they cannot hold
    together. With hosts, --max-np defaults to every slot offered (at most 1,024)."""
    start = num_proc if num_proc is not None else (min_np or 1)
    low = min_np if min_np is not None else 1
    high = max_np if max_np is not None else (MAX_WORKERS if hosts_mode else max(start, low))
    if not 1 <= low <= start <= high:
        raise ValueError(f"elastic: need 1 <= --min-np ({low}) <= -np ({start}) <= --max-np "
                         f"({high})")
    return start, low, high


def plain_pool(num_proc: int) -> HostPool:
    """Without -H or a script: this machine, one host of -np slots; a lost
    worker's slot gets a new worker (bps_tf's own policy)."""
    return HostPool({DEFAULT_HOST: num_proc}, None, 1, DEFAULT_DISCOVERY_INTERVAL_S)


def make_launch(job: Job, num_workers: int, command, elastic: Mapping[str, object]) -> ElasticLaunch:
    """The launcher of an elastic job from the command line's options
    (args.elastic_options); ValueError when they are malformed."""
    hosts_mode = bool(elastic.get("hosts") or elastic.get("discovery"))
    cooldown = check_cooldown(elastic.get("cooldown"))
    host_exec = elastic.get("host_exec") or HostExec()
    local = None if host_exec.remote else local_names()
    if elastic.get("hosts"):
        pool = HostPool(parse_hosts(str(elastic["hosts"]), local), None, 1, 1.0, cooldown)
    elif elastic.get("discovery"):
        pool = HostPool(None, str(elastic["discovery"]), int(elastic.get("slots") or 1),
                        float(elastic["discovery_interval"]), cooldown,
                        any_host=local is None)
    else:
        pool = plain_pool(num_workers)
    return ElasticLaunch(job, pool, {}, command, min_np=int(elastic["min_np"]),
                         max_np=int(elastic["max_np"]), hosts_mode=hosts_mode,
                         blacklist_after=int(elastic["blacklist_after"]),
                         elastic_timeout=float(elastic["elastic_timeout"]), host_exec=host_exec)


def log_start(num: int, low: int, high: int, pool: HostPool, hosts_mode: bool,
              blacklist_after: int) -> None:
    if hosts_mode:
        source = f"host discovery {pool.script!r}" if pool.script else "-H"
        policy = (f"hosts {pool.describe()} from {source}; a failed worker's host is "
                  f"blacklisted and its other workers leave")
    else:
        slots = pool.slots.get(DEFAULT_HOST, num)
        policy = (f"lost workers are replaced (up to -np {slots}) until this machine's workers "
                  f"failed {blacklist_after} times (--blacklist-after)")
    say(f"elastic: {plural(num, 'worker')} to start, between {low} and {high}; {policy}")
    LOG.info("elastic job: min %d, max %d", low, high)


__all__: List[str] = ["ElasticLaunch", "elastic_env", "worker_env",
                      "check_options", "plain_pool", "make_launch", "log_start"]
