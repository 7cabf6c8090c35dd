"""``BytePSStrategy(elastic=True)``: an unchanged ``model.fit`` that survives
membership changes (docs/elastic.md).

The strategy's ``fit`` hook (keras_hooks.py) hands an elastic strategy's fit
here; elastic_calls.py runs it in its loop, like every other Keras call. A
fit keeps a ``FitState``: the model's and optimizer's variables, the epoch to
train next and the state of the callbacks (callback_state.py), committed
when each epoch begins, before any other callback runs.

- A membership change in the middle of an epoch fails the step on every
  survivor; each restores the commit of that epoch's start, restarts its
  membership, and fit runs again from the committed epoch with the new
  replica count. That attempt is *resumed*: BackupAndRestore does not load
  its backup (the commit is newer; checkpoint_hooks.py), and the callbacks
  get their committed state back when its first epoch begins, after Keras
  has called their ``on_train_begin``.
- Workers waiting to join are admitted at an epoch's start: every worker
  leaves fit at the same commit, restarts its membership keeping the state,
  and the newcomer's fit (or, when its script is still before it, its
  replayed calls, then this fit) receives the committed state.

The rollback goes to an epoch's start because an unchanged ``fit`` cannot
start from the middle of an epoch of its dataset. The global batch is kept:
each worker trains on its share of it (batch_share.py weights the shares).
"""
from __future__ import annotations

import keras

from bps_tf.comm import exchange, naming
from bps_tf.runtime import elastic_state
from bps_tf.strategy import callback_state, checkpoint_hooks, elastic_calls


class FitState(elastic_state.State):
    """One fit call's commit: variables, the epoch to train next, whether
    the call has begun (its first epoch started) and its callbacks' state."""

    def __init__(self, model, callbacks, epoch: int):
        super().__init__()
        self.model = model
        self.callbacks = list(callbacks)
        self.epoch = int(epoch)
        self.begun = False
        self.callback_states = None
        self.epoch_logs = {}        # epoch -> its logs, for the History fit returns
        self._saved = None

    def _variables(self):
        return naming.model_variables(self.model)

    def save(self):
        self._saved = {"values": [v.numpy() for v in self._variables()], "epoch": self.epoch,
                       "begun": self.begun, "callbacks": self.callback_states,
                       "logs": dict(self.epoch_logs)}

    def commit(self):
        """At an epoch's start: the callbacks' state, the variables, then the
        check for workers waiting to join (every worker at once)."""
        self.callback_states = callback_state.capture(self.callbacks)
        self.save()
        self.check_host_updates()

    def restore(self):
        if self._saved is None:
            return
        variables = self._variables()
        if len(variables) != len(self._saved["values"]):
            raise RuntimeError(
                f"BytePSStrategy(elastic=True): the model and optimizer have {len(variables)} "
                f"variables but the commit holds {len(self._saved['values'])}; a callback that "
                f"creates variables during fit cannot be rolled back.")
        for variable, value in zip(variables, self._saved["values"]):
            variable.assign(value)
        self.epoch, self.begun = self._saved["epoch"], self._saved["begun"]
        self.callback_states = self._saved["callbacks"]
        self.epoch_logs = dict(self._saved["logs"])

    def synced(self, root, name):
        """After the variables' sync: ``root``'s epoch, progress and callback
        state (None: nothing to take, the workers start this call alike);
        then this is the commit to roll back to."""
        if root is not None:
            theirs = exchange.broadcast_object(
                {"epoch": self.epoch, "begun": self.begun, "callbacks": self.callback_states,
                 "logs": self.epoch_logs}, root_rank=root, name=name)
            self.epoch, self.begun = int(theirs["epoch"]), bool(theirs["begun"])
            self.callback_states, self.epoch_logs = theirs["callbacks"], dict(theirs["logs"])
        self.save()


class _EpochCommit(keras.callbacks.Callback):
    """First in fit's callbacks: commits when each epoch begins (after every
    other callback saw the epoch before end); in a resumed attempt, first
    gives the callbacks their committed state back."""

    def __init__(self, state: FitState, resumed: bool):
        super().__init__()
        self.state = state
        self._restore = resumed

    def on_epoch_begin(self, epoch, logs=None):
        if self._restore:
            self._restore = False
            callback_state.restore(self.state.callbacks, self.state.callback_states)
        self.state.epoch = epoch
        self.state.begun = True
        self.state.commit()


class _EpochLogs(keras.callbacks.Callback):
    """Each epoch's logs into the state, so the History fit returns covers
    every epoch of the call once, as trained last, on every worker (a
    newcomer receives those before it joined with the state). After the
    user's callbacks, as Keras' History: it sees what they add."""

    def __init__(self, state: FitState):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch_logs[epoch] = dict(logs or {})

    def into(self, history):
        found = self.state.epoch_logs
        epochs = sorted(found)
        history.epoch = epochs
        keys = sorted({k for e in epochs for k in found[e]})
        history.history = {k: [found[e].get(k) for e in epochs] for k in keys}
        return history


def run_fit(model, strategy, arguments, start):
    """``start(initial_epoch, first, last)`` runs one attempt of the original
    fit with the callbacks ``first`` before the user's and ``last`` after
    them; returns its History."""
    callback_state.install()
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)   # its slots take part in every sync
    state = FitState(model, arguments.get("callbacks") or [],
                     int(arguments.get("initial_epoch") or 0))
    logs = _EpochLogs(state)

    def attempt():
        resumed = state.begun
        with checkpoint_hooks.resuming(model, resumed):
            history = start(state.epoch, [_EpochCommit(state, resumed)], [logs])
        return logs.into(history)

    return elastic_calls.run(elastic_calls.FIT, model, strategy, attempt, fit_state=state)
