"""The processes bpslaunch starts, and the one way to stop them.

Each child leads its own process group (so its own children are reached too);
stopping sends the group SIGTERM, then SIGKILL after a grace period; Linux is
asked to SIGTERM a child whose launcher dies. No TensorFlow here.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator, List, Mapping, Optional, Sequence

from bps_tf.launch.output import ChildOutput, ErrorWatch, say

LOG = logging.getLogger("bps_tf.launch.launcher")

POLL_INTERVAL_S = 0.05
EXIT_TIMEOUT = 124                 # what timeout(1) uses
EXIT_CANNOT_START = 127            # what a shell uses for "command not found"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long the verdict waits for an exited child's last lines (they may name
# the process whose failure ended it).
VERDICT_DRAIN_S = 1.0
# How bps_tf's messages name a process: "worker 1 (host h, pid 123)".
_NAMED_PROCESS = re.compile(r"\(host [^,()]*, pid (\d+)\)")


def ensure_open_files(needed: int, what: str, error=ValueError) -> None:
    """Let this process hold ``needed`` open files: raise the soft limit up to
    the hard one when it is lower (children inherit it); ``error`` with both
    numbers and the way out when even the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise error(f"{what} needs about {needed} open files, but this process may open "
                         f"at most {hard} (hard RLIMIT_NOFILE): raise it (ulimit -Hn {needed} "
                         f"as root) or start fewer processes")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Stop(Exception):
    """The job must end now with this exit code; the reason was already printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------ children

class Child:
    """One process the launcher started, the leader of its own process group."""

    def __init__(self, name: str, kind: str, popen: subprocess.Popen):
        self.name = name          # "worker 1", "server 0"
        self.kind = kind          # "worker" or "server"
        self.popen = popen
        self.pid = popen.pid      # == its process group id (start_new_session)
        self.started_at = time.monotonic()
        self.ended_at: Optional[float] = None
        self.errors = ErrorWatch()   # fed from its output when the launcher reads it

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.returncode

    def poll(self) -> Optional[int]:
        code = self.popen.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    def exit_text(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            return f"was killed by signal {signal_name(-code)}"
        return f"exited with code {code}"

    def summary(self) -> str:
        """``worker 0 exit 0 (3.1 s)`` or ``worker 1 SIGTERM (2.0 s)`` for the end line."""
        code = self.poll()
        if code is None:
            return f"{self.name} still running"
        how = f"exit {code}" if code >= 0 else signal_name(-code)
        return f"{self.name} {how} ({self.ended_at - self.started_at:.1f} s)"

    def label(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def failed_at(self) -> Optional[float]:
        """When it first showed that it failed: an error in its output, or a
        non-zero exit; None while it shows neither."""
        times = [t for t in (self.errors.failed_at,
                             self.ended_at if self.returncode not in (None, 0) else None)
                 if t is not None]
        return min(times) if times else None

    def group_alive(self, live_groups: Optional[set]) -> bool:
        """Whether anything in the child's process group still runs.

        The leader may be gone while its own children live on; they keep the
        group (and so its id) alive, which is what makes killpg safe here.
        ``live_groups`` comes from ``_live_process_groups()``.
        """
        if self.poll() is None:
            return True
        if live_groups is not None:
            return self.pid in live_groups
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _live_process_groups() -> Optional[set]:
    """Ids of the process groups that have a member which is not a zombie.

    killpg(pgid, 0) also counts zombies, and a killed grandchild stays one
    until init reaps it, which some container inits do only every second or
    so; waiting for those would stretch every shutdown for nothing.
    None where there is no /proc to tell (callers then fall back to killpg).
    """
    if not os.path.isdir("/proc/self"):
        return None
    groups = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue   # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(b")")[2].split()
        if len(fields) >= 3 and fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


def exit_code_of(code: int) -> int:
    """A shell-style exit code: 128+N for a child killed by signal N."""
    return 128 - code if code < 0 else code


class Job:
    """The children of one launch, and the one way to stop them."""

    def __init__(self, grace_s: float, output: Optional[ChildOutput] = None):
        self.grace_s = grace_s
        self.output = output                     # None: children share our terminal
        self.children: List[Child] = []
        self.stop_signal: Optional[int] = None   # first stop signal the launcher got
        self.hurry = False                       # a second one: skip the grace period
        # Elastic workers take a first SIGTERM for "leave at the next commit":
        # when set, a stop says it again after this many seconds.
        self.repeat_term_s: Optional[float] = None
        self._parent_pid = os.getpid()

    def start(self, name: str, kind: str, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        # Servers need no working directory. Starting them in a neutral one
        # keeps a source checkout in the current directory from shadowing the
        # installed bps_tf (`python -m` puts the working directory first).
        cwd = tempfile.gettempdir() if kind == "server" else None
        pipe = subprocess.PIPE if self.output is not None else None
        try:
            popen = subprocess.Popen(list(argv), env=dict(env), start_new_session=True, cwd=cwd,
                                     stdout=pipe, stderr=pipe,
                                     preexec_fn=_die_with_parent(self._parent_pid))
        except OSError as exc:
            say(f"cannot start {name} ({' '.join(argv)}): {exc}; stopping the other processes")
            raise Stop(EXIT_CANNOT_START) from None
        child = Child(name, kind, popen)
        self.children.append(child)
        if self.output is not None:
            self.output.attach(name, popen, child.errors)
        LOG.info("started %s: %s", child.label(), " ".join(argv))
        return child

    def note_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.hurry = True

    def check(self, deadline: Optional[float], timeout_s: Optional[float]) -> None:
        """Raise Stop if the launcher was told to stop or the job ran out of time."""
        if self.stop_signal is not None:
            say(f"received {signal_name(self.stop_signal)}; stopping all processes")
            raise Stop(128 + self.stop_signal)
        if deadline is not None and time.monotonic() >= deadline:
            say(f"the job did not finish within --timeout {timeout_s:g} s; "
                 f"stopping all processes")
            raise Stop(EXIT_TIMEOUT)

    def running(self, kind: Optional[str] = None) -> List[Child]:
        return [c for c in self.children if c.poll() is None and kind in (None, c.kind)]

    def first_failure(self, trigger: Child) -> Child:
        """The process whose failure came first, by time: a server that exits
        because a worker failed is a consequence, not the cause. When the
        first one's error names another process of the job by its pid (a
        server's "the job failed: worker 1 (host h, pid 123) failed (...)",
        "lost worker 1 (...)"), that one is the cause."""
        failed = [(c.failed_at(), c.kind != "worker", i, c) for i, c in enumerate(self.children)
                  if c.failed_at() is not None]
        first = min(failed, key=lambda f: f[:3])[3] if failed else trigger
        for pid in _NAMED_PROCESS.findall(first.errors.error):
            named = [c for c in self.children if c.pid == int(pid) and c is not first]
            if named:
                return named[0]
        return first

    def verdict(self, trigger: Child, then: str = "stopping the other processes") -> str:
        """The launcher's line when ``trigger`` exited non-zero: the process that
        failed first and its error line (the last exception line of its output)."""
        if self.output is not None:
            self.output.drain(trigger.pid, VERDICT_DRAIN_S)
        culprit = self.first_failure(trigger)
        error = f" ({culprit.errors.error})" if culprit.errors.error else ""
        tail = f"; {then}" if then else ""
        if culprit is trigger:
            return f"{trigger.label()} {trigger.exit_text()}{error}{tail}"
        return (f"{culprit.label()} failed first{error}; {trigger.label()} "
                f"{trigger.exit_text()} after it{tail}")

    def newly_exited(self, seen: set) -> List[Child]:
        """Children that exited since the last call, the most telling first."""
        fresh = [c for c in self.children if c.poll() is not None and c.pid not in seen]
        seen.update(c.pid for c in fresh)
        # Within one poll, a failure explains more than a clean exit, and a
        # worker's failure more than the servers' reaction to it.
        return sorted(fresh, key=lambda c: (c.returncode == 0, c.kind != "worker"))

    def stop(self, children: Optional[List[Child]] = None,
             first_signal: int = signal.SIGTERM) -> None:
        """Signal whole process groups, then SIGKILL what outlives the grace period.

        Groups whose leader already exited are included: a leftover grandchild
        must not outlive the launch.
        """
        candidates = self.children if children is None else children
        live = _live_process_groups()
        targets = [c for c in candidates if c.group_alive(live)]
        if not targets:
            return
        for child in targets:
            child.signal_group(first_signal)
        started = time.monotonic()
        give_up = started + self.grace_s
        repeat = self.repeat_term_s if first_signal == signal.SIGTERM else None
        while time.monotonic() < give_up and not self.hurry:
            live = _live_process_groups()
            if not any(c.group_alive(live) for c in targets):
                break
            if repeat is not None and time.monotonic() - started >= repeat:
                repeat = None
                for child in targets:
                    if child.group_alive(live):
                        child.signal_group(first_signal)
            time.sleep(POLL_INTERVAL_S)
        live = _live_process_groups()
        for child in targets:
            if child.group_alive(live):
                LOG.info("%s did not stop within %g s; sending SIGKILL", child.label(), self.grace_s)
                child.signal_group(signal.SIGKILL)
        for child in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=self.grace_s + 5)
            child.poll()   # notes when it ended


def supervise_fixed(job: "Job", deadline: Optional[float], timeout: Optional[float],
                    shutdown_timeout: float) -> int:
    """Waits for a fixed job to end; the first failure stops everything.

    At the end of a healthy job one side leaves first: the workers finish and
    the scheduler then tells the servers to exit, or the servers exit while the
    last workers are still tearing down. Either way the other side gets
    ``shutdown_timeout`` seconds to follow before it counts as stuck.
    """
    exited: set = set()
    workers_done_at: Optional[float] = None
    server_left: Optional[tuple] = None       # (when, which) a server exited 0 early
    while True:
        job.check(deadline, timeout)
        now = time.monotonic()
        for child in job.newly_exited(exited):
            if child.returncode != 0:
                say(job.verdict(child))
                raise Stop(child.returncode if child.returncode > 0 else 1)
            if child.kind == "server" and job.running("worker") and server_left is None:
                server_left = (now, child)
        workers = job.running("worker")
        servers = job.running("server")
        if not workers and not servers:
            return 0
        if not workers:
            workers_done_at = workers_done_at or now
            if now - workers_done_at >= shutdown_timeout:
                names = ", ".join(s.label() for s in servers)
                say(f"{names} did not exit within {shutdown_timeout:g} s after all workers "
                     f"finished; stopping them (the workers succeeded)")
                job.stop(servers)
                return 0
        elif server_left is not None and now - server_left[0] >= shutdown_timeout:
            names = ", ".join(w.label() for w in workers)
            say(f"{server_left[1].label()} exited while workers were still running, and "
                 f"{names} did not finish within {shutdown_timeout:g} s; stopping the other "
                 f"processes")
            raise Stop(1)
        time.sleep(POLL_INTERVAL_S)


_PR_SET_PDEATHSIG = 1


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()   # loaded before any fork: the child must not load libraries


def _die_with_parent(parent_pid: int):
    """A preexec hook asking Linux to SIGTERM the child if the launcher dies.

    This covers the one case the launcher cannot handle itself: being killed
    with SIGKILL. Elsewhere it is a no-op.
    """
    if _LIBC is None:
        return None

    def arm() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:   # the launcher died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


@contextlib.contextmanager
def catch_stop_signals(job: Job) -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into a request the supervision loop acts on.

    Children sit in their own sessions, so a Ctrl-C in the terminal reaches
    only the launcher; it must pass the stop on.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_IGN:
            continue   # e.g. SIGHUP under nohup: the caller chose to ignore it
        previous[signum] = signal.signal(signum, lambda n, _frame: job.note_signal(n))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_to_end(job: Job, child: Child, deadline: Optional[float], timeout_s: Optional[float],
               graceful_term: bool = False) -> None:
    """Waits for one child to end, passing the launcher's stop signals on.

    By default the very signal is passed on (SIGINT stays SIGINT), then the
    child is stopped as ``Job.stop`` does. ``graceful_term`` (a node of an
    elastic job, docs/elastic.md): SIGTERM alone is passed on, and nothing
    follows it: the node leaves the job at the workers' next commit and ends
    on its own with exit code 0; what bounds the wait is whoever sent the
    signal (on Kubernetes the pod's terminationGracePeriodSeconds, then
    SIGKILL). A second signal stops the child as ``Job.stop`` does.
    """
    passed = 0
    while child.poll() is None:
        signum = job.stop_signal
        if signum is not None and graceful_term and signum == signal.SIGTERM and not job.hurry:
            if not passed:
                LOG.info("received SIGTERM; passing it to %s, which leaves the elastic job at "
                         "its next commit", child.label())
                child.signal_group(signal.SIGTERM)
                passed = 1
        elif signum is not None:
            LOG.info("received %s; passing it to %s", signal_name(signum), child.label())
            job.stop([child], first_signal=signum)
            return
        if deadline is not None and time.monotonic() >= deadline:
            job.check(deadline, timeout_s)
        time.sleep(POLL_INTERVAL_S)

