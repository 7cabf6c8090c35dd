"""Keras 3 callbacks with Horovod's names and arguments.

They also run under tf_keras' ``fit`` (Keras 2, ``TF_USE_LEGACY_KERAS=1``):
``_KerasCallback`` adds the three hooks tf_keras asks every callback for.

Keras 3 differences that shape them:

* the learning rate is ``optimizer.learning_rate``, a variable, set with
  ``.assign``; an optimizer built with a ``LearningRateSchedule`` has no
  settable rate, so the learning-rate callbacks refuse it with a clear error;
* ``momentum`` is a Python float captured when the train step is traced, so
  Horovod's momentum correction cannot work: ``momentum_correction`` is
  accepted and ignored. A tf_keras legacy optimizer
  (``tf.keras.optimizers.legacy.*``) keeps momentum in a variable it reads
  at every step, and there the correction works as in Horovod.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from bps_tf.comm.naming import model_variables
from bps_tf.horovod import api
from bps_tf.runtime import basics


class _KerasCallback(keras.callbacks.Callback):
    """A Keras 3 callback that tf_keras' CallbackList also accepts: it asks
    each callback which batch hooks it implements (True: we don't know, so
    call them all; Keras 3 ignores these)."""

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return True

    def _implements_predict_batch_hooks(self):
        return True


class BroadcastGlobalVariablesCallback(_KerasCallback):
    """Makes every worker start from ``root_rank``'s model and optimizer state.

    At train begin it broadcasts the variables that exist (``fit`` has built
    the model and usually the optimizer by then); optimizer variables that
    appear only with the first step are broadcast after the first batch (and
    everything is, for a tf_keras model ``fit`` builds in its first step).
    ``local_variables`` (Horovod's): variables each worker keeps its own
    value of, never broadcast. ``device`` is accepted for compatibility.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self._local_ids = {id(v) for v in (local_variables or [])}
        self._done_ids = None     # ids of the variables broadcast so far
        self._late_done = False   # the after-first-batch pass has run

    def _all_variables(self):
        return [v for v in model_variables(self.model) if id(v) not in self._local_ids]

    def _broadcast(self, variables):
        with tf.device(self.device):
            api.broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs=None):
        if self._done_ids is not None:
            return    # a later fit() call: the workers already agree
        if not getattr(self.model, "built", True):
            # tf_keras builds a model given no input shape in its first step
            # (Keras 3 builds it before this): then everything is broadcast
            # after the first batch, as Horovod's callback always does.
            self._done_ids = set()
            return
        variables = self._all_variables()
        self._broadcast(variables)
        self._done_ids = {id(v) for v in variables}

    def on_train_batch_end(self, batch, logs=None):
        if self._done_ids is None or self._late_done:
            return
        self._late_done = True
        late = [v for v in self._all_variables() if id(v) not in self._done_ids]
        if late:   # every worker builds the same variables, so all agree on this
            self._broadcast(late)
            self._done_ids.update(id(v) for v in late)


class MetricAverageCallback(_KerasCallback):
    """Averages the epoch-end logs over workers, in place, so every worker
    (and later callbacks such as checkpoints) sees global metrics. Keys are
    sorted so every worker reduces the same vector; non-numeric entries are
    left alone. Place it before callbacks that read the logs."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        with tf.device(self.device):
            # One push_pull for all metrics; the name lists them, so workers
            # with different metrics never sum unrelated values.
            averaged = api.push_pull(values, name="MetricAverage/" + ",".join(keys),
                                     op=api.Average).numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_number(value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, float, np.integer, np.floating)):
        return True
    return (isinstance(value, (np.ndarray, tf.Tensor)) and value.shape == ()
            and not value.dtype == bool)


class LearningRateScheduleCallback(_KerasCallback):
    """Sets ``lr = initial_lr * multiplier(epoch)`` for
    ``start_epoch <= epoch < end_epoch``.

    ``multiplier`` is a number or a function of the epoch. With
    ``staircase=True`` the rate changes at epoch starts (integer epochs);
    otherwise at every batch, with a fractional epoch
    ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` defaults to the
    one ``fit`` reports). With ``momentum_correction`` (and a tf_keras
    legacy optimizer with momentum) the batch where the rate changes runs
    with momentum scaled by new rate / old rate, as in Horovod; Keras 3
    optimizers and tf_keras' current ones trace momentum as a constant, so
    there it has no effect.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda _e, m=multiplier: m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self._restore_momentum = None

    def _lr_variable(self):
        # A float learning rate is a variable (Keras 3 and tf_keras, legacy
        # optimizers included); a schedule is computed, and cannot be set.
        rate = self.model.optimizer.learning_rate
        if not hasattr(rate, "assign"):
            raise TypeError(
                f"{type(self).__name__}: the optimizer's learning rate is a "
                "LearningRateSchedule, which cannot be set; build the optimizer "
                "with a float learning_rate, or drop this callback.")
        return rate

    def _in_range(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_lr(self, epoch) -> None:
        rate = self._lr_variable()
        old, new = float(np.asarray(rate)), self.initial_lr * self.multiplier(epoch)
        rate.assign(new)
        momentum = self._momentum_variable()
        if momentum is not None and old != 0.0 and new != old and self._restore_momentum is None:
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new / old)

    def _momentum_variable(self):
        """The momentum a tf_keras legacy optimizer reads at every step (a
        variable once the optimizer is built), else None."""
        if not self.momentum_correction:
            return None
        # tf_keras' legacy optimizers answer a hyperparameter by name (their
        # variable once built); Keras 3's momentum is a plain number.
        hyper = getattr(self.model.optimizer, "momentum", None)
        return hyper if isinstance(hyper, tf.Variable) else None

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self._momentum_variable().assign(self._restore_momentum)
            self._restore_momentum = None

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(f"{type(self).__name__}: pass steps_per_epoch "
                             "(fit could not tell the number of steps).")
        return int(steps)

    def on_train_begin(self, logs=None):
        self._lr_variable()   # fail before the first step, not in the middle

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set_lr(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or self.current_epoch is None:
            return
        epoch = self.current_epoch + batch / self._steps()
        if self._in_range(epoch):
            self._set_lr(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(np.asarray(self._lr_variable()))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` to ``initial_lr``
    over ``warmup_epochs``, updated every batch:

        lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)

    with a fractional ``epoch``. ``initial_lr`` is the rate for the whole job
    (usually the single-worker rate times ``size``).
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        size = basics.size()

        def multiplier(epoch):
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            # The last warmup batch stops just short of the target.
            self._lr_variable().assign(self.initial_lr)
            if self.verbose and basics.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup "
                      f"to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)
