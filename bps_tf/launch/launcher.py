"""bpslaunch: start a bps_tf job and supervise it until it ends.

Two modes:

* local (``-np N``): a whole cluster on 127.0.0.1 -- servers, with the
  scheduler inside server 0, and N workers running the user's command;
* cluster (no ``-np``): this machine's one process of a larger job, its role
  read from ``TF_CONFIG``, ``DMLC_*`` or a Kubernetes pod's JobSet / Indexed
  Job variables by ``bps_tf.runtime.cluster``.

Either way the launcher owns its children: each runs in its own process group
(so their own children are reached too), the first failure stops all of them,
and the launcher's exit code says what happened. Their output is tagged line by
line with the process it came from (output.py). See docs/launcher.md.

procs.py holds the children and how they are stopped, environments.py
what each child's environment holds, args.py the command line.

No TensorFlow here: the launcher must start quickly and run on server hosts.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

from bps_tf.launch import elastic as elastic_launch
from bps_tf.launch import environments
from bps_tf.launch import hosts as launch_hosts
from bps_tf.launch.keeper import Keeper
from bps_tf.launch.args import build_parser, elastic_options, parse_args  # noqa: F401 (the CLI's API)
from bps_tf.launch.output import (PROG, ChildOutput, child_env, end_line, health_ports,
                                  hides_tf_startup, plural, say, token_source)
from bps_tf.launch.procs import (EXIT_CANNOT_START, EXIT_TIMEOUT, LOG,  # noqa: F401
                                 POLL_INTERVAL_S, STOP_SIGNALS, Child, Job, Stop,
                                 catch_stop_signals, ensure_open_files, exit_code_of,
                                 run_to_end, signal_name, supervise_fixed)
from bps_tf.runtime import basics, cluster, config

DEFAULT_READY_TIMEOUT_S = 60.0     # for server 0 to report the scheduler port
# For one side to follow the other out at the end: a worker that said goodbye
# may still be saving its model, or tearing TensorFlow down (30 s was too
# short for that on a loaded 2-core machine). --shutdown-timeout changes it.
DEFAULT_SHUTDOWN_TIMEOUT_S = 120.0
DEFAULT_GRACE_S = 5.0              # between SIGTERM and SIGKILL
OUTPUT_DRAIN_S = 5.0               # for the last output of the children at the end

EXIT_USAGE = 2

def default_server_command() -> List[str]:
    return [sys.executable, "-m", "bps_tf.server"]


class UsageError(ValueError):
    """Options that cannot describe a job; nothing was started."""


def _fixed_slots(num_workers: int, hosts: Optional[str],
                 any_host: bool = False) -> List[launch_hosts.Slot]:
    try:
        return launch_hosts.fixed_slots(num_workers, hosts, any_host)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _health_base(health_port: Optional[int], environ: Mapping[str, str]) -> int:
    """The first server's gRPC health port in a local job (0: off)."""
    if health_port is None:
        try:
            health_port = config.value("BYTEPS_HEALTH_PORT", environ)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if not 0 <= health_port < 65536:
        raise UsageError(f"the gRPC health port must be 1-65535 (0: off), got {health_port}")
    return health_port


