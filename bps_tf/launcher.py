"""bpslaunch: start a bps_tf job and supervise it until it ends.

Two modes:

* local (``-np N``): a whole cluster on 127.0.0.1 -- servers, with the
  scheduler inside server 0, and N workers running the user's command;
* cluster (no ``-np``): this machine's one process of a larger job, its role
  read from ``TF_CONFIG`` or ``DMLC_*`` by ``bps_tf.cluster``.

Either way the launcher owns its children: each runs in its own process group
(so their own children are reached too), the first failure stops all of them,
and the launcher's exit code says what happened. See docs/launcher.md.

No TensorFlow here: the launcher must start quickly and run on server hosts.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

from bps_tf import cluster

PROG = "bpslaunch"
LOG = logging.getLogger("bps_tf.launcher")

LOCALHOST = "127.0.0.1"
DEFAULT_READY_TIMEOUT_S = 60.0     # for server 0 to report the scheduler port
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # for one side to follow the other out at the end
DEFAULT_GRACE_S = 5.0              # between SIGTERM and SIGKILL
POLL_INTERVAL_S = 0.05

EXIT_USAGE = 2
EXIT_TIMEOUT = 124                 # what timeout(1) uses
EXIT_CANNOT_START = 127            # what a shell uses for "command not found"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Variables that place a process in a cluster. A child gets only those the
# launcher sets for it, so a stale value in the caller's shell cannot leak in.
PLACEMENT_VARIABLES = (
    "TF_CONFIG", "DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_WORKER_ID",
    "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NODE_HOST", "BYTEPS_SERVER_ID",
    "BYTEPS_SERVER_PORT", "BYTEPS_BIND_HOST", "BYTEPS_HOST_SCHEDULER", "BYTEPS_READY_FILE",
    "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
)


def default_server_command() -> List[str]:
    return [sys.executable, "-m", "bps_tf.server"]


class UsageError(ValueError):
    """Options that cannot describe a job; nothing was started."""


class _Stop(Exception):
    """The job must end now with this exit code; the reason was already printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _say(message: str) -> None:
    # Failure lines always reach the user, whatever the log level.
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------ children

