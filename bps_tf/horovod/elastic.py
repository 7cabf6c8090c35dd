"""Horovod's elastic API (``hvd.elastic``): state objects and ``run``.

``TensorFlowState(variables, **attrs)`` and ``TensorFlowKerasState(model,
optimizer, **attrs)`` (``KerasState``) keep a copy of the variables (and of
plain attributes such as ``batch`` and ``epoch``); ``ObjectState(**attrs)``
only the attributes. ``commit()`` takes a new copy and checks for workers
waiting to join, ``restore()`` puts the last copy back, ``sync()`` gives
every worker rank 0's values (then takes a copy).

``run(func)`` makes ``func(state, ...)`` elastic under ``BYTEPS_ELASTIC=1``
(``bpslaunch --min-np/--max-np``, docs/elastic.md): when the workers change
(a worker was lost, or failed), every survivor's pending operation fails with
``WorkersChangedError`` (a ``HorovodInternalError``); ``run`` restores the
last commit, restarts the worker's membership (dense ranks, the survivors in
the order of their old ranks, the new ``size()``), syncs the state from the
new rank 0 and calls ``func`` again. When workers wait to join, the next
``commit()`` raises ``HostsUpdatedInterrupt`` on every worker at the same
step; ``run`` then restarts the membership keeping the state just
committed, and the newcomers receive it through ``sync()``. Without
``BYTEPS_ELASTIC=1`` ``run`` syncs and calls ``func`` once: a lost worker
fails the job, as it always does.
"""
from __future__ import annotations

import functools
import logging

import tensorflow as tf

from bps_tf.comm import collectives, fingerprint, naming
from bps_tf.runtime import basics, elastic_core, messages, process_sets

__all__ = ["ObjectState", "State", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "HorovodInternalError", "HostsUpdatedInterrupt", "WorkersChangedError", "run"]

log = logging.getLogger("bps_tf")


class HorovodInternalError(RuntimeError):
    """Horovod's name for a collective that failed because the workers changed."""


class WorkersChangedError(HorovodInternalError):
    """The membership changed under a pending operation (a worker was lost or
    left): roll back to the last commit; ``run`` does it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Workers wait to join: raised by ``commit()``/``check_host_updates()`` on
    every worker at the same commit. ``skip_sync``: whether the state needs
    no sync afterwards (only when workers were removed, never here: a
    newcomer always needs the state)."""

    def __init__(self, skip_sync=False):
        super().__init__("workers are waiting to join the elastic job")
        self.skip_sync = skip_sync


class State:
    """What every elastic state has: reset callbacks, commit, host updates."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each membership restart, on
        every worker, before ``func`` runs again: rebuild what depends on
        ``size()``/``rank()`` (learning rates, data shards, traced functions)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._on_reset()
        for callback in self._reset_callbacks:
            callback()

    def _on_reset(self):
        """What the state itself rebuilds after a restart."""

    def commit(self):
        """Saves the state as the point to roll back to, then checks for
        workers waiting to join (``HostsUpdatedInterrupt``, on every worker
        at once). Every worker must commit at the same steps."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` on every worker when the scheduler
        has workers waiting to join; the workers agree in one small sum, so
        they all raise it at the same call."""
        if not elastic_core.enabled() or not basics.is_initialized():
            return
        waiting = elastic_core.workers_waiting()
        if basics.size() > 1:
            from bps_tf.horovod.api import Max, allreduce
            waiting = int(allreduce(tf.constant(waiting, tf.int32), op=Max,
                                    name="bps.elastic/host_updates").numpy())
        if waiting > 0:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes given as keyword arguments, committed and restored
    together, synced from rank 0 with ``broadcast_object``."""

    def __init__(self, **kwargs):
        self._saved_state = dict(kwargs)
        super().__init__()
        self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state and basics.is_initialized() and basics.size() > 1:
            from bps_tf.horovod.api import broadcast_object
            self._saved_state = broadcast_object(self._saved_state, root_rank=0,
                                                 name="bps.elastic/object_state")
        self._set_attrs()


class TensorFlowState(ObjectState):
    """Variables (eager) plus attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs its variables (eager code has no "
                             "global variables).")
        del session
        self.variables = list(variables)
        self._save_model()
        super().__init__(**kwargs)

    def _save_model(self):
        self._values = [v.numpy() for v in self.variables]

    def _load_model(self):
        for var, value in zip(self.variables, self._values):
            var.assign(value)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        from bps_tf.horovod.api import broadcast_variables
        if basics.is_initialized() and basics.size() > 1:
            broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model's (and optimizer's) variables plus attributes. After a
    membership restart the model's traced train/test/predict functions are
    dropped, so the next ``fit`` traces them for the new ``size()``."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        del backend
        self.model = model
        self.optimizer = optimizer if optimizer is not None else \
            getattr(model, "optimizer", None)
        self._known = set()
        super().__init__(variables=self._all_variables(), **kwargs)

    def _all_variables(self):
        variables = list(self.model.variables)
        # naming: a tf_keras legacy optimizer's variables are a method
        variables += [v for v in naming.optimizer_variables(self.optimizer)
                      if not any(v is m for m in variables)]
        return variables

    def _save_model(self):
        # An optimizer builds its slots at its first step: take them in.
        self.variables = self._all_variables()
        super()._save_model()

    def _load_model(self):
        now = self._all_variables()
        if len(now) != len(self._values):
            raise RuntimeError(
                f"TensorFlowKerasState.restore: the model and optimizer have {len(now)} "
                f"variables but the commit holds {len(self._values)}; commit after the "
                f"optimizer's first step (CommitStateCallback does).")
        self.variables = now
        super()._load_model()

    def sync(self):
        self.variables = self._all_variables()
        super().sync()

    def _on_reset(self):
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)


KerasState = TensorFlowKerasState


def reset():
    """Horovod's reset: leave this membership epoch and join the next one."""
    elastic_core.restart()
    collectives.drop_pending()            # split sums started in the old epoch
    process_sets.register_at_init(None)   # process sets name ranks of the old epoch
    fingerprint.reset_steps()             # every worker counts steps from here alike


def run(func):
    """Horovod's ``hvd.elastic.run``: ``func(state, *args, **kwargs)`` is run,
    and run again after each membership change (see the module's text)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not elastic_core.enabled():
            state.sync()
            return func(state, *args, **kwargs)
        skip_sync = False
        while True:
            try:
                # Inside: a change while the state travels is caught like any other.
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                log.warning("elastic: workers wait to join; restarting the membership "
                            "with the state just committed")
                skip_sync = exc.skip_sync
            except Exception as exc:  # pylint: disable=broad-except
                if not (isinstance(exc, HorovodInternalError) or elastic_core.changed()):
                    raise
                log.warning("elastic: the workers changed (%s); restoring the last commit",
                            messages.one_line(exc))
                state.restore()
                skip_sync = False
            reset()
            log.warning("elastic: rank %d of %d in membership epoch %d", basics.rank(),
                        basics.size(), elastic_core.epoch())
            state.on_reset()

    return wrapper