def _server_argv(server_command: Optional[Sequence[str]], env: Dict[str, str]) -> List[str]:
    if server_command is not None:
        return list(server_command)
    # The server must import the same bps_tf as this launcher, even when the
    # launcher runs from a source tree that is not installed.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
              environ: Optional[Mapping[str, str]] = None,
              prefix_output: bool = False,
              health_port: Optional[int] = None,
              elastic: Optional[Mapping[str, object]] = None,
              hosts: Optional[str] = None,
              host_exec: launch_hosts.HostExec = launch_hosts.HostExec()) -> int:
    """Run ``command`` as ``num_workers`` workers plus ``num_servers`` servers on 127.0.0.1.

    Returns 0 when every worker exits 0, otherwise a non-zero code (see
    docs/launcher.md). ``server_command`` replaces ``python -m bps_tf.server``
    (tests use a fake one). ``prefix_output`` tags every line of the
    children's output with ``[worker N]``/``[server N]`` (the CLI's default);
    otherwise they share this process's stdout and stderr. ``health_port``
    (default: BYTEPS_HEALTH_PORT) turns on the servers' gRPC health service,
    server i on port ``health_port + i``. ``elastic`` (args.elastic_options'
    keys) makes the job elastic (bps_tf.launch.elastic). ``hosts``: -H of a
    fixed job (the HOROVOD_* variables follow its hosts). ``host_exec``
    (--host-exec, --address): the workers run on their hosts through it.
    Every started process is gone when this returns.
    """
    if num_servers is None:
        num_servers = 1 if num_workers > 1 or elastic else 0
    _check_local_sizes(num_workers, num_servers, command)
    if elastic and num_servers == 0:
        raise UsageError("an elastic job needs a server to sum the gradients; "
                         "leave --servers out or give 1 or more")
    if host_exec.remote and not (hosts or (elastic and elastic.get("discovery"))):
        raise UsageError("--host-exec starts workers on the hosts of -H or "
                         "--host-discovery-script: give the hosts")
    if elastic:
        elastic = dict(elastic, host_exec=host_exec)
    fixed = None if elastic else _fixed_slots(num_workers, hosts, host_exec.remote)
    environ = os.environ if environ is None else environ
    health = _health_base(health_port, environ)
    job = Job(grace, ChildOutput(hides_tf_startup(environ)) if prefix_output else None)
    deadline = time.monotonic() + timeout if timeout else None
    workdir = tempfile.mkdtemp(prefix="bpslaunch-")
    try:
        with catch_stop_signals(job), _Ending(job) as ending:
            if num_servers == 0:
                say(f"starting 1 worker and no servers: {' '.join(command)} runs alone")
                env = child_env(environments.clean_env(environ), environ, job.output is not None)
                ending.code = _run_one(job, "worker 0", "worker", command, env, deadline,
                                       timeout)
            else:
                ending.code = _run_local_cluster(
                    job, num_workers, num_servers, command, server_command, environ, workdir,
                    deadline, timeout, ready_timeout, shutdown_timeout, health, elastic, fixed,
                    host_exec)
        return ending.code
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _Ending:
    """Ends a launch: turns Stop into its code, stops every process group
    (grandchildren included), lets the last output through, prints the end line."""

    def __init__(self, job: Job):
        self.job = job
        self.code = 1
        self.started = time.monotonic()

    def __enter__(self) -> "_Ending":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, Stop):
            self.code = exc.code
        self.job.stop()   # nothing may outlive the launch
        if self.job.output is not None:
            self.job.output.wait(OUTPUT_DRAIN_S)
        say(end_line(self.job.children, self.code, time.monotonic() - self.started))
        return isinstance(exc, Stop)


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
    ensure_open_files(2 * (num_workers + num_servers) + 64,   # each child's stdout and stderr
                      f"bpslaunch of {num_workers + num_servers} processes", UsageError)


def _run_local_cluster(job: Job, num_workers: int, num_servers: int, command: Sequence[str],
                     server_command: Optional[Sequence[str]], environ: Mapping[str, str],
                     workdir: str, deadline: Optional[float], timeout: Optional[float],
                     ready_timeout: float, shutdown_timeout: float, health: int,
                     elastic: Optional[Mapping[str, object]] = None,
                     fixed: Optional[List[launch_hosts.Slot]] = None,
                     host_exec: launch_hosts.HostExec = launch_hosts.HostExec()) -> int:
    launch = None
    if elastic:
        try:
            launch = elastic_launch.make_launch(job, num_workers, command, elastic)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        slots = launch.initial_plan(num_workers, deadline, timeout)
        # SIGTERM is an elastic worker's "leave at the next commit": a job
        # that stops says it twice (bps_tf's handler ends the process then).
        job.repeat_term_s = 0.5
    else:
        slots = fixed or _fixed_slots(num_workers, None)
    address = host_exec.address or environments.LOCALHOST
    shared = child_env(environments.job_env(environ, len(slots), num_servers, address), environ,
                       job.output is not None)
    if elastic:
        shared = elastic_launch.elastic_env(shared, elastic["min_np"], elastic["max_np"],
                                            elastic["elastic_timeout"], elastic.get("reset_limit"))
    ready_file = os.path.join(workdir, "scheduler.port")
    if launch is not None:
        return _run_elastic(job, launch, slots, shared, num_servers, server_command, environ,
                            ready_file, health, deadline, timeout, ready_timeout,
                            shutdown_timeout)

    env0 = environments.server_env(shared, 0, 0, ready_file, health)
    server0 = job.start("server 0", "server", _server_argv(server_command, env0), env0)
    port = _wait_for_scheduler_port(job, server0, ready_file, ready_timeout, deadline, timeout)
    say(f"starting {plural(len(slots), 'worker')} and {plural(num_servers, 'server')} on "
        f"{address}: scheduler in server 0 on port {port}{health_ports(health, num_servers)}; "
        f"{token_source(environ, local=True)}")

    for server_id in range(1, num_servers):
        env = environments.server_env(shared, server_id, port, health_port=health)
        job.start(f"server {server_id}", "server", _server_argv(server_command, env), env)
    for slot in slots:
        job.start(f"worker {slot.rank}", "worker", host_exec.argv(slot.host, command),
                  environments.worker_env(shared, slot, port, host_exec.remote))
    return supervise_fixed(job, deadline, timeout, shutdown_timeout)


