"""The state objects of Horovod's elastic API (``hvd.elastic``), without the
elastic driver.

``TensorFlowState(variables, **attrs)`` and ``KerasState(model, optimizer,
**attrs)`` keep a copy of the variables (and of plain attributes such as
``batch`` and ``epoch``): ``commit()`` takes a new copy, ``restore()`` puts
the last one back, ``sync()`` gives every worker rank 0's values (then takes
a copy). bps_tf has no elastic training (a lost worker fails the job, which
restarts from a checkpoint), so ``run`` refuses, naming what to do instead.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import naming
from bps_tf.runtime import basics

__all__ = ["ObjectState", "TensorFlowState", "KerasState", "run"]


class ObjectState:
    """Plain attributes given as keyword arguments, committed and restored
    together, synced from rank 0 with ``broadcast_object``."""

    def __init__(self, **kwargs):
        self._saved_state = dict(kwargs)
        self._reset_callbacks = []
        self._set_attrs()

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def commit(self):
        self.save()

    def check_host_updates(self):
        """No host changes without an elastic driver."""

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            from bps_tf.horovod.api import broadcast_object
            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
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
        if basics.size() > 1:
            broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()


class KerasState(TensorFlowState):
    """A Keras model's (and optimizer's) variables plus attributes."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        del backend
        self.model = model
        self.optimizer = optimizer if optimizer is not None else \
            getattr(model, "optimizer", None)
        variables = list(model.variables)
        # naming: a tf_keras legacy optimizer's variables are a method
        variables += [v for v in naming.optimizer_variables(self.optimizer)
                      if not any(v is m for m in variables)]
        super().__init__(variables=variables, **kwargs)


def run(func):
    """Horovod's elastic loop needs an elastic driver, which bps_tf has not."""
    raise NotImplementedError(
        "bps_tf.elastic.run: elastic training is not available (a lost worker fails the "
        "job; restart it from a checkpoint, see docs/reliability.md). The state objects "
        "(TensorFlowState, KerasState) work for commit/restore/sync.")
