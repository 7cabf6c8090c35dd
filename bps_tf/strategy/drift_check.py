"""The replica fingerprint of ``model.fit`` under a multi-worker BytePSStrategy.

Between two steps, every BYTEPS_FINGERPRINT_STEPS batches of a model's
training (counted across its ``fit`` calls, so short calls are checked as
well as long ones) and at the end of every ``fit`` that ran batches since
the last check, the workers compare the fingerprints of the model's
floating variables (bps_tf.comm.fingerprint): weights, synchronized moving
statistics and optimizer slots. Left out: SyncOnRead variables (metrics:
per-replica partial sums), random generators' states (different by design)
and the variables each replica keeps for itself by the user's choice
(``BytePSStrategy(sync_state=False)``: BatchNormalization's moving
statistics), which differ across workers as documented.

Batches are counted here, not read from ``optimizer.iterations``: every
worker counts the same, and the count never depends on another thread (the
overlap swaps the optimizer's iteration variable while it traces a
deferred update).
"""
from __future__ import annotations

import weakref

import tensorflow as tf

from bps_tf.comm import fingerprint, naming
from bps_tf.overlap import fit as overlap_fit

_schedules: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checked_variables(model) -> list:
    """The variables of ``model`` (and its optimizer) the check compares."""
    return [v for v in naming.model_variables(model, skip_on_read=True)
            if tf.as_dtype(v.dtype).is_floating and not _per_replica(v)]


def _per_replica(variable) -> bool:
    # The strategy marks its own variables (bps_tf.strategy.extended); a
    # Keras variable wraps one.
    return bool(getattr(variable, "bps_per_replica", False) or
                getattr(getattr(variable, "value", None), "bps_per_replica", False))


def check(model, what: str) -> None:
    """Compares the fingerprints of ``model``'s variables across workers now
    (collective: every worker calls it at the same point)."""
    overlap_fit.flush_model(model)
    variables = checked_variables(model)
    # Keyed by the count: every model of that size shares one exchange (a
    # model's count never changes once its optimizer is built).
    key = naming.strategy_key("fit", "weights", len(variables))
    fingerprint.check_owner(model, variables, key, what)


def callbacks(model) -> list:
    """Callbacks that run the checks of ``model`` in this ``fit`` (none when
    BYTEPS_FINGERPRINT_STEPS=0)."""
    if fingerprint.every() <= 0:
        return []
    import keras
    schedule = _schedules.get(model)
    if schedule is None:
        schedule = _schedules[model] = fingerprint.Schedule()

    def on_train_batch_end(batch, logs=None):
        if schedule.step():
            check(model, f"model.fit, batch {schedule.steps} of this model's training")
            schedule.checked()

    def on_train_end(logs=None):
        if schedule.end_due():
            check(model, f"model.fit, at its end (batch {schedule.steps} of this model's "
                          f"training)")
            schedule.checked()

    return [keras.callbacks.LambdaCallback(on_train_batch_end=on_train_batch_end,
                                           on_train_end=on_train_end)]
