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

That needs Keras' epoch iterator, a private class, and four of its
attributes: registry entries (group ``keras.epochs``). When a release moves
one, the fallback keeps the promise its warning makes: the workers compare
the counts ``fit`` and ``evaluate`` report to their callbacks (and, for
``fit``'s validation data, the count its arrays or dataset give) before
the first step, and different counts raise on every worker at once
(:func:`check_counts`) instead of leaving the longer ones waiting.
"""
from __future__ import annotations

import functools
import logging
import math
import weakref

import tensorflow as tf

from bps_tf.comm import exchange
from bps_tf.hooks import registry as hooks
from bps_tf.hooks import roles
from bps_tf.hooks.entries import PrivateAttribute

log = logging.getLogger("bps_tf")

COUNTS_NAME = "bps.strategy/epoch_batches"
GROUP = "keras.epochs"

_warned: set = set()
_adapter: list = []
_unsized: "weakref.WeakSet" = weakref.WeakSet()   # iterators left unsized here
_OWN = -2   # a worker whose dataset is its own (not sharded by tf.distribute)
_WHY = ("Keras sizes an epoch from this worker's data before tf.distribute sees it; workers "
        "with different counts would wait for each other forever")


def _attribute(attr, changes):
    return PrivateAttribute(f"keras epoch iterator.{attr}", GROUP, roles.epoch_iterator_class,
                            attr, ("__init__",), roles.EPOCH_ITERATOR_ROLE, changes=changes,
                            why=_WHY, when_missing="fallback")


NUM_BATCHES = _attribute("_num_batches", "read as this worker's count; None leaves the epoch "
                                         "unsized")
STRATEGY = _attribute("_distribute_strategy", "read: whether the epoch is a BytePSStrategy's")
ADAPTER = _attribute("data_adapter", "read: whether the data is a user's tf.data.Dataset")
STEPS = _attribute("steps_per_epoch", "read: whether the user chose the epoch's length")


def _iterator_method(attr):
    locate = lambda: (hooks.defining_class(roles.epoch_iterator_class(), attr), attr)  # noqa
    # A release that renames the base class leaves no iterator to find.
    locate.keras_name = "EpochIterator" if attr == "__init__" else attr
    return locate


@hooks.register("keras epoch iterator.__init__", GROUP, _iterator_method("__init__"),
                changes="an epoch whose batch counts differ across workers runs until all "
                        "are out of data", why=_WHY, when_missing="fallback", private=True,
                found_by="role: " + roles.EPOCH_ITERATOR_ROLE)
def _iterator_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _sizing_hooks_present() and unsized(self):
            _unsized.add(self)
            NUM_BATCHES.set(self, None)
    return __init__


@hooks.register("keras epoch iterator.reset", GROUP, _iterator_method("reset"),
                changes="keeps such an epoch unsized when Keras reads the local count again",
                why=_WHY, when_missing="fallback", private=True,
                found_by="role: " + roles.EPOCH_ITERATOR_ROLE)
def _iterator_reset(original):
    @functools.wraps(original)
    def reset(self):
        original(self)
        if self in _unsized:
            NUM_BATCHES.set(self, None)
    return reset


def _sizing_hooks_present() -> bool:
    return not hooks.missing(GROUP)


def _dataset_adapter():
    return roles.dataset_adapter_class(), "get_tf_dataset"


_dataset_adapter.found_by = "role: the class of what Keras' own get_data_adapter makes for a " \
                            "tf.data.Dataset"
_dataset_adapter.keras_name = "get_data_adapter"
hooks.probe("keras data adapter of a tf.data.Dataset", GROUP, _dataset_adapter,
            changes="tells a user's tf.data.Dataset (which may carry AutoShardPolicy.OFF) from "
                    "data Keras shards itself", why=_WHY, when_missing="fallback")


def _own_data(iterator) -> bool:
    # Only a user's tf.data.Dataset can carry the OFF policy (Keras shards the
    # pipelines it builds from arrays by DATA); its adapter hands the dataset
    # back as it was given, where others would build theirs again. A dataset
    # the user distributed already has no options to read.
    adapter = _dataset_adapter_class()
    data_adapter = ADAPTER.get(iterator)
    if adapter is None or not isinstance(data_adapter, adapter):
        return False
    dataset = data_adapter.get_tf_dataset()
    return (isinstance(dataset, tf.data.Dataset) and
            dataset.options().experimental_distribute.auto_shard_policy ==
            tf.data.experimental.AutoShardPolicy.OFF)


def _dataset_adapter_class():
    """Keras' adapter of a user's tf.data.Dataset (found by role), or None
    when this Keras has none to find: every dataset then counts as sharded."""
    if not _adapter:
        if hooks.locate_entry("keras data adapter of a tf.data.Dataset"):
            _adapter.append(roles.dataset_adapter_class())
        else:
            log.warning("bps_tf: cannot tell a user's tf.data.Dataset in this Keras (%s): "
                        "a dataset with AutoShardPolicy.OFF needs steps_per_epoch.",
                        hooks.missing(GROUP).get("keras data adapter of a tf.data.Dataset"))
            _adapter.append(None)
    return _adapter[0]


def unsized(iterator, is_bps=None) -> bool:
    """Whether Keras' epoch iterator must run until every worker is out of
    data: a worker's dataset is its own, or the workers' counts differ
    (called as each iterator is made)."""
    from bps_tf.strategy.identity import is_bps_strategy
    strategy = STRATEGY.get(iterator)
    if (not (is_bps or is_bps_strategy)(strategy) or strategy.num_workers <= 1
            or strategy.mode == "async" or STEPS.get(iterator)):
        return False
    local = NUM_BATCHES.get(iterator)
    if not _sizing_hooks_present():
        return False    # an entry moved just now: the fallback's checks decide
    mine = _OWN if _own_data(iterator) else -1 if local is None else int(local)
    counts = _allgather_counts(mine)
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


def _allgather_counts(mine: int) -> list:
    return exchange.allgather(tf.constant([mine], tf.int64), name=COUNTS_NAME).numpy().tolist()


# --------------------------------------------------------------------------
# The fallback: counts compared before the first step
# --------------------------------------------------------------------------
def sized_by_hooks() -> bool:
    """Whether Keras' epochs are sized by the hooks above (False: a release
    moved one of them; :func:`check_counts` runs instead)."""
    hooks.install(GROUP)
    return _sizing_hooks_present()


def check_counts(count, what: str) -> None:
    """Raises on every worker, before the first step, when the workers' batch
    counts for ``what`` differ (``count``: this worker's, None if unknown:
    then Keras itself runs until the data ends, as tf.distribute agrees)."""
    counts = _allgather_counts(-1 if count is None else int(count))
    known = [c for c in counts if c >= 0]
    if len(set(known)) <= 1 or len(known) < len(counts):
        return
    raise ValueError(
        f"BytePSStrategy: the workers' data for {what} holds different numbers of batches "
        f"({', '.join(map(str, counts))}, by rank), and this Keras ({hooks.keras_version()}) "
        f"moved what bps_tf uses to run such an epoch until every worker is out of data "
        f"({'; '.join(sorted(hooks.missing(GROUP)))}). Pass steps_per_epoch= (and "
        f"validation_steps=, or steps= to evaluate) to choose the length, or give every "
        f"worker as many batches.")


def batches_of(x, batch_size=None, steps=None, split: float = 0.0, validation=False):
    """The number of batches Keras makes of ``x`` (None when it cannot be
    told without Keras' private adapters): ``steps``; a dataset's finite
    cardinality; ``len()`` of a PyDataset or Sequence; arrays' rows (after
    ``validation_split``, on the side ``validation`` names) over
    ``batch_size`` (32 by default), rounded up."""
    if steps is not None:
        return int(steps)
    if isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        return cardinality if cardinality >= 0 else None
    if hasattr(x, "__len__") and hasattr(x, "__getitem__") and not _is_rows(x):
        try:
            return len(x)
        except TypeError:
            return None
    if not _is_rows(x):
        return None
    rows = len(tf.nest.flatten(x)[0])
    if split:
        train = int(math.floor(rows * (1.0 - split)))
        rows = rows - train if validation else train
    return math.ceil(rows / (batch_size or 32))


def _is_rows(x) -> bool:
    from bps_tf.strategy import predictions
    return predictions.is_row_data(x)
