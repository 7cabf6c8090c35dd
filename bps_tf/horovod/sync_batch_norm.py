"""``SyncBatchNormalization``: batch normalization over the global batch.

In training, the batch mean and variance are those of the batch of all
workers together: each worker sums, per channel, its element count, its
values and their squares (in float64), the three are summed across workers
in one push_pull at the blocking priority (``bps_tf.comm.collectives``), and

    mean = sum / count,    variance = sum_of_squares / count - mean ** 2.

Everything else (moving statistics, inference, masks, renorm, the
configuration) is the framework's ``BatchNormalization``. Gradients flow
through the push_pull (its gradient is the sum of the workers' gradients),
so each worker's inputs get the gradient of the global statistics.

Under Keras 3 the layer is a ``keras.layers.BatchNormalization``; with
``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is tf_keras, as for Horovod's
Keras-2 scripts) it is a tf_keras one, so it fits in tf_keras models; it
then refuses ``fused=True`` (the fused kernel computes its own moments).

Key: ``SyncBatchNormalization/<layer path>`` (made unique within a traced
function); workers must build the same layers under the same names. Before
``bps_tf.init()`` the layer behaves like ``BatchNormalization``.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from bps_tf.hooks import registry
from bps_tf.horovod.sync_batch_norm_entries import FEATURE, MOMENTS, REDUCTION_AXES
from bps_tf.horovod.sync_moments import global_moments
from bps_tf.runtime import basics
from bps_tf.runtime.config import tf_keras_enabled

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="bps_tf")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are
    computed over the batches of all workers (same arguments)."""

    def __init__(self, *args, **kwargs):
        registry.require_entries([MOMENTS, REDUCTION_AXES.name], FEATURE)
        super().__init__(*args, **kwargs)

    def _moments(self, inputs, mask):
        if not basics.is_initialized():
            return super()._moments(inputs, mask)
        weights = None if mask is None else tf.expand_dims(mask, -1)
        return global_moments(inputs, list(REDUCTION_AXES.get(self, feature=FEATURE)), weights,
                              self.path or self.name)


if tf_keras_enabled():
    from bps_tf.horovod.sync_batch_norm_legacy import SyncBatchNormalization  # noqa: F811
