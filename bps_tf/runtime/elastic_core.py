"""Elastic membership on the worker's side, without TensorFlow (docs/elastic.md).

The core fails every operation of a membership epoch once the scheduler
announces a new one (a worker was lost or restarts, or newcomers are
admitted). ``restart()`` then leaves the old epoch and joins the next one
as a new engine, keeping the rank order: the scheduler gives dense ranks,
the survivors in the order of their old ranks, then the newcomers.

The scheduler also sends host updates (workers announced to join, or about
to leave), which ``host_updates()`` lists for the states' queues, and tells
a worker that is removed from the job (``leaving()``): it leaves at the
next commit (``leave()``), exiting with 0.
"""
from __future__ import annotations

import json
import logging

from bps_tf.runtime import basics, config

# The goodbye reasons the scheduler reads (protocol.h): kElasticRestart, a
# member to wait for at once; kElasticLeave, a worker that leaves on purpose.
RESTART_REASON = "restarts its membership (elastic)"
LEAVE_REASON = "leaves the job (elastic)"
log = logging.getLogger("bps_tf")


def enabled(environ=None) -> bool:
    return bool(config.value("BYTEPS_ELASTIC", environ))


def _stats() -> dict:
    return json.loads(basics.core().stats_json())


def epoch() -> int:
    """The membership epoch this worker belongs to (0 until the first change)."""
    return basics.membership_epoch() or 0


def changed() -> bool:
    """True once the scheduler announced a new epoch: every operation of this
    one fails, and the worker must restart its membership."""
    if not basics.is_initialized():
        return False
    s = _stats()
    return int(s["elastic_announced"]) > int(s["elastic_epoch"])


def workers_waiting() -> int:
    """Workers the scheduler would admit at the next epoch (announced to every worker)."""
    if not basics.is_initialized():
        return 0
    return int(_stats()["elastic_waiting"])


def host_updates() -> list:
    """The scheduler's host updates of this membership: ``(number, time in
    ms, flags)``, flags 1 removed, 2 added. A restarted scheduler numbers
    its updates from 1 again: number and time together tell one apart."""
    if not basics.is_initialized():
        return []
    return [tuple(u) for u in _stats()["elastic_updates"]]


def leaving() -> str:
    """Why this worker must leave the job ("" while it stays): its host was
    removed, or it asked to (SIGTERM)."""
    return str(_stats().get("elastic_leave", ""))


def leave() -> None:
    """Leaves the job on purpose, at a commit where the others restart: says
    goodbye (the others go on without a rollback) and exits with 0."""
    why = leaving()
    basics.leaving_on_purpose()
    basics.shutdown(LEAVE_REASON)
    log.warning("elastic: this worker leaves the job (%s)", why or "asked to")
    raise SystemExit(0)


def restart(environ=None) -> None:
    """Leaves this epoch and joins the next one, as the same member: blocks
    until the scheduler has formed it (every survivor back, or BYTEPS_TIMEOUT)."""
    rank = basics.rank() if basics.is_initialized() else None
    basics.restarting(True)
    try:
        basics.shutdown(RESTART_REASON)
        basics.rejoin(rank, environ)
    finally:
        basics.restarting(False)
