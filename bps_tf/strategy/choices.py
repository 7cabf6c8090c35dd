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


def agreed(is_async: bool, overlap: bool):
    """(overlap, early data check); every worker must choose the same mode,
    overlap and BYTEPS_EARLY_DATA_CHECK (one push_pull of the votes), or they
    would wait for each other forever."""
    early = bool(config.value("BYTEPS_EARLY_DATA_CHECK"))
    size = basics.size()
    if size == 1:
        return overlap, early
    votes = collectives.push_pull_sum(tf.constant([int(is_async), int(overlap), int(early)],
                                                  tf.int32),
                                      naming.strategy_key("mode"), collectives.BLOCKING_PRIORITY)
    async_votes, overlap_votes, early_votes = (int(v) for v in votes.numpy())
    if async_votes not in (0, size):
        raise ValueError(f"BytePSStrategy: {async_votes} of {size} workers use mode='async' "
                         "and the others mode='sync'; every worker must use the same mode "
                         "(and the same BYTEPS_ENABLE_ASYNC).")
    if overlap_votes not in (0, size):
        raise ValueError(f"BytePSStrategy overlap: {overlap_votes} of {size} workers chose overlap=True "
                         "and the others False (BYTEPS_OVERLAP or overlap=); all must choose the same.")
    if early_votes not in (0, size):
        raise ValueError(f"BytePSStrategy: BYTEPS_EARLY_DATA_CHECK is 1 on {early_votes} of {size} "
                         "workers and 0 on the others; all must choose the same.")
    return overlap, early
