"""Elastic state of TensorFlow objects, and the membership restart that
drops what TensorFlow kept of the old membership.

Both faces build on this: the Horovod face's ``hvd.elastic``
(bps_tf.horovod.elastic re-exports it with Horovod's names) and the
strategy's elastic Keras calls (bps_tf.strategy.elastic_calls). The state
classes without TensorFlow (``State``, ``ObjectState``, the interrupts and
``run_fn``) are in bps_tf.runtime.elastic_state.
"""
from __future__ import annotations

from bps_tf.comm import collectives, exchange, fingerprint, naming
from bps_tf.runtime import basics, process_sets
from bps_tf.runtime.elastic_state import ObjectState, reset_membership, run_fn

__all__ = ["TensorFlowState", "TensorFlowKerasState", "KerasState", "reset", "run"]


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
        if basics.is_initialized() and basics.size() > 1:
            exchange.broadcast_variables(self.variables, root_rank=0)
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

    def reset(self):
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)


KerasState = TensorFlowKerasState


def reset():
    """Horovod's reset: leave this membership epoch and join the next one (a
    worker removed from the job leaves it instead, with exit code 0)."""
    reset_membership()
    collectives.drop_pending()            # split sums started in the old epoch
    process_sets.register_at_init(None)   # process sets name ranks of the old epoch
    fingerprint.reset_steps()             # every worker counts steps from here alike


def run(func):
    """``func(state, *args, **kwargs)`` run, and run again after each
    membership change, with :func:`reset` as the restart."""
    return run_fn(func, reset)
