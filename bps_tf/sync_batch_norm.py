"""``SyncBatchNormalization``: Keras 3 batch normalization over the global batch.

In training, the batch mean and variance are those of the batch of all
workers together: each worker sums, per channel, its element count, its
values and their squares (in float64), the three are summed across workers
in one push_pull at the blocking priority (``bps_tf.collectives``), and

    mean = sum / count,    variance = sum_of_squares / count - mean ** 2.

Everything else (moving statistics, inference, masks, renorm, the
configuration) is Keras' ``BatchNormalization``. Gradients flow through the
push_pull (its gradient is the sum of the workers' gradients), so each
worker's inputs get the gradient of the global statistics.

Key: ``SyncBatchNormalization/<layer path>`` (made unique within a traced
function); workers must build the same layers under the same names. Before
``bps_tf.init()`` the layer behaves like ``BatchNormalization``.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from bps_tf import basics, collectives, naming
from bps_tf.collectives import BLOCKING_PRIORITY

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="bps_tf")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are
    computed over the batches of all workers (same arguments)."""

    def _moments(self, inputs, mask):
        if not basics.is_initialized():
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.cast(inputs, tf.float64)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64),
                                      tf.shape(x))
        count = tf.reduce_sum(weights, axes)
        total = tf.reduce_sum(x * weights, axes)
        squares = tf.reduce_sum(x * x * weights, axes)
        key = naming.op_key("SyncBatchNormalization", self.path or self.name)
        packed = tf.stack([count, total, squares])
        summed = collectives.push_pull_sum(packed, key, BLOCKING_PRIORITY)
        count, total, squares = tf.unstack(summed)
        count = tf.maximum(count, 1.0)
        mean = total / count
        variance = tf.maximum(squares / count - mean * mean, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
