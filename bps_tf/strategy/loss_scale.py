"""Mixed precision across workers: one loss-scale decision for the whole job.

Keras 3's ``LossScaleOptimizer`` (what ``compile`` uses under a
``mixed_float16`` policy) checks the gradients for inf/nan *before* they are
summed -- the sum happens later, inside the inner optimizer's ``apply`` -- and
acts on that check alone (under a strategy, on the first local replica's).
A worker whose own gradients overflowed would skip the step and halve its
scale while the others apply it: their weights and scales part ways, or the
others wait for a sum the skipping worker never sends.

Here the check is agreed. Every worker (and every local replica) counts
whether its gradients are finite, the counts are summed, and the step is
applied only if every one of them was: all skip, or all apply, and every
worker's scale stays the same, as in a single process training on the
global batch. This holds under ``BytePSStrategy`` (the count goes through the
replica context's all-reduce) and for ``bps_tf.keras.DistributedOptimizer``
outside a strategy (one allreduce over the optimizer's process set).
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm.allreduce import allreduce
from bps_tf.comm.reduction import Sum
from bps_tf.runtime import basics
from bps_tf.runtime.process_sets import global_process_set

NONFINITE_NAME = "bps.loss_scale/nonfinite"


def agreed_finite(optimizer, finite, is_bps):
    """``finite`` (this replica's check) made the same on every replica;
    ``is_bps(strategy)`` tells a BytePSStrategy. keras_hooks routes
    ``LossScaleOptimizer.check_finite`` here."""
    total_of = _summer(optimizer, is_bps)
    if total_of is None:
        return finite
    return tf.equal(total_of(tf.cast(tf.logical_not(finite), tf.float32)), 0.0)


def _summer(optimizer, is_bps):
    """The sum of a per-replica count over every replica that must agree,
    or None where this replica's check is already everyone's."""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if (not is_bps(strategy) or strategy.num_replicas_in_sync == 1
                or tf.distribute.in_cross_replica_context()):
            return None
        context = tf.distribute.get_replica_context()
        return lambda count: context.all_reduce(tf.distribute.ReduceOp.SUM, count)
    inner = getattr(optimizer, "inner_optimizer", None)
    if not hasattr(inner, "_bps_process_set") or not basics.is_initialized():
        return None
    process_set = inner._bps_process_set or global_process_set   # pylint: disable=protected-access
    if process_set.size() <= 1 or not process_set.included():
        return None
    return lambda count: allreduce(count, op=Sum, name=NONFINITE_NAME,
                                   process_set=process_set)
