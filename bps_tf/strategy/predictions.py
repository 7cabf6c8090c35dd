"""Predictions for every row on every worker: ``gather_predictions``.

Under ``BytePSStrategy`` Keras' own ``predict`` would distribute ``x`` like a
training set: each worker predicts its shard of every batch and returns only
that (Keras gathers across workers only for its own multi-worker strategy).
A user who passed ``x`` expects the predictions of ``x``. Here each worker
predicts one contiguous block of rows (worker r: rows ``[r*n/N, (r+1)*n/N)``)
by calling the model in batches, and the blocks are gathered in rank order,
so every worker returns all rows, in order.

``keras_hooks`` routes ``model.predict`` of a model under a multi-worker
``BytePSStrategy`` here (unless the strategy was made with
``predict="shard"``); this module imports neither the strategy nor Keras'
trainer, so both can import it.
"""
from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.runtime import basics

__all__ = ["gather_predictions", "is_row_data"]

DEFAULT_BATCH_SIZE = 32   # Keras' predict default


def is_row_data(x) -> bool:
    """True if ``x`` is an array, a tensor, or a (nested) structure of them
    with one common first dimension: inputs whose rows can be split here.
    Datasets, generators and ``PyDataset`` are not."""
    if x is None or isinstance(x, tf.data.Dataset):
        return False
    try:
        flat = tf.nest.flatten(x)
    except TypeError:
        return False
    if not flat:
        return False
    lengths = set()
    for a in flat:
        if not isinstance(a, (np.ndarray, tf.Tensor)) and not hasattr(a, "__array__"):
            return False
        shape = np.shape(a)
        if not shape:
            return False
        lengths.add(shape[0])
    return len(lengths) == 1


def gather_predictions(model, x, batch_size: int = 256):
    """``model``'s predictions for all rows of ``x``, in order, on every worker.

    ``x``: an array, a tensor, or a structure of them; every worker must pass
    the same ``x`` and call this at the same point of the program. Returns
    numpy arrays (the model's output structure).
    """
    batch_size = int(batch_size or DEFAULT_BATCH_SIZE)
    flat_x = [np.asarray(a) for a in tf.nest.flatten(x)]
    n = len(flat_x[0])
    size, rank = (basics.size(), basics.rank()) if basics.is_initialized() else (1, 0)
    lo, hi = rank * n // size, (rank + 1) * n // size
    predict = _predict_function(model)
    outputs, structure = [], None
    for start in range(lo, hi, batch_size):
        batch = tf.nest.pack_sequence_as(x, [a[start:min(hi, start + batch_size)]
                                             for a in flat_x])
        structure = predict(batch)
        outputs.append([np.asarray(o) for o in tf.nest.flatten(structure)])
    if not outputs:   # this worker has no rows: learn the output shapes
        structure = predict(tf.nest.pack_sequence_as(x, [a[:1] for a in flat_x]))
        outputs.append([np.asarray(o)[:0] for o in tf.nest.flatten(structure)])
    local = [np.concatenate(parts, axis=0) for parts in zip(*outputs)]
    if size == 1:
        return tf.nest.pack_sequence_as(structure, local)
    gathered = []
    for i, a in enumerate(local):
        rows, _ = collectives.allgather(tf.convert_to_tensor(a), naming.strategy_key("predict", i),
                                        rank, size, collectives.BLOCKING_PRIORITY,
                                        widen=True, key_per_size=True)
        gathered.append(rows.numpy())
    return tf.nest.pack_sequence_as(structure, gathered)


# model -> its prediction function. The function holds the model weakly, so
# the cache does not keep models alive (and nothing is set on the model,
# where Keras would track it).
_predict_functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _predict_function(model):
    fn = _predict_functions.get(model)
    if fn is None:
        ref = weakref.ref(model)
        fn = tf.function(lambda batch: ref()(batch, training=False), reduce_retracing=True)
        _predict_functions[model] = fn
    return fn
