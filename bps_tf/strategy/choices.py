"""The choices every worker of a BytePSStrategy must make alike, agreed in
one push_pull when the strategy starts: a worker that chose otherwise would
wait for push_pulls the others never send."""
from __future__ import annotations

import os

import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.runtime import basics, config


def overlap_wanted(is_async: bool, overlap) -> bool:
    """This worker's overlap choice: ``overlap=`` or BYTEPS_OVERLAP (off
    by default in async mode, which has no barrier to overlap)."""
    if overlap is None and is_async and "BYTEPS_OVERLAP" not in os.environ:
        overlap = False
    overlap = bool(config.value("BYTEPS_OVERLAP") if overlap is None else overlap)
    if overlap and is_async:
        raise ValueError("BYTEPS_OVERLAP=1 with asynchronous training: there is no step "
                         "barrier to overlap; unset one of them.")
    return overlap


# (what, how a worker sets it) of each choice, in the order of the vote.
_CHOICES = (("use mode='async'", "mode=, BYTEPS_ENABLE_ASYNC", "the others mode='sync'"),
            ("chose overlap=True", "overlap=, BYTEPS_OVERLAP", "the others False"),
            ("have BYTEPS_EARLY_DATA_CHECK=1", "BYTEPS_EARLY_DATA_CHECK", "the others 0"))


def agreed(is_async: bool, overlap: bool, local_replicas: int = 1):
    """(overlap, early data check); every worker must choose the same mode,
    overlap and BYTEPS_EARLY_DATA_CHECK, and run as many local replicas
    (devices): one push_pull of every worker's choices, in rank order, or
    they would wait for each other forever -- or, with different replica
    counts, divide their sums and means by different numbers."""
    early = bool(config.value("BYTEPS_EARLY_DATA_CHECK"))
    size = basics.size()
    if size == 1:
        return overlap, early
    mine = tf.constant([[int(is_async), int(overlap), int(early), int(local_replicas)]],
                       tf.int32)
    table = tf.scatter_nd([[basics.rank()]], mine, [size, 4])
    rows = collectives.push_pull_sum(table, naming.strategy_key("mode"),
                                     collectives.BLOCKING_PRIORITY).numpy()
    for column, (what, set_by, others) in enumerate(_CHOICES):
        votes = int(rows[:, column].sum())
        if votes not in (0, size):
            ranks = [r for r in range(size) if rows[r, column]]
            raise ValueError(f"BytePSStrategy: {votes} of {size} workers {what} (ranks "
                             f"{ranks}) and {others}; every worker must choose the same "
                             f"({set_by}).")
    replicas = rows[:, 3].tolist()
    if len(set(replicas)) > 1:
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(replicas))
        raise ValueError(f"BytePSStrategy: the workers run different numbers of local replicas "
                         f"(devices) ({shown}); num_replicas_in_sync, the loss scaling and every "
                         f"MEAN would differ across workers. Give every worker the same devices "
                         f"(BytePSStrategy(devices=[...]) or the same GPUs per process).")
    return overlap, early
