"""Process-level state without TensorFlow: the core, joining, shutdown, size, rank, ...

Servers and tools import this module; it must never import TensorFlow.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time

from bps_tf.runtime import cluster, config, messages, security
from bps_tf.runtime.loader import load_core

_core = None
_atexit_registered = False
_membership = {"epoch": None, "restarting": False}   # elastic: the epoch joined last
log = logging.getLogger("bps_tf")


class NotInitializedError(RuntimeError):
    pass


def core():
    global _core
    if _core is None:
        _core = load_core()
    return _core


def join(environ=None) -> None:
    """Joins the cluster described by DMLC_*/TF_CONFIG (or none: size 1),
    unless joined already. ``bps_tf.init()`` (bps_tf.comm.lifecycle) is
    the public call; it also registers the process sets.

    Blocks until every worker and server has met; raises with the reason if
    they disagree or do not all arrive in BYTEPS_RENDEZVOUS_TIMEOUT seconds.
    """
    c = core()
    if c.is_initialized():
        return
    _join(c, environ)
    _speed_window_start()


def _join(c, environ, rank=None) -> None:
    spec = cluster.resolve(environ)
    if spec.role in ("server", "scheduler"):
        raise RuntimeError(
            f"this process is a bps_tf {spec.role} (from {spec.source}); servers run "
            "`python -m bps_tf.server` or `bpslaunch`, not bps_tf.init()")
    try:
        security.refuse_unprotected(spec, config.value("BYTEPS_JOB_TOKEN", environ),
                                    config.value("BYTEPS_ALLOW_INSECURE", environ), log)
    except security.InsecureClusterError as exc:
        refuse_to_start(str(exc))
    values = dict(config.core_settings(environ))
    values.update(spec.core_values())
    if values.get("elastic"):
        config.check_elastic(values)
        # The launcher's name for this process, in its reports to the scheduler.
        values["launch_id"] = (os.environ if environ is None else environ).get(
            "BYTEPS_LAUNCH_ID", "")
        if rank is not None:
            values["rank"] = rank      # the rank of the last epoch; the scheduler gives the new one
            values["elastic_rejoin"] = 1
            # The scheduler may wait that long for --min-np workers.
            values["rendezvous_timeout_s"] = max(float(values["rendezvous_timeout_s"]),
                                                 float(values["elastic_timeout_s"]))
        elif config.elastic_newcomer(environ):
            # Waits for the next epoch; ranked after the members, in the
            # order of the ranks the launcher planned for the newcomers
            # (HOROVOD_RANK, as horovodrun gives it; else its place in TF_CONFIG).
            planned = (os.environ if environ is None else environ).get("HOROVOD_RANK", "")
            values["start_rank"] = int(planned) if planned.isdigit() else values["rank"]
            values["rank"] = -1
    try:
        c.worker_init(config.to_core_text(values))
    except RuntimeError:
        if values.get("elastic"):
            _leave_if_told(c)
        raise
    if values.get("elastic"):
        _handle_sigterm_as_leave()
        if _sigterm["pending"]:
            # SIGTERM came while this worker changed membership: it leaves now.
            _sigterm["pending"] = False
            c.elastic_request_leave()
    _membership["epoch"] = int(json.loads(c.stats_json())["elastic_epoch"]) \
        if values.get("elastic") else None
    _configure_logging(values.get("log_level", "WARNING"), c.rank())
    log.info("initialized: rank %d of %d, local rank %d of %d", c.rank(), c.size(),
             c.local_rank(), c.local_size())
    if spec.role == "local" and spec.source == "none":
        log.warning("no cluster configured (no TF_CONFIG, no DMLC_* variables): training "
                    "alone, size 1. `bpslaunch -np N --servers S python SCRIPT` starts a local "
                    "cluster (docs/launcher.md).")
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def unprotected_refusal(environ=None) -> str:
    """Why a node of this environment must not start without a job token
    (protected mode, security.refuse_unprotected); "" when it may start, or
    when a setting is wrong (the node's own start-up says which, and how to
    fix it). Needs no TensorFlow, so it can run before TensorFlow loads."""
    environ = os.environ if environ is None else environ
    try:
        spec = cluster.resolve(environ)
        token = config.value("BYTEPS_JOB_TOKEN", environ)
        if config.value("BYTEPS_ALLOW_INSECURE", environ):
            return ""          # the node warns about it when it starts
    except ValueError:
        return ""
    try:
        security.refuse_unprotected(spec, token, False, log)
    except security.InsecureClusterError as exc:
        return str(exc)
    return ""


def refuse_to_start(message: str) -> None:
    """Ends this process as a server that refuses to start does: the reason
    on one line, exit code 2, no traceback (a setting to fix, not a bug)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(security.EXIT_REFUSED)


