"""Every worker is in the same Keras phase: checked at each boundary.

Workers of a synchronous job must make the same push_pulls in the same
order. A rank-dependent script (``epochs=args.epochs + rank``, an
``evaluate`` on rank 0 only) breaks that, and used to hang until a stall
timeout named internal keys. Under a multi-worker ``BytePSStrategy``, each
``fit``, ``evaluate`` and ``predict`` call, each epoch's start and each
``fit``'s end is one small exchange of what every worker is doing (phase,
call, epoch, steps): the n-th boundary of one worker meets the n-th of every
other, so a worker that is somewhere else fails at once, on every worker,
with a message in Keras' terms ("worker 1 started epoch 4 of fit while
worker 0 ended fit after epoch 3").
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.runtime import basics

# What a worker can be doing at a boundary.
FIT, EPOCH, FIT_END, EVALUATE, PREDICT = 1, 2, 3, 4, 5
_NAMES = {FIT: "started fit", EPOCH: "started epoch", FIT_END: "ended fit",
          EVALUATE: "started evaluate", PREDICT: "started predict"}


class PhaseMismatchError(RuntimeError):
    """The workers reached different Keras phases: a rank-dependent script."""


class PhaseCallback:
    """Added to ``fit``'s callbacks: each epoch's start and the end of
    training are boundaries (Keras calls the methods it finds)."""

    def __init__(self, strategy):
        self._strategy = strategy

    def on_epoch_begin(self, epoch, logs=None):
        boundary(self._strategy, EPOCH, epoch)

    def on_train_end(self, logs=None):
        boundary(self._strategy, FIT_END)


_count = itertools.count()
_lock = threading.Lock()
_where = {"phase": 0, "epoch": -1}       # this worker's last boundary (for messages)


def describe(row) -> str:
    phase, _, epoch, steps = (int(v) for v in row[:4])
    text = _NAMES.get(phase, f"phase {phase}")
    if phase == EPOCH:
        text += f" {epoch + 1} of fit"
    elif phase == FIT_END:
        text += f" after epoch {epoch + 1}" if epoch >= 0 else ""
    elif epoch >= 0:
        text += f" (last fit epoch {epoch + 1})"
    if steps > 0:
        text += f", {steps} steps"
    return text


def boundary(strategy, phase: int, epoch: int = -1, steps=None) -> None:
    """One exchange of (phase, call, epoch, steps) with every worker; raises
    PhaseMismatchError on every worker if one of them is elsewhere."""
    if strategy is None or strategy.num_workers <= 1 or getattr(strategy, "mode", "") == "async":
        return
    size, rank = basics.size(), basics.rank()
    with _lock:
        call = next(_count)
        if phase == EPOCH:
            _where["epoch"] = epoch
        elif phase == FIT:
            _where["epoch"] = -1
        epoch = epoch if epoch >= 0 else _where["epoch"]
    mine = np.array([[phase, call, epoch, int(steps or 0)]], np.int64)
    table = tf.scatter_nd([[rank]], tf.constant(mine), [size, 4])
    # One name for every boundary: the n-th exchange of each worker meets
    # the n-th of the others, whatever phase each is in.
    rows = collectives.push_pull_sum(table, naming.strategy_key("phase", "boundary"),
                                     collectives.BLOCKING_PRIORITY).numpy()
    # Steps may differ (an unsized epoch); the phase, call and epoch may not.
    if all((rows[r, :3] == rows[0, :3]).all() for r in range(size)):
        return
    shown = "; ".join(f"worker {r} {describe(rows[r])}" for r in range(size))
    others = [r for r in range(size) if not (rows[r, :3] == rows[rank, :3]).all()]
    raise PhaseMismatchError(
        f"BytePSStrategy: the workers are in different phases of training: {shown}. Every "
        f"worker must call fit/evaluate/predict alike, with the same epochs (worker {rank} "
        f"{describe(rows[rank])} while worker {others[0]} {describe(rows[others[0]])}); "
        f"look for a value that depends on the rank (epochs=, an evaluate on rank 0 only).")