def _run_elastic(job: Job, launch, slots, shared: Mapping[str, str], num_servers: int,
                 server_command: Optional[Sequence[str]], environ: Mapping[str, str],
                 ready_file: str, health: int, deadline: Optional[float],
                 timeout: Optional[float], ready_timeout: float, shutdown_timeout: float) -> int:
    # The scheduler in a process of its own, restarted in place when it is
    # lost; servers replaced when they end (keeper.py, docs/elastic.md).
    keeper = Keeper(job, shared, num_servers, ready_file, environments.server_env,
                    lambda env: _server_argv(server_command, env), health,
                    lambda child, path: _wait_for_scheduler_port(job, child, path, ready_timeout,
                                                                 deadline, timeout))
    port = keeper.start()
    say(f"starting {plural(len(slots), 'worker')} and {plural(num_servers, 'server')} on "
        f"{shared['DMLC_PS_ROOT_URI']}: the scheduler on port {port}"
        f"{health_ports(health, num_servers)}; {token_source(environ, local=True)}")
    launch.shared = dict(shared)
    launch.keeper = keeper
    launch.start_workers(port, slots)
    try:
        return launch.supervise(deadline, timeout, shutdown_timeout)
    finally:
        if launch.link is not None:
            launch.link.close()


def _wait_for_scheduler_port(job: Job, server0: Child, ready_file: str, ready_timeout: float,
                             deadline: Optional[float], timeout: Optional[float]) -> int:
    give_up = time.monotonic() + ready_timeout
    last_text = ""
    while True:
        port, last_text = _read_port(ready_file, last_text)
        if port:
            return port
        job.check(deadline, timeout)
        if server0.poll() is not None:
            say(f"{server0.label()} {server0.exit_text()} before it reported the scheduler "
                 f"port; stopping the other processes")
            raise Stop(server0.returncode if server0.returncode > 0 else 1)
        if time.monotonic() >= give_up:
            seen = f" (it holds {last_text!r})" if last_text else ""
            say(f"{server0.label()} did not write the scheduler port to {ready_file} within "
                 f"{ready_timeout:g} s{seen}; stopping it")
            raise Stop(1)
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


# ------------------------------------------------------- one process, cluster mode

def run_cluster(command: Sequence[str], *, server_command: Optional[Sequence[str]] = None,
                timeout: Optional[float] = None, grace: float = DEFAULT_GRACE_S,
                environ: Optional[Mapping[str, str]] = None,
                prefix_output: bool = False, health_port: Optional[int] = None) -> int:
    """Run this host's one process of a cluster described by TF_CONFIG, DMLC_* or a
    Kubernetes pod's variables (bps_tf.runtime.k8s_cluster).

    Workers and evaluators run ``command``; servers and schedulers run
    ``server_command`` (default ``python -m bps_tf.server``). The environment
    is passed through unchanged (the child resolves its own place again), but
    for TF_CPP_MIN_LOG_LEVEL (see launch_output.child_env) and, when given,
    ``health_port`` as the server's BYTEPS_HEALTH_PORT.
    """
    environ = os.environ if environ is None else environ
    try:
        cfg = cluster.resolve(environ)
    except cluster.ClusterSpecError as exc:
        say(str(exc))
        return EXIT_USAGE
    LOG.info("%s", cluster.describe(cfg))
    if cfg.role == "local":
        say("no cluster is configured: pass -np N to start a local job, or set TF_CONFIG "
            "(or DMLC_ROLE and the other DMLC_* variables, or a Kubernetes pod's JobSet or "
            "Indexed Job variables: docs/kubernetes.md) to give this process its place "
            "in a cluster")
        return EXIT_USAGE
    if refusal := basics.unprotected_refusal(environ):   # before anything starts
        say(refusal)
        return EXIT_USAGE
    job = Job(grace, ChildOutput(hides_tf_startup(environ)) if prefix_output else None)
    env = child_env(environ, environ, job.output is not None)
    health = ""
    if cfg.role in ("server", "scheduler"):
        if command:
            LOG.info("this process is the %s; running the bps_tf server instead of %r",
                     cfg.role, " ".join(command))
        if health_port is not None:
            env["BYTEPS_HEALTH_PORT"] = str(health_port)
        port = env.get("BYTEPS_HEALTH_PORT", "0").strip()
        health = f", gRPC health on port {port}" if port not in ("", "0") else ""
        argv = _server_argv(server_command, env)
        name = f"server {cfg.server_id}" if cfg.role == "server" and cfg.server_id >= 0 else cfg.role
        kind = "server"
    else:
        if not command:
            say(f"this process is a {cfg.role} but no command was given; put it after the "
                f"options, e.g. bpslaunch python train.py")
            return EXIT_USAGE
        argv = list(command)
        # A newcomer of an elastic job has no rank until the scheduler admits it.
        name = f"worker {cfg.rank}" if cfg.role == "worker" and cfg.rank >= 0 else cfg.role
        kind = "worker"

    deadline = time.monotonic() + timeout if timeout else None
    with catch_stop_signals(job), _Ending(job) as ending:
        say(f"starting {name}: {cluster.describe(cfg)}{health}; {token_source(environ, local=False)}")
        ending.code = _run_one(job, name, kind, argv, env, deadline, timeout)
    return ending.code


