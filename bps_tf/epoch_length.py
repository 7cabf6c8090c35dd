"""Every worker runs the same number of steps in an epoch.

Keras sizes an epoch from its dataset's cardinality when that is known.
Under ``BytePSStrategy`` with several workers, each worker's dataset is its
own (``AutoShardPolicy.OFF``, per-worker files, arrays of different lengths),
so workers holding 5 and 8 batches would run 5 and 8 steps, and the longer
one would wait for sums the other never sends.

When Keras makes an epoch iterator (``fit``, its validation, ``evaluate``),
the workers compare their counts in one allgather. If they agree nothing
changes. If they differ, or a worker's dataset is its own
(``AutoShardPolicy.OFF``: tf.distribute then splits each of its batches over
every replica, so the dataset's count is not the number of steps and Keras
would stop after a fraction of the data), the epoch is left unsized: it runs, as
tf.distribute's own loops do, until every worker is out of data, the workers
that ran out first feeding empty batches (``bps_tf.data_check``), and one
warning says so. ``steps_per_epoch`` given by the user is left alone, and so
is ``mode="async"``, where workers never wait for each other.
"""
from __future__ import annotations

import functools
import logging

import tensorflow as tf

from bps_tf import api

log = logging.getLogger("bps_tf")

COUNTS_NAME = "bps.strategy/epoch_batches"

_predicates: list = []   # tell a BytePSStrategy (shared with keras_patches)
_warned: set = set()


def install(predicates: list) -> None:
    """Wraps Keras' TensorFlow epoch iterator (once); ``predicates`` is the
    live list of functions that recognise a BytePSStrategy."""
    global _predicates
    _predicates = predicates
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
    except ImportError:
        return
    cls = tf_trainer.TFEpochIterator
    if getattr(cls.__init__, "_bps_agreed", False):
        return
    original_init, original_reset = cls.__init__, cls.reset

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._bps_unsized = _counts_differ(self)
        if self._bps_unsized:
            self._num_batches = None

    @functools.wraps(original_reset)
    def reset(self):
        original_reset(self)
        if getattr(self, "_bps_unsized", False):
            self._num_batches = None   # reset() reads the local count again

    __init__._bps_agreed = True
    cls.__init__, cls.reset = __init__, reset


_OWN = -2   # a worker whose dataset is its own (not sharded by tf.distribute)


def _own_data(iterator) -> bool:
    try:
        dataset = iterator.data_adapter.get_tf_dataset()
        policy = dataset.options().experimental_distribute.auto_shard_policy
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return False
    return policy == tf.data.experimental.AutoShardPolicy.OFF


def _counts_differ(iterator) -> bool:
    """Whether the workers' batch counts for this epoch iterator differ."""
    strategy = getattr(iterator, "_distribute_strategy", None)
    if strategy is None or not any(pred(strategy) for pred in _predicates):
        return False
    if strategy.num_workers <= 1 or getattr(strategy, "mode", "sync") == "async":
        return False
    if iterator.steps_per_epoch:
        return False
    local = iterator._num_batches   # pylint: disable=protected-access
    own = _own_data(iterator)
    mine = tf.constant([_OWN if own else -1 if local is None else int(local)], tf.int64)
    counts = api.allgather(mine, name=COUNTS_NAME).numpy().tolist()
    if _OWN in counts:
        # AutoShardPolicy.OFF: each worker's batch is a global batch, split
        # over every replica, so a worker takes several steps per batch of its
        # dataset; the dataset's count says nothing of the steps.
        return True
    if len(set(counts)) == 1:
        return False
    shown = ", ".join("unknown" if c < 0 else str(c) for c in counts)
    if shown not in _warned:
        _warned.add(shown)
        log.warning("BytePSStrategy: the workers' datasets hold different numbers of batches "
                    "(%s, by rank): each epoch runs until every worker is out of data, the "
                    "others feeding empty batches. Pass steps_per_epoch to choose the length.",
                    shown)
    return True
