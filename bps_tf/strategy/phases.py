"""Every worker is in the same Keras phase: checked at each boundary.

Workers of a synchronous job must make the same push_pulls in the same
order. A rank-dependent script (``epochs=args.epochs + rank``, an
``evaluate`` on rank 0 only, an early stop on one worker) breaks that, and
used to hang until a stall timeout named internal keys. Under a multi-worker
``BytePSStrategy``, the start of each ``fit``, ``evaluate`` and ``predict``
call and the end of each epoch is one small exchange of what every worker is
doing -- before any other collective of that phase, so the n-th boundary of
one worker always meets the n-th of every other -- and a worker that is
somewhere else fails at once, on every worker, with a message in Keras'
terms ("worker 1 started fit with epochs=4 while worker 0 started fit with
epochs=3").
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.runtime import basics

FIT, EPOCH_END, EVALUATE, PREDICT = 1, 2, 3, 4
_COLUMNS = 5      # phase, call, and three numbers of the phase


class PhaseMismatchError(RuntimeError):
    """The workers reached different Keras phases: a rank-dependent script."""


class PhaseCallback:
    """Added last to ``fit``'s callbacks: the end of each epoch (after the
    user's callbacks, which may stop training) is a boundary."""

    def __init__(self, strategy, epochs: int):
        self._strategy = strategy
        self._epochs = epochs
        self.model = None

    def on_epoch_end(self, epoch, logs=None):
        stops = bool(getattr(self.model, "stop_training", False)) or epoch + 1 >= self._epochs
        boundary(self._strategy, EPOCH_END, epoch, int(stops))


_count = itertools.count()
_lock = threading.Lock()


def _number(value) -> int:
    return -1 if value is None else int(value)


def describe(row) -> str:
    phase, _, a, b, c = (int(v) for v in row[:_COLUMNS])
    if phase == FIT:
        text = f"started fit with epochs={a}, initial_epoch={b}"
        return text + (f", steps_per_epoch={c}" if c >= 0 else "")
    if phase == EPOCH_END:
        return f"ended epoch {a + 1} of fit and " + (
            "stops training" if b else f"goes on to epoch {a + 2}")
    name = {EVALUATE: "evaluate", PREDICT: "predict"}.get(phase, f"phase {phase}")
    return f"started {name}" + (f" with steps={a}" if a >= 0 else "")


_fit_epochs = {"total": 0}   # of the last fit started (for activity)


def activity(row) -> str:
    """What a worker at this boundary goes on to do, as its stall warnings
    say it ("fit, epoch 4 of 10", "evaluate")."""
    phase, _, a, b, _ = (int(v) for v in row[:_COLUMNS])
    if phase == FIT:
        _fit_epochs["total"] = a
        return f"fit, epoch {max(b, 0) + 1} of {a}"
    total = _fit_epochs["total"]
    if phase == EPOCH_END:
        return f"the end of fit (after epoch {a + 1} of {total})" if b else \
            f"fit, epoch {a + 2} of {total}"
    return {EVALUATE: "evaluate", PREDICT: "predict"}.get(phase, "")


def boundary(strategy, phase: int, a=None, b=None, c=None) -> None:
    """One exchange of (phase, call, a, b, c) with every worker; raises
    PhaseMismatchError on every worker if one of them is elsewhere."""
    if strategy is None or strategy.num_workers <= 1 or getattr(strategy, "mode", "") == "async":
        return
    size, rank = basics.size(), basics.rank()
    with _lock:
        call = next(_count)
    mine = np.array([[phase, call, _number(a), _number(b), _number(c)]], np.int64)
    basics.set_activity(activity(mine[0]))
    table = tf.scatter_nd([[rank]], tf.constant(mine), [size, _COLUMNS])
    # One name for every boundary: the n-th exchange of each worker meets
    # the n-th of the others, whatever phase each is in.
    rows = collectives.push_pull_sum(table, naming.strategy_key("phase", "boundary"),
                                     collectives.BLOCKING_PRIORITY).numpy()
    if all((rows[r] == rows[0]).all() for r in range(size)):
        return
    other = next(r for r in range(size) if not (rows[r] == rows[rank]).all())
    shown = "; ".join(f"worker {r} {describe(rows[r])}" for r in range(size))
    raise PhaseMismatchError(
        f"BytePSStrategy: the workers are in different phases of training: worker {rank} "
        f"{describe(rows[rank])} while worker {other} {describe(rows[other])} ({shown}). "
        f"Every worker must call fit/evaluate/predict alike, with the same arguments, and "
        f"stop training at the same epoch; look for a value that depends on the rank "
        f"(epochs=, an evaluate on rank 0 only, a callback that stops one worker).")


def restart_count() -> None:
    """Elastic: after a membership restart every worker, a newcomer too,
    numbers its boundaries from zero again."""
    global _count
    with _lock:
        _count = itertools.count()
