"""Horovod's elastic state machinery, without TensorFlow (docs/elastic.md).

``State``/``ObjectState``, the host updates a state sees
(``state._host_messages``, a queue of ``(timestamp, HostUpdateResult)`` as
Horovod's scripts read it), ``check_host_updates`` and ``run_fn`` (the loop
behind ``hvd.elastic.run``). The TensorFlow states and the TensorFlow
``run`` are bps_tf.horovod.elastic; scripts without TensorFlow (and tests of
the launcher and scheduler) use these directly.

Collectives here go through the core's numpy push_pull: small, and the same
on every face.
"""
from __future__ import annotations

import enum
import functools
import itertools
import logging
import pickle
import queue

import numpy as np

from bps_tf.runtime import basics, elastic_core

__all__ = ["HostUpdateResult", "HorovodInternalError", "WorkersChangedError",
           "HostsUpdatedInterrupt", "State", "ObjectState", "run_fn", "run", "broadcast_object"]

log = logging.getLogger("bps_tf")


class HostUpdateResult(enum.IntFlag):
    """Horovod's: what a host update did (its flags)."""
    no_update = 0
    removed = 1
    added = 2
    mixed = 3


class HorovodInternalError(RuntimeError):
    """Horovod's name for a collective that failed because the workers changed."""


class WorkersChangedError(HorovodInternalError):
    """The membership changed under a pending operation (a worker was lost or
    left): roll back to the last commit; ``run`` does it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit()``/``check_host_updates()`` on every worker at the
    same commit when workers were added or will leave. ``skip_sync``: only
    workers leave, so the others keep their state as it is (no sync)."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's workers change at this commit"
                         + (" (workers leave)" if skip_sync else " (workers join)"))
        self.skip_sync = skip_sync


# ------------------------------------------------------------- collectives

_calls = itertools.count()


def _broadcast_int64(values, name):
    """Rank 0's int64 values on every worker (one small sum: the others add zeros)."""
    x = np.asarray(values, np.int64).reshape(-1)
    if not basics.is_initialized() or basics.size() <= 1:
        return x
    mine = x if basics.rank() == 0 else np.zeros_like(x)
    out = np.empty_like(mine)
    basics.core().push_pull_async(name, mine, out).wait(-1)
    return out


