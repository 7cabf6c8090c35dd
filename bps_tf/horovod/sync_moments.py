"""The global batch moments behind SyncBatchNormalization (Keras 3 and
tf_keras layers alike): per channel, each worker's element count, sum and
sum of squares (float64), summed across workers in one push_pull."""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.comm.collectives import BLOCKING_PRIORITY


def global_moments(inputs, axes, weights, layer_name, keepdims=False):
    """Mean and variance over ``axes`` of every worker's ``inputs``
    (``weights``: per-element weights broadcastable to ``inputs``, or None)."""
    x = tf.cast(inputs, tf.float64)
    weights = tf.ones_like(x) if weights is None else tf.broadcast_to(
        tf.cast(weights, tf.float64), tf.shape(x))
    count = tf.reduce_sum(weights, axes, keepdims=keepdims)
    total = tf.reduce_sum(x * weights, axes, keepdims=keepdims)
    squares = tf.reduce_sum(x * x * weights, axes, keepdims=keepdims)
    key = naming.op_key("SyncBatchNormalization", layer_name)
    summed = collectives.push_pull_sum(tf.stack([count, total, squares]), key,
                                       BLOCKING_PRIORITY)
    count, total, squares = tf.unstack(summed)
    count = tf.maximum(count, 1.0)
    mean = total / count
    variance = tf.maximum(squares / count - mean * mean, 0.0)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