def _run_one(job: Job, name: str, kind: str, argv: Sequence[str], env: Mapping[str, str],
             deadline: Optional[float], timeout: Optional[float]) -> int:
    """Run one child to its end, passing stop signals on; return its exit code.

    An elastic worker or server takes SIGTERM (a pod's eviction or
    scale-down) as "leave at the next commit": it gets the signal and all
    the time it needs (the pod's grace period bounds it); a second signal
    stops it (procs.run_to_end)."""
    child = job.start(name, kind, argv, env)
    # An elastic node takes SIGTERM as "leave at the next commit" (a pod's
    # eviction): passed on alone, with no SIGKILL after it.
    run_to_end(job, child, deadline, timeout, graceful_term=bool(config.value("BYTEPS_ELASTIC", env)))
    if child.returncode:
        say(job.verdict(child, then=""))
    return exit_code_of(child.returncode if child.returncode is not None else -signal.SIGKILL)


# ---------------------------------------------------------------------- CLI

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
    _configure_logging(args.verbose or args.log_level in ("TRACE", "DEBUG", "INFO"))
    environ = None
    if args.log_level:
        environ = dict(os.environ, BYTEPS_LOG_LEVEL=args.log_level)
    if args.hosts and args.num_proc is None and not args.elastic:
        say("-H/--hosts needs -np (local mode)")
        return EXIT_USAGE
    try:
        host_exec = launch_hosts.check_host_exec(args.host_exec, args.address)
    except ValueError as exc:
        say(str(exc))
        return EXIT_USAGE
    if args.num_proc is None and not args.elastic:
        if args.servers is not None:
            say("--servers only applies with -np (local mode); in cluster mode the servers "
                "come from TF_CONFIG or DMLC_NUM_SERVER")
            return EXIT_USAGE
        if host_exec.remote:
            say("--host-exec only applies with -np (local mode): in cluster mode each process "
                "is launched on its own host")
            return EXIT_USAGE
        if args.shutdown_timeout is not None:
            say("--shutdown-timeout only applies with -np (local mode): in cluster mode each "
                "process is launched on its own host and ends by itself")
            return EXIT_USAGE
        return run_cluster(args.command, timeout=args.timeout, prefix_output=args.prefix,
                           health_port=args.health_port, environ=environ)
    elastic = None
    if args.elastic:
        if args.hosts and args.discovery:
            say("-H/--hosts and --host-discovery-script exclude each other: give the hosts "
                "one way")
            return EXIT_USAGE
        try:
            num, low, high = elastic_launch.check_options(
                args.num_proc, args.min_np, args.max_np, bool(args.hosts or args.discovery))
        except ValueError as exc:
            say(str(exc))
            return EXIT_USAGE
        args.num_proc = num
        elastic = dict(elastic_options(args), min_np=low, max_np=high)
    try:
        return run_local(args.num_proc, args.servers, args.command, timeout=args.timeout,
                         shutdown_timeout=args.shutdown_timeout or DEFAULT_SHUTDOWN_TIMEOUT_S,
                         prefix_output=args.prefix, health_port=args.health_port,
                         elastic=elastic, hosts=args.hosts, environ=environ,
                         host_exec=host_exec)
    except UsageError as exc:
        say(str(exc))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