class _Child:
    """One process the launcher started, the leader of its own process group."""

    def __init__(self, name: str, kind: str, popen: subprocess.Popen):
        self.name = name          # "worker 1", "server 0"
        self.kind = kind          # "worker" or "server"
        self.popen = popen
        self.pid = popen.pid      # == its process group id (start_new_session)

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.returncode

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def exit_text(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            return f"was killed by signal {_signal_name(-code)}"
        return f"exited with code {code}"

    def label(self) -> str:
        return f"{self.name} (pid {self.pid})"

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


def _exit_code_of(code: int) -> int:
    """A shell-style exit code: 128+N for a child killed by signal N."""
    return 128 - code if code < 0 else code


class _Job:
    """The children of one launch, and the one way to stop them."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.children: List[_Child] = []
        self.stop_signal: Optional[int] = None   # first stop signal the launcher got
        self.hurry = False                       # a second one: skip the grace period
        self._parent_pid = os.getpid()

    def start(self, name: str, kind: str, argv: Sequence[str], env: Mapping[str, str]) -> _Child:
        # Servers need no working directory. Starting them in a neutral one
        # keeps a source checkout in the current directory from shadowing the
        # installed bps_tf (`python -m` puts the working directory first).
        cwd = tempfile.gettempdir() if kind == "server" else None
        try:
            popen = subprocess.Popen(list(argv), env=dict(env), start_new_session=True, cwd=cwd,
                                     preexec_fn=_die_with_parent(self._parent_pid))
        except OSError as exc:
            _say(f"cannot start {name} ({' '.join(argv)}): {exc}; stopping the other processes")
            raise _Stop(EXIT_CANNOT_START) from None
        child = _Child(name, kind, popen)
        self.children.append(child)
        LOG.info("started %s: %s", child.label(), " ".join(argv))
        return child

    def note_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.hurry = True

    def check(self, deadline: Optional[float], timeout_s: Optional[float]) -> None:
        """Raise _Stop if the launcher was told to stop or the job ran out of time."""
        if self.stop_signal is not None:
            _say(f"received {_signal_name(self.stop_signal)}; stopping all processes")
            raise _Stop(128 + self.stop_signal)
        if deadline is not None and time.monotonic() >= deadline:
            _say(f"the job did not finish within --timeout {timeout_s:g} s; "
                 f"stopping all processes")
            raise _Stop(EXIT_TIMEOUT)

    def running(self, kind: Optional[str] = None) -> List[_Child]:
        return [c for c in self.children if c.poll() is None and kind in (None, c.kind)]

    def newly_exited(self, seen: set) -> List[_Child]:
        """Children that exited since the last call, the most telling first."""
        fresh = [c for c in self.children if c.poll() is not None and c.pid not in seen]
        seen.update(c.pid for c in fresh)
        # Within one poll, a failure explains more than a clean exit, and a
        # worker's failure more than the servers' reaction to it.
        return sorted(fresh, key=lambda c: (c.returncode == 0, c.kind != "worker"))

    def stop(self, children: Optional[List[_Child]] = None,
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
        give_up = time.monotonic() + self.grace_s
        while time.monotonic() < give_up and not self.hurry:
            live = _live_process_groups()
            if not any(c.group_alive(live) for c in targets):
                break
            time.sleep(POLL_INTERVAL_S)
        live = _live_process_groups()
        for child in targets:
            if child.group_alive(live):
                LOG.info("%s did not stop within %g s; sending SIGKILL", child.label(), self.grace_s)
                child.signal_group(signal.SIGKILL)
        for child in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=self.grace_s + 5)


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
def _catch_stop_signals(job: _Job) -> Iterator[None]:
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


# ------------------------------------------------------------- environment

def _clean_env(environ: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in environ.items() if k not in PLACEMENT_VARIABLES}


def _job_env(environ: Mapping[str, str], num_workers: int, num_servers: int) -> Dict[str, str]:
    """What every process of a local job shares."""
    env = _clean_env(environ)
    # One token per job lets the processes reject messages from another job.
    env.setdefault("BYTEPS_JOB_TOKEN", secrets.token_hex(16))
    env.update({
        "DMLC_NUM_WORKER": str(num_workers),
        "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_PS_ROOT_URI": LOCALHOST,
        "DMLC_NODE_HOST": LOCALHOST,
        "BYTEPS_BIND_HOST": LOCALHOST,
    })
    return env


def _server_env(job_env: Mapping[str, str], server_id: int, scheduler_port: int,
                ready_file: str = "") -> Dict[str, str]:
    env = dict(job_env)
    env.update({
        "DMLC_ROLE": "server",
        "BYTEPS_SERVER_ID": str(server_id),
        "BYTEPS_HOST_SCHEDULER": "1" if ready_file else "0",
        "DMLC_PS_ROOT_PORT": str(scheduler_port),
        "BYTEPS_SERVER_PORT": "0",
    })
    if ready_file:
        env["BYTEPS_READY_FILE"] = ready_file
    return env


def _worker_env(job_env: Mapping[str, str], rank: int, num_workers: int,
                scheduler_port: int) -> Dict[str, str]:
    env = dict(job_env)
    env.update({
        "DMLC_ROLE": "worker",
        "DMLC_WORKER_ID": str(rank),
        "BYTEPS_LOCAL_RANK": str(rank),
        "BYTEPS_LOCAL_SIZE": str(num_workers),
        "DMLC_PS_ROOT_PORT": str(scheduler_port),
    })
    return env


def _server_argv(server_command: Optional[Sequence[str]], env: Dict[str, str]) -> List[str]:
    if server_command is not None:
        return list(server_command)
    # The server must import the same bps_tf as this launcher, even when the
    # launcher runs from a source tree that is not installed.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in paths if p != package_root])
    return default_server_command()


# --------------------------------------------------------------- local mode

def run_local(num_workers: int, num_servers: Optional[int], command: Sequence[str], *,
              server_command: Optional[Sequence[str]] = None,
              timeout: Optional[float] = None,
              ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
              shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
              grace: float = DEFAULT_GRACE_S,
              environ: Optional[Mapping[str, str]] = None) -> int:
    """Run ``command`` as ``num_workers`` workers plus ``num_servers`` servers on 127.0.0.1.

    Returns 0 when every worker exits 0, otherwise a non-zero code (see
    docs/launcher.md). ``server_command`` replaces ``python -m bps_tf.server``
    (tests use a fake one). Every started process is gone when this returns.
    """
    if num_servers is None:
        num_servers = 1 if num_workers > 1 else 0
    _check_local_sizes(num_workers, num_servers, command)
    environ = os.environ if environ is None else environ
    job = _Job(grace)
    deadline = time.monotonic() + timeout if timeout else None
    workdir = tempfile.mkdtemp(prefix="bpslaunch-")
    try:
        with _catch_stop_signals(job):
            try:
                if num_servers == 0:
                    return _run_one(job, "worker 0", "worker", command, _clean_env(environ),
                                    deadline, timeout)
                return _run_local_cluster(job, num_workers, num_servers, command, server_command,
                                        environ, workdir, deadline, timeout, ready_timeout,
                                        shutdown_timeout)
            except _Stop as stop:
                return stop.code
            finally:
                job.stop()   # nothing may outlive the launch, grandchildren included
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _check_local_sizes(num_workers: int, num_servers: int, command: Sequence[str]) -> None:
    if num_workers < 1:
        raise UsageError(f"-np must be at least 1, got {num_workers}")
    if num_servers < 0:
        raise UsageError(f"--servers must be at least 0, got {num_servers}")
    if num_workers > 1 and num_servers == 0:
        raise UsageError(f"-np {num_workers} needs at least one server to sum gradients; "
                         f"pass --servers 1 or more")
    if not command:
        raise UsageError("no command to run; put it after the options, e.g. "
                         "bpslaunch -np 2 python train.py")


def _run_local_cluster(job: _Job, num_workers: int, num_servers: int, command: Sequence[str],
                     server_command: Optional[Sequence[str]], environ: Mapping[str, str],
                     workdir: str, deadline: Optional[float], timeout: Optional[float],
                     ready_timeout: float, shutdown_timeout: float) -> int:
    shared = _job_env(environ, num_workers, num_servers)
    ready_file = os.path.join(workdir, "scheduler.port")

    env0 = _server_env(shared, 0, 0, ready_file)
    server0 = job.start("server 0", "server", _server_argv(server_command, env0), env0)
    port = _wait_for_scheduler_port(job, server0, ready_file, ready_timeout, deadline, timeout)
    LOG.info("scheduler listens on %s:%d", LOCALHOST, port)

    for server_id in range(1, num_servers):
        env = _server_env(shared, server_id, port)
        job.start(f"server {server_id}", "server", _server_argv(server_command, env), env)
    for rank in range(num_workers):
        job.start(f"worker {rank}", "worker", command,
                  _worker_env(shared, rank, num_workers, port))
    return _supervise(job, deadline, timeout, shutdown_timeout)


def _wait_for_scheduler_port(job: _Job, server0: _Child, ready_file: str, ready_timeout: float,
                             deadline: Optional[float], timeout: Optional[float]) -> int:
    give_up = time.monotonic() + ready_timeout
    last_text = ""
    while True:
        port, last_text = _read_port(ready_file, last_text)
        if port:
            return port
        job.check(deadline, timeout)
        if server0.poll() is not None:
            _say(f"{server0.label()} {server0.exit_text()} before it reported the scheduler "
                 f"port; stopping the other processes")
            raise _Stop(server0.returncode if server0.returncode > 0 else 1)
        if time.monotonic() >= give_up:
            seen = f" (it holds {last_text!r})" if last_text else ""
            _say(f"{server0.label()} did not write the scheduler port to {ready_file} within "
                 f"{ready_timeout:g} s{seen}; stopping it")
            raise _Stop(1)
        time.sleep(POLL_INTERVAL_S)


def _read_port(path: str, last_text: str):
    """The port in the ready file, or None while it is absent or not a port yet."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None, last_text
    if text.isdigit() and 1 <= int(text) <= 65535:
        return int(text), text
    return None, text


def _supervise(job: _Job, deadline: Optional[float], timeout: Optional[float],
               shutdown_timeout: float) -> int:
    """Wait for the job to end; the first failure stops everything.

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
                _say(f"{child.label()} {child.exit_text()}; stopping the other processes")
                raise _Stop(child.returncode if child.returncode > 0 else 1)
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
                _say(f"{names} did not exit within {shutdown_timeout:g} s after all workers "
                     f"finished; stopping them (the workers succeeded)")
                job.stop(servers)
                return 0
        elif server_left is not None and now - server_left[0] >= shutdown_timeout:
            names = ", ".join(w.label() for w in workers)
            _say(f"{server_left[1].label()} exited while workers were still running, and "
                 f"{names} did not finish within {shutdown_timeout:g} s; stopping the other "
                 f"processes")
            raise _Stop(1)
        time.sleep(POLL_INTERVAL_S)


# ------------------------------------------------------- one process, cluster mode

def run_cluster(command: Sequence[str], *, server_command: Optional[Sequence[str]] = None,
                timeout: Optional[float] = None, grace: float = DEFAULT_GRACE_S,
                environ: Optional[Mapping[str, str]] = None) -> int:
    """Run this host's one process of a cluster described by TF_CONFIG or DMLC_*.

    Workers and evaluators run ``command``; servers and schedulers run
    ``server_command`` (default ``python -m bps_tf.server``). The environment
    is passed through unchanged: the child resolves its own place again.
    """
    environ = os.environ if environ is None else environ
    try:
        cfg = cluster.resolve(environ)
    except cluster.ClusterSpecError as exc:
        _say(str(exc))
        return EXIT_USAGE
    LOG.info("%s", cluster.describe(cfg))
    if cfg.role == "local":
        _say("no cluster is configured: pass -np N to start a local job, or set TF_CONFIG "
             "(or DMLC_ROLE and the other DMLC_* variables) to give this process its place "
             "in a cluster")
        return EXIT_USAGE
    env = dict(environ)
    if cfg.role in ("server", "scheduler"):
        if command:
            LOG.info("this process is the %s; running the bps_tf server instead of %r",
                     cfg.role, " ".join(command))
        argv = _server_argv(server_command, env)
        name, kind = cfg.role, "server"
    else:
        if not command:
            _say(f"this process is a {cfg.role} but no command was given; put it after the "
                 f"options, e.g. bpslaunch python train.py")
            return EXIT_USAGE
        argv = list(command)
        name = f"worker {cfg.rank}" if cfg.role == "worker" else cfg.role
        kind = "worker"

    job = _Job(grace)
    deadline = time.monotonic() + timeout if timeout else None
    with _catch_stop_signals(job):
        try:
            return _run_one(job, name, kind, argv, env, deadline, timeout)
        except _Stop as stop:
            return stop.code
        finally:
            job.stop()


def _run_one(job: _Job, name: str, kind: str, argv: Sequence[str], env: Mapping[str, str],
             deadline: Optional[float], timeout: Optional[float]) -> int:
    """Run one child to its end, passing stop signals on; return its exit code."""
    child = job.start(name, kind, argv, env)
    while child.poll() is None:
        if job.stop_signal is not None:
            # Pass the very signal on (SIGINT stays SIGINT) so the program can
            # react as it would in a terminal; then report how it ended.
            LOG.info("received %s; passing it to %s", _signal_name(job.stop_signal), child.label())
            job.stop([child], first_signal=job.stop_signal)
            break
        job.check(deadline, timeout)
        time.sleep(POLL_INTERVAL_S)
    if child.returncode:
        _say(f"{child.label()} {child.exit_text()}")
    return _exit_code_of(child.returncode if child.returncode is not None else -signal.SIGKILL)


# ---------------------------------------------------------------------- CLI

_DESCRIPTION = """\
Start a bps_tf training job and supervise it.

Local mode (-np N): starts a whole cluster on 127.0.0.1: the servers (the
scheduler runs inside server 0) and N workers that run COMMAND, each with
DMLC_WORKER_ID / BYTEPS_LOCAL_RANK set to its rank.

Cluster mode (no -np): starts this host's one process of a larger job, whose
place is read from TF_CONFIG (e.g. a Kubeflow TFJob) or from DMLC_ROLE and the
other DMLC_* variables. Workers, chief and evaluator run COMMAND; ps, server
and scheduler run the bps_tf server and ignore COMMAND.
"""

_EPILOG = """\
examples:
  bpslaunch -np 4 python train.py --epochs 3
  bpslaunch -np 2 --servers 2 --timeout 600 -- python train.py
  TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' bpslaunch python train.py

On failure (a process exits non-zero or is killed, a server dies early, the
timeout passes, or the launcher gets SIGINT/SIGTERM) every process group is sent
SIGTERM, then SIGKILL after 5 s, and bpslaunch exits non-zero naming the cause.
Exit codes: the failed process's code (1 if it was killed by a signal), 124 on
--timeout, 128+N on signal N, 2 for usage or configuration errors.
"""


def _number(text: str, kind, lowest, inclusive: bool = True):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < lowest or (not inclusive and value == lowest):
        bound = f"at least {lowest}" if inclusive else f"more than {lowest}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, 1)


def _non_negative_int(text: str) -> int:
    return _number(text, int, 0)


def _positive_float(text: str) -> float:
    return _number(text, float, 0, inclusive=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int, metavar="N",
                        help="local mode: run N workers on this machine (omit for cluster mode)")
    parser.add_argument("-ns", "--servers", dest="servers", type=_non_negative_int, metavar="S",
                        help="local mode: number of servers (default 1 when N > 1, 0 when N "
                             "is 1; 0 with N = 1 runs COMMAND alone with no cluster)")
    parser.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                        help="stop the whole job and fail if it runs longer than this")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the launcher starts and decides")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the program each worker runs, with its arguments; a '--' "
                             "before it is optional")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return args


class _StderrHandler(logging.Handler):
    # Writes to the current sys.stderr, not the one at set-up time.
    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def _configure_logging(verbose: bool) -> None:
    if not any(isinstance(h, _StderrHandler) for h in LOG.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
        LOG.addHandler(handler)
        LOG.propagate = False
    LOG.setLevel(logging.INFO if verbose else logging.WARNING)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:      # argparse already printed usage or help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(args.verbose)
    if args.num_proc is None:
        if args.servers is not None:
            _say("--servers only applies with -np (local mode); in cluster mode the servers "
                 "come from TF_CONFIG or DMLC_NUM_SERVER")
            return EXIT_USAGE
        return run_cluster(args.command, timeout=args.timeout)
    try:
        return run_local(args.num_proc, args.servers, args.command, timeout=args.timeout)
    except UsageError as exc:
        _say(str(exc))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
