"""Elastic membership on the worker's side, without TensorFlow (docs/elastic.md).

The core fails every operation of a membership epoch once the scheduler
announces a new one (a worker was lost or restarts, or newcomers are
admitted). ``restart()`` then leaves the old epoch and joins the next one
as a new engine, keeping the rank order: the scheduler gives dense ranks,
the survivors in the order of their old ranks, then the newcomers.
"""
from __future__ import annotations

import json
from bps_tf.runtime import basics, config

# The goodbye reason the scheduler reads as "back at once" (protocol.h
# kElasticRestart): not a failure, a member to wait for.
RESTART_REASON = "restarts its membership (elastic)"

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


def restart(environ=None) -> None:
    """Leaves this epoch and joins the next one, as the same member: blocks
    until the scheduler has formed it (every survivor back, or BYTEPS_TIMEOUT)."""
    rank = basics.rank() if basics.is_initialized() else None
    basics.shutdown(RESTART_REASON)
    basics.rejoin(rank, environ)