def _leave_if_told(c) -> None:
    """Elastic: the scheduler told this worker to go (the job finished, or
    it was removed) instead of admitting it: it ends with exit code 0."""
    why = json.loads(c.stats_json()).get("elastic_leave", "")
    if why:
        leaving_on_purpose()
        print(f"bps_tf: this worker leaves the elastic job without joining it: {why}",
              file=sys.stderr, flush=True)
        raise SystemExit(0)


_sigterm = {"installed": False, "asked": False, "pending": False, "leaving": False}


def leaving_on_purpose() -> None:
    """Elastic: this worker leaves the job now, with exit code 0 (removed, or
    asked to): a SIGTERM from here on is the launcher saying the same and must
    not end it by the signal. The launcher tells the scheduler and signals the
    worker at once, so the two orders arrive in either order.

    The signal is ignored by the kernel, not only by our handler: Python
    puts the default action back while it finalizes, and a SIGTERM that came
    then would still end the worker by the signal."""
    _sigterm["leaving"] = True
    if _sigterm["installed"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _handle_sigterm_as_leave() -> None:
    """Elastic: SIGTERM (a pod's eviction, bpslaunch removing a host) asks the
    scheduler to let this worker leave at the next commit, where the others
    go on without it and without a rollback. A second SIGTERM, or one while
    this worker is no member, ends the process as SIGTERM does. Installed
    only over the default action, from the main thread."""
    if _sigterm["installed"] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return   # the program handles SIGTERM itself

    def on_sigterm(signum, _frame):
        if _sigterm["leaving"]:
            return   # it is on its way out with exit code 0 already
        if not _sigterm["asked"]:
            if is_initialized() and core().elastic_request_leave():
                _sigterm["asked"] = True
                log.warning("SIGTERM: leaving the elastic job at the next commit (a second "
                            "SIGTERM ends this process at once)")
                return
            if is_initialized() or _membership.get("restarting"):
                # Its membership changes now: it asks once it is a member
                # again (unless the scheduler tells it to go at its HELLO).
                _sigterm["asked"] = _sigterm["pending"] = True
                log.warning("SIGTERM: leaving the elastic job once its membership change "
                            "is done (a second SIGTERM ends this process at once)")
                return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    _sigterm["installed"] = True


def membership_epoch():
    """Elastic (BYTEPS_ELASTIC=1): the membership epoch this worker joined
    last (0 for the first); None without elastic mode or before init()."""
    return _membership["epoch"] if is_initialized() else None


def rejoin(rank, environ=None) -> None:
    """Elastic: joins the next membership epoch after shutdown(), saying
    ``rank`` was this worker's rank in the last one (None: a newcomer)."""
    c = core()
    _join(c, environ, rank=-1 if rank is None else rank)
    _speed_window_start()


def restarting(flag: bool) -> None:
    """Elastic: this worker is between two memberships (shutdown, rejoin)."""
    _membership["restarting"] = flag


def _configure_logging(level: str, rank: int) -> None:
    # One level for the core and Python (BYTEPS_LOG_LEVEL), and the rank in
    # every line, as the core writes its own lines.
    fmt = logging.Formatter(f"[%(asctime)s %(levelname)s bps_tf worker {rank}] %(message)s",
                            datefmt="%H:%M:%S")
    handler = next((h for h in log.handlers if getattr(h, "_bps_tf", False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler._bps_tf = True
        log.addHandler(handler)
        log.propagate = False
    handler.setFormatter(fmt)
    level = {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(str(level).upper(), str(level).upper())
    log.setLevel(getattr(logging, level, logging.WARNING))


def shutdown(reason: str = None) -> None:
    """Leaves the cluster; pending operations fail. Safe to call twice.

    ``reason`` tells the other workers why this one leaves ("was interrupted
    (SIGINT)"); by default, what ended the program: at exit after an uncaught
    exception, that exception. The job then fails on every node with it."""
    if _core is not None:
        _core.worker_shutdown(leave_reason() if reason is None else reason)


def set_activity(text: str) -> None:
    """Tells the core what this worker is doing, in the program's terms ("fit,
    epoch 4"); its stall warnings show it. Never sent to other workers."""
    if is_initialized():
        _core.set_activity(text)


def leave_reason() -> str:
    """Why this program ends, for the others: "" when it finished.

    Python records an uncaught exception in ``sys.last_type`` before the
    ``atexit`` functions (our shutdown) run: a Ctrl-C is KeyboardInterrupt."""
    kind = getattr(sys, "last_type", None)
    if kind is None or hasattr(sys, "ps1"):   # an interactive session keeps old ones
        return ""
    if issubclass(kind, KeyboardInterrupt):
        return "was interrupted (SIGINT)"
    text = messages.one_line(getattr(sys, "last_value", "") or "")
    return f"failed ({kind.__name__}: {text})" if text else f"failed ({kind.__name__})"


def suspend() -> None:
    """BytePS's elastic-training call: refused, with what to do instead."""
    raise NotImplementedError(
        "suspend()/resume(): BytePS's elastic calls are not available in bps_tf; elastic "
        "training follows Horovod's API instead: BYTEPS_ELASTIC=1 (bpslaunch --min-np/--max-np) "
        "and hvd.elastic.run with a state object (docs/elastic.md).")


def resume(num_workers=None, num_servers=None) -> None:
    """BytePS's elastic-training call: refused (see :func:`suspend`)."""
    del num_workers, num_servers
    suspend()


def is_initialized() -> bool:
    return _core is not None and _core.is_initialized()


def _require_init() -> None:
    if not is_initialized():
        raise NotInitializedError("bps_tf is not initialized: call bps_tf.init() first")


def size() -> int:
    _require_init()
    return _core.size()


def rank() -> int:
    _require_init()
    return _core.rank()


def local_size() -> int:
    _require_init()
    return _core.local_size()


def local_rank() -> int:
    _require_init()
    return _core.local_rank()


def cross_rank() -> int:
    """Horovod's: this worker's host among the hosts that have a worker of
    this local rank (hosts in the scheduler's order)."""
    _require_init()
    return _core.cross_rank()


def cross_size() -> int:
    """Horovod's: the number of hosts that have a worker of this local rank
    (the number of hosts when each runs as many workers)."""
    _require_init()
    return _core.cross_size()


def is_homogeneous() -> bool:
    """Horovod's: whether every host runs the same number of workers."""
    _require_init()
    return bool(_core.is_homogeneous())


_TIMELINE_NOT_INITIALIZED = "bps_tf has not been initialized; use bps_tf.init()."


def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's: records this worker's timeline (Chrome trace JSON, see
    docs/timeline.md) from now until :func:`stop_timeline` or shutdown,
    into ``file_path``. ``mark_cycles`` is accepted for Horovod's scripts:
    bps_tf has no negotiation cycles to mark. A ValueError if bps_tf is not
    initialized or a timeline records already (``BYTEPS_TRACE_ON=1`` or an
    earlier call)."""
    del mark_cycles
    # Horovod raises ValueError (not NotInitializedError) before init().
    code = _core.start_timeline(os.fspath(file_path)) if is_initialized() else -1
    if code == -1:
        raise ValueError(_TIMELINE_NOT_INITIALIZED)
    if code == -2:
        raise ValueError("a timeline is being recorded already (BYTEPS_TRACE_ON=1 or an earlier "
                         "start_timeline()); call stop_timeline() first.")


def stop_timeline():
    """Horovod's: writes the timeline and stops recording; returns the file's
    path, or None if no timeline was recording. An OSError if the file could
    not be written (recording stops all the same)."""
    if not is_initialized():
        raise ValueError(_TIMELINE_NOT_INITIALIZED)
    try:
        return _core.stop_timeline()
    except RuntimeError as exc:
        raise OSError(str(exc)) from None


def stats() -> dict:
    """Engine counters (bytes sent/received, dropped frames, ops done)."""
    return json.loads(core().stats_json())


# get_pushpull_speed: BytePS measures its push_pull speed over windows of
# 10 s; here a window closes at the first call after 10 s have passed.
SPEED_WINDOW_S = 10.0
_speed = {"start": 0.0, "bytes": 0, "latest": (0, 0.0)}


def _bytes_moved() -> int:
    s = stats()
    return int(s["bytes_sent"]) + int(s["bytes_received"])


def _speed_window_start() -> None:
    _speed.update(start=time.monotonic(), bytes=_bytes_moved(), latest=(0, 0.0))


def get_pushpull_speed() -> tuple:
    """BytePS's: (milliseconds since the epoch, MB/s) of this worker's
    push_pull traffic (bytes sent to and received from the servers, 1 MB =
    10**6 bytes) over the latest window of at least 10 s, closed by the
    first call after its 10 s; (0, 0.0) until the first window closes. The
    first window starts at init()."""
    _require_init()
    now = time.monotonic()
    if now - _speed["start"] >= SPEED_WINDOW_S:
        moved = _bytes_moved()
        mbps = (moved - _speed["bytes"]) / (now - _speed["start"]) / 1e6
        _speed.update(start=now, bytes=moved, latest=(int(time.time() * 1000), mbps))
    return _speed["latest"]


def debug_send_log() -> list:
    """(tensor name, partition, priority) in the order partitions left this
    worker; recorded only with BYTEPS_DEBUG_SEND_LOG=1."""
    return [tuple(x) for x in stats()["send_log"]]
