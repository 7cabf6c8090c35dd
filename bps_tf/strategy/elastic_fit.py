"""``BytePSStrategy(elastic=True)``: an unchanged ``model.fit`` that survives
membership changes (docs/elastic.md).

The strategy's ``fit`` hook (keras_hooks.py) hands an elastic strategy's fit
here. Each ``fit`` call keeps a ``KerasState`` of the model (weights,
optimizer slots and iterations) and of the next epoch to train, committed at
the end of every epoch, and runs the original ``fit`` inside Horovod's
elastic loop (bps_tf.horovod.elastic.run's steps):

- a membership change in the middle of an epoch fails the step on every
  survivor; each restores the last commit (the end of the last epoch),
  restarts its membership, the strategy takes the new worker count and
  rank (``num_replicas_in_sync``, the input shards, the cross-device ops),
  Keras' traced functions are dropped, and ``fit`` goes on from the
  committed epoch with the new replica count;
- workers waiting to join are admitted at an epoch's end: every worker
  leaves ``fit`` at the same commit, restarts its membership keeping the
  state, and the newcomer (whose own ``fit`` call waits in the same loop)
  receives the committed state before anyone trains on.

The rollback goes to an epoch's start because an unchanged ``fit`` cannot
start from the middle of an epoch of its dataset. The per-worker batch is
kept: the global batch follows the worker count.
"""
from __future__ import annotations

import logging

import keras

from bps_tf.horovod import elastic as hvd_elastic
from bps_tf.runtime import basics, elastic_core, messages
from bps_tf.strategy import choices as strategy_choices
from bps_tf.strategy import phases

log = logging.getLogger("bps_tf")


class _EpochCommit(keras.callbacks.Callback):
    """state.epoch = the next epoch; committed when it begins (after every
    other callback saw the epoch end) and when training ends."""

    def __init__(self, state, strategy):
        super().__init__()
        self.state = state
        self.strategy = strategy
        self._due = False

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
        self._due = True

    def on_epoch_begin(self, epoch, logs=None):
        if self._due:
            self._due = False
            self.state.commit()

    def on_train_end(self, logs=None):
        if self._due:
            self._due = False
            self.state.save()   # the end: no one waits for a commit any more


class _EpochLogs(keras.callbacks.Callback):
    """Each epoch's logs, so the History fit returns covers every attempt
    (an epoch rolled back and trained again counts once, as trained last)."""

    def __init__(self):
        super().__init__()
        self.logs = {}

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs or {})

    def drop_from(self, epoch):
        self.logs = {e: v for e, v in self.logs.items() if e < epoch}

    def into(self, history):
        epochs = sorted(self.logs)
        history.epoch = epochs
        keys = sorted({k for e in epochs for k in self.logs[e]})
        history.history = {k: [self.logs[e].get(k) for e in epochs] for k in keys}
        return history


def refresh(strategy) -> None:
    """The strategy takes the new membership: worker count, rank, and the
    choices every worker must share (agreed again, with any newcomer)."""
    extended = strategy.extended
    extended._num_workers = basics.size()     # pylint: disable=protected-access
    extended._rank = basics.rank()            # pylint: disable=protected-access
    ops = extended._push_pull_ops              # pylint: disable=protected-access
    ops._num_workers, ops._rank = basics.size(), basics.rank()  # pylint: disable=protected-access
    strategy._bps_cluster_resolver = None      # pylint: disable=protected-access
    strategy.overlap, early = strategy_choices.agreed(False, False,
                                                      len(extended.worker_devices))
    extended.bps_early_data_check = early and extended._in_multi_worker_mode()  # pylint: disable=protected-access


def run_fit(model, strategy, arguments, start):
    """``start(initial_epoch, extra_callbacks)`` runs one attempt of the
    original fit; returns its History."""
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)   # its slots take part in every sync
    state = hvd_elastic.TensorFlowKerasState(model, epoch=int(arguments.get("initial_epoch") or 0))
    commit = _EpochCommit(state, strategy)
    logs = _EpochLogs()
    while True:
        try:
            state.sync()   # rank 0's committed state: a newcomer's first, everyone's after a change
            logs.drop_from(state.epoch)
            return logs.into(start(state.epoch, [commit, logs]))
        except hvd_elastic.HostsUpdatedInterrupt:
            log.warning("elastic fit: workers wait to join; going on with them from epoch %d",
                        state.epoch + 1)
        except Exception as exc:  # pylint: disable=broad-except
            if not (isinstance(exc, hvd_elastic.HorovodInternalError) or elastic_core.changed()):
                raise
            state.restore()
            log.warning("elastic fit: the workers changed; back to the commit of epoch %d (%s)",
                        state.epoch, messages.one_line(exc))
        hvd_elastic.reset()
        phases.restart_count()
        refresh(strategy)
        state.on_reset()
        log.warning("elastic fit: rank %d of %d, %d replicas in sync", basics.rank(),
                    basics.size(), strategy.num_replicas_in_sync)