def broadcast_object(obj, name="bps.elastic/object"):
    """Rank 0's picklable ``obj`` on every worker (its length, then its bytes)."""
    if not basics.is_initialized() or basics.size() <= 1:
        return obj
    data = pickle.dumps(obj) if basics.rank() == 0 else b""
    length = int(_broadcast_int64([len(data)], f"{name}/length")[0])
    words = -(-length // 8)
    buf = np.zeros(words, np.int64)
    if basics.rank() == 0:
        buf.view(np.uint8)[:length] = np.frombuffer(data, np.uint8)
    # The length in the name: one key per size, as a key keeps its shape.
    got = _broadcast_int64(buf, f"{name}/{words}")
    return pickle.loads(got.view(np.uint8)[:length].tobytes())


# ------------------------------------------------------------------ states

class _HostMessages(queue.Queue):
    """Horovod's ``state._host_messages``: ``(timestamp, HostUpdateResult)``
    for each host update the scheduler sent since the queue was made. Filled
    from the core whenever it is looked at (``empty()``, ``get()``, ...), so a
    script that polls it sees an update within its poll, whatever it does in
    between."""

    def __init__(self):
        super().__init__()
        # The core keeps the updates of this membership only: a queue made at
        # a reset sees those that came with or after the new membership's
        # start. Each is taken once, known by its number and time together: a
        # restarted scheduler numbers its updates from 1 again.
        self._seen = set()

    def _pull(self):
        for seq, time_ms, flags in elastic_core.host_updates():
            if (seq, time_ms) in self._seen:
                continue
            self._seen.add((seq, time_ms))
            self.put((time_ms / 1000.0, HostUpdateResult(flags & 3)))

    def empty(self):
        self._pull()
        return super().empty()

    def qsize(self):
        self._pull()
        return super().qsize()

    def get(self, block=True, timeout=None):
        self._pull()
        return super().get(block, timeout)

    def get_nowait(self):
        return self.get(block=False)


class State:
    """What every elastic state has: reset callbacks, commit, host updates.

    ``commit()`` calls ``save()`` then ``check_host_updates()``; subclasses
    override those (a subclass's ``commit()`` is called by the Keras
    callbacks too)."""

    def __init__(self):
        self._reset_callbacks = []
        self._host_messages = _HostMessages()
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each membership restart, on
        every worker, before ``func`` runs again: rebuild what depends on
        ``size()``/``rank()`` (learning rates, data shards, traced functions)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = _HostMessages()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self):
        """What the state itself rebuilds after a restart (before the sync)."""

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's listener call: one more host update for this state."""
        self._host_messages.put((timestamp, HostUpdateResult(update_res)))

    def commit(self):
        """Saves the state as the point to roll back to, then checks for host
        updates (``HostsUpdatedInterrupt``, on every worker at once). Every
        worker must commit at the same steps."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` on every worker at the same call
        when the scheduler announced workers joining or leaving since the
        last check. Rank 0's view decides for everyone (one small broadcast),
        so every worker raises together; ``skip_sync`` is set when workers
        only leave."""
        if not elastic_core.enabled() or not basics.is_initialized():
            return
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, flags = self._host_messages.get()
            if timestamp > last:
                last = timestamp
            update |= flags
        # Milliseconds travel as integers; rank 0's (prev, last, flags) for all.
        prev_ms, last_ms, flags = (int(v) for v in _broadcast_int64(
            [round(prev * 1000), round(last * 1000), int(update)], "bps.elastic/host_updates"))
        self._last_updated_timestamp = last_ms / 1000.0
        if last_ms > prev_ms:
            raise HostsUpdatedInterrupt(HostUpdateResult(flags) == HostUpdateResult.removed)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes given as keyword arguments, committed and restored
    together, synced from rank 0."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        del get_rank      # Horovod's signature; the rank is bps_tf's own
        self._bcast_object = bcast_object or broadcast_object
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state and basics.is_initialized() and basics.size() > 1:
            self._saved_state = self._bcast_object(self._saved_state)
        self._set_attrs()


def run_fn(func, reset):
    """``func(state, ...)`` run, and run again after each membership change;
    ``reset()`` restarts this worker's membership (see hvd.elastic.run)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not elastic_core.enabled():
            state.sync()
            return func(state, *args, **kwargs)
        while True:
            try:
                # Inside: a change while the state travels is caught like any
                # other. After a restart every worker syncs, even after
                # HostsUpdatedInterrupt(skip_sync=True): a worker that a
                # failure caught inside the commit's agreement rolls back to
                # that same commit and must sync, and every worker must make
                # the same calls (the state is the same everywhere then).
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                log.warning("elastic: %s; restarting the membership with the state just "
                            "committed", exc)
            except Exception as exc:  # pylint: disable=broad-except
                if not (isinstance(exc, HorovodInternalError) or elastic_core.changed()):
                    raise
                log.warning("elastic: the workers changed (%s); restoring the last commit",
                            " ".join(str(exc).split())[:300])
                state.restore()
            reset()
            log.warning("elastic: rank %d of %d in membership epoch %d", basics.rank(),
                        basics.size(), elastic_core.epoch())
            state.on_reset()

    return wrapper


def reset_membership():
    """The membership restart of ``run``: leave this epoch and join the next;
    a worker asked to leave the job (removed, or SIGTERM) goes instead,
    with exit code 0."""
    if elastic_core.leaving():
        elastic_core.leave()
    elastic_core.restart()


def run(func):
    """``run_fn`` with the core's membership restart alone: for scripts
    without TensorFlow (bps_tf.horovod.elastic.run also drops TensorFlow's
    state of the old membership)."""
    return run_fn(func, reset_membership)
