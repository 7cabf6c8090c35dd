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
that ran out first feeding empty batches (``bps_tf.strategy.data_check``), and one
warning says so. ``steps_per_epoch`` given by the user is left alone, and so
is ``mode="async"``, where workers never wait for each other.
"""
from __future__ import annotations

import logging

import tensorflow as tf

from bps_tf.comm import exchange
from bps_tf.runtime import hooks

log = logging.getLogger("bps_tf")

COUNTS_NAME = "bps.strategy/epoch_batches"

_warned: set = set()
_adapter: list = []
_OWN = -2   # a worker whose dataset is its own (not sharded by tf.distribute)


def _own_data(iterator) -> bool:
    # Only a user's tf.data.Dataset can carry the OFF policy (Keras shards the
    # pipelines it builds from arrays by DATA); its adapter hands the dataset
    # back as it was given, where others would build theirs again. A dataset
    # the user distributed already has no options to read.
    adapter = _dataset_adapter_class()
    if adapter is None or not isinstance(iterator.data_adapter, adapter):
        return False
    dataset = iterator.data_adapter.get_tf_dataset()
    return (isinstance(dataset, tf.data.Dataset) and
            dataset.options().experimental_distribute.auto_shard_policy ==
            tf.data.experimental.AutoShardPolicy.OFF)


def _dataset_adapter_class():
    """Keras' adapter of a user's tf.data.Dataset (found by role), or None
    when this Keras has none to find: every dataset then counts as sharded."""
    if not _adapter:
        try:
            _adapter.append(hooks.dataset_adapter_class())
        except hooks.HookMissing as exc:
            log.warning("bps_tf: cannot tell a user's tf.data.Dataset in this Keras (%s): "
                        "a dataset with AutoShardPolicy.OFF needs steps_per_epoch.", exc)
            _adapter.append(None)
    return _adapter[0]


def unsized(iterator, is_bps) -> bool:
    """Whether Keras' epoch iterator must run until every worker is out of
    data: a worker's dataset is its own, or the workers' counts differ
    (keras_hooks calls it as each iterator is made; ``is_bps(strategy)``
    tells a BytePSStrategy)."""
    strategy = getattr(iterator, "_distribute_strategy", None)
    if (not is_bps(strategy) or strategy.num_workers <= 1 or strategy.mode == "async"
            or iterator.steps_per_epoch):
        return False
    local = iterator._num_batches   # pylint: disable=protected-access
    mine = _OWN if _own_data(iterator) else -1 if local is None else int(local)
    counts = exchange.allgather(tf.constant([mine], tf.int64), name=COUNTS_NAME).numpy().tolist()
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
