"""``hvd.elastic`` of ``horovod.tensorflow.keras``: the state objects and
``run`` (bps_tf.horovod.elastic) plus Horovod's Keras callbacks.

A Horovod elastic Keras script runs with its import changed::

    import bps_tf.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(data, initial_epoch=state.epoch, epochs=EPOCHS, callbacks=callbacks)
    train(state)

What the callbacks record (docs/elastic.md): ``state.epoch`` is the epoch to
train next (the last one finished + 1, in ``fit``'s own numbering whether the
script passes ``initial_epoch=state.epoch`` or ``epochs=EPOCHS - state.epoch``);
``state.batch`` is how many batches of ``state.epoch`` are trained (a script
that resumes mid-epoch skips them). A commit is taken once every callback of
a batch or epoch has run, so it never holds an epoch's weights with the
epoch still to train.
"""
from __future__ import annotations

import keras

from bps_tf.horovod.elastic import *  # noqa: F401,F403
from bps_tf.horovod.elastic import __all__ as _state_names
from bps_tf.runtime.config import tf_keras_enabled

__all__ = list(_state_names) + ["CommitStateCallback", "UpdateBatchStateCallback",
                                "UpdateEpochStateCallback"]


def _callback_base():
    """The Callback class of the Keras that ``fit`` is: tf_keras' under
    TF_USE_LEGACY_KERAS=1 (Horovod's Keras scripts, whose CallbackList asks
    for tf_keras' hooks), Keras 3's otherwise."""
    if tf_keras_enabled():
        import tensorflow as tf  # tf.keras is tf_keras here
        return tf.keras.callbacks.Callback
    return keras.callbacks.Callback


_Callback = _callback_base()


class CommitStateCallback(_Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of
    every epoch and of training (Horovod's). A commit also checks for workers
    waiting to join: ``HostsUpdatedInterrupt`` leaves ``fit`` on every worker
    at the same batch, and ``hvd.elastic.run`` admits them.

    The commit runs when the next batch or epoch begins (or training ends),
    after every other callback saw the batch or epoch that ended: the
    committed ``epoch``/``batch`` always match the committed weights."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit={batches_per_commit} "
                             f"must be at least 1.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._count = 0
        self._due = False

    def commit(self):
        """Commits the state (Horovod's hook: a subclass may count or extend it)."""
        self.state.commit()

    def _commit_if_due(self):
        if self._due:
            self._due = False
            self.commit()

    def on_train_begin(self, logs=None):
        self._count, self._due = 0, False

    def on_batch_end(self, batch, logs=None):
        self._count += 1
        if self._count % self.batches_per_commit == 0:
            self._due = True

    def on_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_train_end(self, logs=None):
        self._commit_if_due()

    on_train_batch_begin = on_batch_begin
    on_train_batch_end = on_batch_end


class UpdateBatchStateCallback(_Callback):
    """Keeps ``state.batch`` = batches of the current epoch trained (0 again
    at each epoch's end). Counts from the ``state.batch`` a resumed ``fit``
    starts with, so a script that skips those batches keeps an exact count."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = int(getattr(self.state, "batch", 0) or 0)

    def on_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._offset = 0

    on_train_batch_end = on_batch_end


class UpdateEpochStateCallback(_Callback):
    """Keeps ``state.epoch`` = the next epoch to train: one more than the last
    finished, counted from the ``state.epoch`` this ``fit`` started at."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._start = 0
        self._first = None

    def on_train_begin(self, logs=None):
        self._start = int(getattr(self.state, "epoch", 0) or 0)
        self._first = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._start + (epoch - self._first) + 1
