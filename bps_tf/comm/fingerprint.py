"""Replica fingerprints: workers whose weights drifted apart fail, naming the variable.

Data-parallel training keeps every worker's copy of the model identical:
each applies the same summed gradient. A worker that skips one exchange and
applies its own gradient, a callback that changes a weight on one worker,
two workers that paired tensors wrongly -- from then on every sum mixes
different models, and nothing else notices. Every ``BYTEPS_FINGERPRINT_STEPS``
steps (default 100; 0: off) each worker takes an exact fingerprint of each
variable it trains (the sum of the value's bit patterns, so any difference
in any bit shows), the workers exchange them in one small push_pull (a
table with one row per worker), and each compares the rows: a difference
fails the step on every worker with an error naming the variables, the
ranks and the fingerprints.

Used by the gradient reductions of ``DistributedGradientTape``, the TF1
``DistributedOptimizer`` (in their traced step, or eagerly) and by
``model.fit`` under ``BytePSStrategy`` (between steps).
"""
from __future__ import annotations

import threading
from typing import Dict, List, Sequence

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, membership, naming
from bps_tf.runtime import basics, config

_SHOWN = 3      # variables named in full in the error


class ReplicasDriftedError(RuntimeError):
    """Workers that should hold identical variables do not."""


def every() -> int:
    """Steps between two checks (0: no checks)."""
    return int(config.value("BYTEPS_FINGERPRINT_STEPS"))


def _bits(value) -> tf.Tensor:
    """The sum of ``value``'s bit patterns as int64 (wrapping): equal
    values give equal sums, and a change of any one bit changes it."""
    value = tf.convert_to_tensor(value)
    dtype = value.dtype
    if dtype in (tf.float32, tf.int32, tf.uint32):
        words = tf.bitcast(value, tf.int32)
    elif dtype in (tf.float16, tf.bfloat16, tf.int16, tf.uint16):
        words = tf.bitcast(value, tf.int16)
    elif dtype in (tf.float64, tf.int64, tf.uint64):
        words = tf.bitcast(value, tf.int64)
    elif dtype in (tf.bool, tf.int8, tf.uint8):
        words = value
    else:
        return tf.constant(0, tf.int64)     # strings, resources: not trained
    return tf.reduce_sum(tf.cast(tf.reshape(words, [-1]), tf.int64))


def values(variables: Sequence) -> tf.Tensor:
    """This worker's fingerprint of each variable (an int64 vector)."""
    if not variables:
        return tf.zeros([0], tf.int64)
    return tf.stack([_bits(tf.convert_to_tensor(v)) for v in variables])


def compare(rows: np.ndarray, names: Sequence[str], what: str) -> None:
    """Raises ReplicasDriftedError if the workers' rows differ."""
    different = [i for i in range(rows.shape[1]) if len(set(rows[:, i].tolist())) > 1]
    if not different:
        return
    shown = "; ".join(
        f"{names[i]}: " + ", ".join(f"rank {r} {int(rows[r, i]):#x}" for r in range(rows.shape[0]))
        for i in different[:_SHOWN])
    more = f" and {len(different) - _SHOWN} more" if len(different) > _SHOWN else ""
    raise ReplicasDriftedError(
        f"bps_tf: the workers' copies of the model have drifted apart ({what}): "
        f"{len(different)} variable(s) differ -- {shown}{more}. Every worker must apply the "
        f"same summed gradients: a worker skipped an exchange or applied its own update, or "
        f"a weight was changed on some workers only (a rank-dependent callback, a restore on "
        f"one worker). Checked every {every()} steps (BYTEPS_FINGERPRINT_STEPS).")


def _exchange(variables, key: str) -> tf.Tensor:
    """Every worker's fingerprints, one row per rank: this worker's row
    placed by its rank, the rows summed. Rank and size are read when the
    graph runs, so a traced step keeps checking after an elastic change."""
    size, rank = membership.size(), membership.rank()
    mine = tf.reshape(values(variables), [1, -1])
    table = tf.scatter_nd([[rank]], mine, [size, len(variables)])
    with collectives.membership_free():
        return collectives.push_pull_sum(table, naming.part_key(key, "fingerprint"),
                                         collectives.BLOCKING_PRIORITY)


def check_now(variables: Sequence, key: str, what: str) -> None:
    """Eager: exchange and compare the fingerprints of ``variables`` now."""
    rows = _exchange(variables, key).numpy()
    compare(rows, [naming.variable_name(v) for v in variables], what)


_eager_steps: Dict[str, int] = {}
_lock = threading.Lock()


def checked(tensors: List, variables: Sequence, key: str, what: str) -> List:
    """``tensors`` (a step's reduced gradients), made to depend on a check
    of ``variables``' fingerprints every :func:`every` calls under ``key``.
    Eagerly the check runs now when due; in a graph it is a ``tf.cond`` on a
    step counter, run with the gradients."""
    n = every()
    variables = [v for v in variables if v is not None]
    if n <= 0 or basics.size() <= 1 or not variables:
        return tensors
    if tf.executing_eagerly():
        if _due(key, n):
            check_now(variables, key, what)
        return tensors
    names = [naming.variable_name(v) for v in variables]

    def exchange():
        rows = _exchange(variables, key)

        def verify(found):
            compare(found.numpy(), names, what)
            return np.int64(0)
        return tf.py_function(verify, [rows], tf.int64)

    # The step count lives in Python, not in a variable: a TF1 graph may run
    # its initializer before the train op is built, and a graph-keyed
    # variable would not survive a second graph of the same key.
    due = tf.py_function(lambda: _due(key, n), [], tf.bool)
    due.set_shape([])
    done = tf.cond(due, exchange, lambda: tf.constant(0, tf.int64))
    with tf.control_dependencies([done]):
        return [_after(t) for t in tensors]


def _after(tensor):
    """``tensor`` again, made under the current control dependencies."""
    if tensor is None:
        return None
    if isinstance(tensor, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(tensor.values), tensor.indices, tensor.dense_shape)
    return tf.identity(tensor)


def _due(key: str, n: int) -> bool:
    """Counts one step of ``key``; whether its check is due now."""
    with _lock:
        step = _eager_steps[key] = _eager_steps.get(key, 0) + 1
    return step % n == 0


def reset_steps() -> None:
    """Elastic: after a membership restart every worker (newcomers too)
    counts its steps from zero, so the checks stay at the same steps."""
    with _lock:
        _eager_steps.clear()
